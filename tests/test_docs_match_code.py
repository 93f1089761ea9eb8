"""The docs say what the code has. docs/DESIGN.md: every module and package of the library in its layout tree,
every capability with exactly its methods, every selection method, every command of the command line. README.md:
at most 260 lines, and its install section's extras are pyproject.toml's. Pure reading, no model; each check has a
negative control (a name the code lacks is not found)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")


def section(heading: str) -> str:
    start = TEXT.index(heading)
    end = TEXT.find("\n## ", start + len(heading))
    return TEXT[start:] if end < 0 else TEXT[start:end]


def layout_tree() -> str:
    layout = section("## Layout")
    return layout[layout.index("```\n") + 4: layout.index("\n```", layout.index("```\n") + 4)]


def table_rows(text: str, header: str) -> dict[str, str]:
    """A Markdown table's first cell (a `code` name) -> its second cell, from the table whose header row starts so."""
    rows, inside = {}, False
    for line in text.splitlines():
        if line.startswith(header):
            inside = True
        elif inside and not line.startswith("|"):
            break
        elif inside and (m := re.match(r"\| `(\w[\w -]*)` \| ([^|]*) \|", line)):
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_layout_names_every_module_and_package_of_the_library():
    tree = layout_tree()
    names = [p.name for p in (ROOT / "arr_coc").iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").is_file()]
    written = lambda n: re.search(rf"(?<![\w/]){re.escape(n if n.endswith('.py') else n + '/')}", tree)
    assert [n for n in names if not written(n)] == []
    assert len(names) > 30 and not written("no_such_module.py")            # negative control
    for package in ("serving/vllm", "pipeline", "qwen", "video", "training"):
        files = [p.name for p in (ROOT / "arr_coc" / package).glob("*.py") if p.stem != "__init__"]
        assert [f for f in files if f not in tree] == [], package


def test_the_capability_table_lists_each_capability_with_its_methods():
    from arr_coc.pipeline.backend import CAPABILITIES, Adapts, _members

    rows = table_rows(section("## The front door"), "| capability | methods |")
    assert set(rows) == {c.__name__ for c in CAPABILITIES}
    for capability in CAPABILITIES:
        written = sorted(re.findall(r"`(\w+)`", rows[capability.__name__]))
        assert written == _members(capability), capability.__name__
    old_row = "`adapter_name`, `load_adapter`, `adapted`, `adapter_flops`"        # negative control: the row
    assert sorted(re.findall(r"`(\w+)`", old_row)) != _members(Adapts)           # before default_adapter


def test_the_method_table_lists_every_registered_method():
    from arr_coc.pipeline.selection import METHODS

    rows = table_rows(section("## Selection methods"), "| name | what it keeps |")
    assert set(rows) == set(METHODS)
    assert "no_such_method" not in rows                                       # negative control


def test_the_command_table_lists_every_command():
    """The library's commands by name, the test bed's as `arr_coc_shapes NAME`."""
    from arr_coc.cli import COMMANDS
    from arr_coc_shapes.cli import COMMANDS as SHAPES_COMMANDS

    rows = table_rows(section("## Everything else in the library"), "| command | what it does |")
    assert set(rows) == set(COMMANDS) | {f"arr_coc_shapes {name}" for name in SHAPES_COMMANDS}
    assert "no-such-command" not in rows                                      # negative control


def test_the_core_is_as_many_methods_as_it_says():
    from arr_coc.pipeline.backend import VLMBackend

    own = {n: v for n, v in vars(VLMBackend).items() if not n.startswith("_")}
    methods = sorted(n for n, v in own.items() if callable(v))
    facts = sorted([n for n, v in own.items() if isinstance(v, property)] + list(VLMBackend.__annotations__))
    assert methods == ["build_inputs", "decode", "decode_text", "embed_tokens", "pixels", "prefill",
                       "question_tokens", "read_prompt", "rewrite"]
    assert facts == ["device", "eos_token_ids", "pad_token_id", "text_hidden_size"]
    words = {9: "nine", 4: "four"}
    text = section("## The front door")
    assert f"{words[len(methods)]} methods (" in text and f"{words[len(facts)]} facts (" in text
    assert all(f"`{n}`" in text for n in methods + facts) and "`no_such_method`" not in text


def test_the_readme_is_short_and_installs_with_pyproject_s_extras():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260
    install = readme[readme.index("## Install"):readme.index("\n## ", readme.index("## Install") + 1)]
    assert "make run" in install and "make test" in install and "pip install ." in install
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    shown = {e for group in re.findall(r'pip install "\.\[([\w,-]+)\]"', install) for e in group.split(",")}
    assert shown and shown <= extras, shown - extras
    listed = set(re.findall(r"[\w-]+", install[install.index("with extras:"):].split("\n")[0])) - {"with", "extras",
                                                                                                 "a", "GPU", "or"}
    assert listed == extras, listed ^ extras                  # every extra named, none that pyproject lacks
    assert "no-such-extra" not in extras                      # negative control
