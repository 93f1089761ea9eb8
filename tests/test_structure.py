"""The house's rules, checked from the code itself: no import cycles, the library never imports the
command line or the app, the command line loads only what a command needs, one budget parser."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("arr_coc", "microscope")   # the library and the app package


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports at run time, wherever the import sits (inside functions too:
    a lazy import that hides a cycle is still one); `if TYPE_CHECKING:` blocks never run."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)   # `from pkg import submodule`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports_of(p, modules) for p in files}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_lazy_import(tmp_path):
    """Negative control: two modules that import each other, one of them inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from . import a  # lazy\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    mods = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    rel = lambda p: imports_of(p, mods)  # noqa: E731
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = {module_name(p): rel(p) for p in pkg.glob("*.py")}
    finally:
        ROOT = saved
    assert find_cycles(graph) == [["pkg.a", "pkg.b"]]
    assert graph["pkg.c"] == set()   # typing-only imports never run


def test_no_import_cycles_in_the_library_or_the_app():
    graph = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is it reading the packages?"
    assert find_cycles(graph) == []


def test_the_library_never_imports_the_command_line_or_the_app():
    graph = import_graph()
    library = [m for m in graph if m.startswith("arr_coc") and not m.startswith(("arr_coc.cli", "arr_coc.__main__"))]
    bad = {m: sorted(d for d in graph[m] if d.startswith(("arr_coc.cli", "microscope", "app")))
           for m in library}
    assert {m: d for m, d in bad.items() if d} == {}


@pytest.mark.parametrize("command", ["gen-data", "convert", "train-vlm", "eval", "train", "bench", "ask"])
def test_command_help_loads_no_torch(command):
    """`python -m arr_coc COMMAND --help` answers without importing torch (seconds, not a model load)."""
    code = ("import sys, runpy; sys.argv = ['arr_coc', %r, '--help']\n"
            "try:\n    runpy.run_module('arr_coc', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')") % command
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and out.stdout.strip().endswith("NO-TORCH"), out.stdout[-300:]


def test_every_name_the_scripts_and_the_app_import_from_the_library_exists():
    """Scripts are not run by the suite; a moved name would break them silently."""
    import importlib

    missing = []
    for path in [*(ROOT / "scripts").glob("*.py"), ROOT / "app.py", *(ROOT / "microscope").glob("*.py"),
                 ROOT / "assets" / "examples" / "make_examples.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("arr_coc"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            missing.append(f"{path.name}: {node.module}.{alias.name}")
    assert missing == []
