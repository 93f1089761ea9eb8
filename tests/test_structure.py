"""The house's rules, checked from the code itself (docs/DESIGN.md, "Layout" and "Dependencies"):

- no import cycle of any kind: between files, counting imports at the top, inside functions and under
  `if TYPE_CHECKING:` (a type-only or lazy import that closes a circle still ties the two files together),
  between packages (a subpackage or a top-level module of `arr_coc` is one node; `arr_coc_microscope` is one), and
  between a package and its own subpackages (`arr_coc_shapes` <-> `arr_coc_shapes.video`: each folder's own
  modules are one node, each subfolder another);
- the library apart from the workbench: nothing under `arr_coc/` (its command line included) imports the test bed
  (`arr_coc_shapes`) or the app, which use the library;
- the layering DESIGN.md states, read off the imports: the core knows nothing of the pipeline, a backend or the
  methods; the pipeline knows no backend and no method; the validator knows no pipeline; selectors know no backend;
  the app and the library never import the command line; Hugging Face model internals are reached from the Qwen
  backend (and the embedded model's own builder) only;
- no function over 80 lines; the command line loads only what a command needs; one budget parser.
Each rule has a negative control that proves the check can fail.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
APP = "arr_coc_microscope"   # the app's package (under the project's name: PyPI's `microscope` is another package)
SHAPES = "arr_coc_shapes"    # the ShapesVQA test bed, in the checkout beside the library
PACKAGES = ("arr_coc", SHAPES, APP)   # the library, the test bed and the app
MAX_FUNCTION_LINES = 80

# The core (`arr_coc/core/`: the layer and what it is made of) and the small owners beside it. They import
# nothing above them.
CORE_MODULES = ("config", "texture", "pixel_maps", "spectral", "kmeans", "components", "extent", "knowing", "balancing",
                "attending", "layer", "persistence", "output", "batch", "grid", "temporal")
CORE = {f"arr_coc.core.{m}" for m in CORE_MODULES} | {"arr_coc.core"} | {f"arr_coc.{m}" for m in (
    "viz", "saccade", "resolution", "budget", "stopwatch", "errors", "geometry", "cancel", "schedule", "lazy")}
ABOVE_THE_CORE = ("arr_coc.pipeline", "arr_coc.qwen", "arr_coc.methods", "arr_coc.evaluation", "arr_coc.training",
                  "arr_coc.harness", "arr_coc.cli", "arr_coc_shapes", "arr_coc.data", APP)
# Where a Hugging Face Qwen-VL model's internals may be reached: the backend, the embedded model's builder and
# trainer (it makes a Qwen2-VL), and the bench, which builds random Qwen models at real widths.
HF_INTERNALS = re.compile(r"\.model\.model\b|\.language_model\b|get_image_features|get_rope_index|"
                          r"mm_encoder_outputs|\.visual\.blocks|model\.generate\(")
HF_ALLOWED = ("arr_coc/qwen/", "arr_coc_shapes/", "arr_coc/evaluation/bench")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """Project modules `path` imports, wherever the import sits: at the top, inside functions (a lazy import that
    hides a cycle is still one) and under `if TYPE_CHECKING:` (a type-only import ties the files together too)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = [p for pkg in packages for p in (root / pkg).rglob("*.py")]
    modules = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, modules, root) for p in files}


def package_of(module: str) -> str:
    """The package-level node: `arr_coc.X` (a subpackage or a top-level module), or the top package itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "arr_coc" and len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        node = package_of(module)
        out.setdefault(node, set()).update(package_of(d) for d in deps if package_of(d) != node)
    return out


def folder_of(module: str, root: Path = ROOT) -> str:
    """The folder-level node: a module below a subpackage (of `arr_coc`, or anywhere below a top-level package)
    belongs to the folder that holds it (a package's own modules are one node, each of its subpackages another);
    `arr_coc`'s own modules, `package_of`; `python -m X`'s entry (`X.__main__`), a node of its own."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return module
    if len(parts) == 1 or parts[0] == "arr_coc" and len(parts) == 2:
        return package_of(module)
    return module if root.joinpath(*parts).is_dir() else ".".join(parts[:-1])


def folder_graph(graph: dict[str, set[str]], root: Path = ROOT) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        node = folder_of(module, root)
        out.setdefault(node, set()).update(folder_of(d, root) for d in deps if folder_of(d, root) != node)
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
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


def long_functions(paths: list[Path], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'file:function (lines)' for every function longer than `limit` lines."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(ROOT)}:{node.name} ({lines})")
    return out


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# ----------------------------------------------------------------------------- negative controls


def test_the_cycle_finder_finds_cycles_of_every_kind(tmp_path):
    """A lazy import, a type-only import and a circle between packages are each found; a one-way import is not."""
    _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/a.py": "from .b import g\n\ndef f():\n    return g()\n",
        "pkg/b.py": "def g():\n    from . import a  # lazy\n    return a\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n",
        "pkg/d.py": "from .c import thing\nclass D: ...\n",
        "pkg/e.py": "from .a import f\n",
        "pkg/up/__init__.py": "", "pkg/up/x.py": "from ..down.y import z\n",
        "pkg/down/__init__.py": "", "pkg/down/y.py": "z = 1\n", "pkg/down/w.py": "from ..up import x\n",
    })
    graph = import_graph(tmp_path, ("pkg",))
    assert find_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]     # lazy, and type-only
    packages = {k.replace("pkg", "arr_coc", 1): {d.replace("pkg", "arr_coc", 1) for d in v} for k, v in graph.items()}
    assert ["arr_coc.down", "arr_coc.up"] in find_cycles(package_graph(packages))   # up -> down -> up, across files
    assert not any("pkg.e" in c for c in find_cycles(graph))                  # one way is no circle


def test_the_folder_check_finds_a_circle_between_a_package_and_its_subpackage(tmp_path):
    """Negative control: the parent's own module imports the child inside a function, the child imports the
    parent's module: no file circle and no circle between top-level packages, yet parent <-> child."""
    _write(tmp_path, {
        "arr_coc/__init__.py": "", "arr_coc_shapes/__init__.py": "",
        "arr_coc_shapes/words.py": "WORDS = ()\n",
        "arr_coc_shapes/tuning.py": "def run():\n    from .video.spec import video_words  # lazy\n"
                                    "    return video_words\n",
        "arr_coc_shapes/video/__init__.py": "", "arr_coc_shapes/video/spec.py": "from ..words import WORDS\n",
        "arr_coc_shapes/video/items.py": "from .spec import WORDS\n",
    })
    graph = import_graph(tmp_path, ("arr_coc", SHAPES))
    assert find_cycles(graph) == [] and find_cycles(package_graph(graph)) == []
    assert find_cycles(folder_graph(graph, tmp_path)) == [["arr_coc_shapes", "arr_coc_shapes.video"]]
    del graph["arr_coc_shapes.tuning"]                                        # the parent no longer looks down
    assert find_cycles(folder_graph(graph, tmp_path)) == []


def test_the_function_length_check_catches_a_long_function(tmp_path, monkeypatch):
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES + "    return x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert long_functions([long]) == [f"long.py:f ({MAX_FUNCTION_LINES + 2})"]


# ----------------------------------------------------------------------------- the rules


def test_no_import_cycles_between_files():
    graph = import_graph()
    assert len(graph) > 40, "the walk found too few modules: is it reading the packages?"
    assert find_cycles(graph) == []


def test_no_import_cycles_between_packages():
    assert find_cycles(package_graph(import_graph())) == []


def test_no_import_cycles_between_a_package_and_its_subpackages():
    """Function-local imports count: `shapes/video_tuning.py` once closed shapes -> shapes.video -> shapes."""
    graph = folder_graph(import_graph())
    assert {"arr_coc_shapes", "arr_coc_shapes.video", "arr_coc.data.convert"} <= set(graph)   # the walk sees folders
    assert find_cycles(graph) == []


def layering_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """DESIGN.md's layering: module -> the imports it may not have (type-only and function-local ones included)."""
    def reaches(module: str, prefixes: tuple[str, ...]) -> list[str]:
        return sorted(d for d in graph[module] if d.startswith(prefixes))

    bad = {}
    for module in graph:
        if module in CORE:
            bad[module] = reaches(module, ABOVE_THE_CORE)
        elif module.startswith("arr_coc.pipeline"):   # backend-agnostic: no backend, no method, nothing above it
            bad[module] = reaches(module, ("arr_coc.qwen", "arr_coc.methods", "arr_coc.evaluation",
                                           "arr_coc.training", "arr_coc.harness", "arr_coc.cli", APP))
        elif module.startswith("arr_coc.validation"):  # the pipeline runs the validator: it knows no pipeline
            bad[module] = reaches(module, ("arr_coc.pipeline", "arr_coc.qwen", "arr_coc.methods", "arr_coc.evaluation",
                                           "arr_coc.training", "arr_coc.harness", "arr_coc.cli", APP))
        elif module.startswith("arr_coc.methods"):     # selectors read a typed context, never a backend
            bad[module] = reaches(module, ("arr_coc.qwen", "arr_coc.evaluation", "arr_coc.cli", APP))
        elif module.startswith(APP):                   # the app uses the library, not the command line
            bad[module] = reaches(module, ("arr_coc.cli",))
        elif module.startswith(SHAPES):                # the test bed's commands serve through the library's main
            bad[module] = [] if module.startswith(f"{SHAPES}.cli") else reaches(module, ("arr_coc.cli", APP))
        elif module.startswith(("arr_coc.cli", "arr_coc.__main__")):
            bad[module] = reaches(module, (APP, SHAPES))
        elif module == "arr_coc" or module.startswith("arr_coc."):   # the library never imports the workbench
            bad[module] = reaches(module, ("arr_coc.cli", APP, SHAPES))
    return {m: d for m, d in bad.items() if d}


def test_the_layers_import_only_downwards():
    assert layering_violations(import_graph()) == {}


def test_the_core_folder_holds_the_layer_and_what_only_it_uses():
    """`arr_coc/core/` is the four stages, the layer and what only they use: a top-level module that only the core
    imports belongs in it, and a stage's helpers (spectral, kmeans, components) serve the texture alone."""
    graph = import_graph()
    assert {p.stem for p in (ROOT / "arr_coc" / "core").glob("*.py")} - {"__init__"} == set(CORE_MODULES)
    users = {m: {k for k, deps in graph.items() if m in deps} for m in graph}
    flat = [m for m in graph if m.count(".") == 1 and (ROOT / "arr_coc" / f"{m.split('.')[1]}.py").exists()]
    assert [m for m in flat if users[m] and all(u.startswith("arr_coc.core.") for u in users[m])] == []
    for helper in ("spectral", "kmeans", "components", "pixel_maps"):
        assert users[f"arr_coc.core.{helper}"] == {"arr_coc.core.texture"}


def test_the_layer_check_sees_an_upward_import(tmp_path):
    """Negative control: a core module that imports the pipeline is reported."""
    graph = {"arr_coc.core.texture": {"arr_coc.pipeline.prompt"}}
    assert [d for d in graph["arr_coc.core.texture"] if d.startswith(ABOVE_THE_CORE)] == ["arr_coc.pipeline.prompt"]


def test_the_layer_check_sees_the_library_reach_into_the_workbench():
    """Negative control: the bench drawing ShapesVQA scenes, the command line serving gen-data, the generator
    importing the command line: each reported; the test bed's own commands serving through the library's main
    are not."""
    graph = {"arr_coc.evaluation.bench": {"arr_coc_shapes.items"}, "arr_coc.cli": {"arr_coc_shapes.cli"},
             "arr_coc_shapes.items": {"arr_coc.cli.args"}, "arr_coc_shapes.cli": {"arr_coc.cli"},
             "arr_coc_microscope.server": {"arr_coc_shapes.items"}}
    assert layering_violations(graph) == {"arr_coc.evaluation.bench": ["arr_coc_shapes.items"],
                                          "arr_coc.cli": ["arr_coc_shapes.cli"],
                                          "arr_coc_shapes.items": ["arr_coc.cli.args"]}


def test_model_internals_are_reached_from_the_backend_only():
    offenders = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(HF_ALLOWED) and HF_INTERNALS.search(path.read_text()):
                offenders.append(rel)
    assert offenders == []
    assert HF_INTERNALS.search("hidden = model.model.language_model(x)")   # negative control: the pattern matches


def test_no_function_is_longer_than_80_lines():
    paths = [p for pkg in (*PACKAGES, "scripts", "assets") for p in (ROOT / pkg).rglob("*.py")] + [ROOT / "app.py"]
    assert len(paths) > 100
    assert long_functions(paths) == []


@pytest.mark.parametrize("package, command", [(SHAPES, "gen-data"), ("arr_coc", "convert"), (SHAPES, "train-vlm"),
                                              ("arr_coc", "eval"), ("arr_coc", "train"), ("arr_coc", "bench"),
                                              ("arr_coc", "ask")])
def test_command_help_loads_no_torch(package, command):
    """`python -m PACKAGE COMMAND --help` answers without importing torch (seconds, not a model load)."""
    code = ("import sys, runpy; sys.argv = [%r, %r, '--help']\n"
            "try:\n    runpy.run_module(%r, run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')") % (package, command, package)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and out.stdout.strip().endswith("NO-TORCH"), out.stdout[-300:]


def test_every_name_the_scripts_and_the_app_import_from_the_library_exists():
    """Scripts are not run by the suite; a moved name would break them silently."""
    import importlib

    missing = []
    for path in [*(ROOT / "scripts").rglob("*.py"), ROOT / "app.py", *(ROOT / APP).glob("*.py"),
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
