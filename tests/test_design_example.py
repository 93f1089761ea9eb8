"""docs/DESIGN.md's "Adding a backend" example runs as written: a VLM that is not Qwen (nor a subclass of its backend)
registered for its model type, loaded by the front door, answering and choosing through the core alone. And a
backend offered by an installed package's `arr_coc.backends` entry point is found the same way."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- tests/test_design_example.py runs this block -->"


def example() -> str:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    assert MARK in text, "DESIGN.md lost its backend example's mark"
    block = re.search(r"```python\n(.*?)```", text[text.index(MARK):], re.S)
    assert block is not None
    return block.group(1)


def test_the_backend_example_in_design_md_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(example(), encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    answer, same = run.stdout.strip().splitlines()[-2:]
    assert re.fullmatch(r"w\d+ 12 of 48", answer) and same == "True"


def test_a_backend_from_an_entry_point_is_picked_by_model_type(monkeypatch, tmp_path):
    from arr_coc.pipeline import registry

    module = tmp_path / "toy_family.py"
    module.write_text("from arr_coc.pipeline.registry import BackendEntry\n"
                      "ENTRY = BackendEntry('toy-family', ('toy_family_vl',), lambda path, **kw: ('loaded', path))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    point = metadata.EntryPoint("toy_family_vl", "toy_family:ENTRY", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.metadata, "entry_points", lambda group: [point] if group == point.group else [])
    monkeypatch.setattr(registry, "_entry_points_read", False)
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "toy_family_vl"}')
    assert registry.load_backend(folder) == ("loaded", folder)
    assert "toy_family_vl" in registry.known_model_types() and "qwen2_vl" in registry.known_model_types()
    (folder / "config.json").write_text('{"model_type": "nobody_serves_this"}')      # negative control
    with pytest.raises(ValueError, match="no ARR-COC backend serves model_type='nobody_serves_this'; served: "):
        registry.load_backend(folder)
