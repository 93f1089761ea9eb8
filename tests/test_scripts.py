"""`scripts/` holds the tools a user runs, each named in the docs and each answering `--help` (a shell script: it
parses, `bash -n`); `scripts/experiments/` the one-off measurements of past work, each compiling and named, with
what it measured and where, in that folder's README.md. `eval_compare.py`, what a refactor is checked with, is
also run on two small reports."""

from __future__ import annotations

import json
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
EXPERIMENTS = SCRIPTS / "experiments"
TOOLS = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file())
EXPERIMENT_FILES = sorted(p.name for p in EXPERIMENTS.iterdir() if p.is_file() and p.name != "README.md")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def test_scripts_holds_tools_and_the_experiments_folder_only():
    assert len(TOOLS) >= 10 and all(n.endswith((".py", ".sh")) for n in TOOLS), TOOLS
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_dir() and p.name != "__pycache__") == ["experiments"]


@pytest.mark.parametrize("name", TOOLS)
def test_every_tool_answers_help(name):
    path = SCRIPTS / name
    if name.endswith(".sh"):
        run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return
    run = subprocess.run([sys.executable, str(path), "--help"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: "), run.stdout[:300]


def test_every_tool_is_named_in_the_docs():
    text = docs_text()
    unnamed = [n for n in TOOLS if f"scripts/{n}" not in text]
    assert unnamed == [], f"tools no page of README.md or docs/ names: {unnamed}"
    assert "scripts/no_such_tool.py" not in text                           # negative control: the check can fail


def test_every_experiment_compiles_and_its_readme_names_each_one(tmp_path):
    readme = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    assert [n for n in EXPERIMENT_FILES if f"`{n}`" not in readme] == []
    named = set(re.findall(r"^\| `([\w.]+)` \|", readme, flags=re.M))
    assert named == set(EXPERIMENT_FILES), named ^ set(EXPERIMENT_FILES)     # no row for a file that is gone
    for name in EXPERIMENT_FILES:
        path = EXPERIMENTS / name
        if name.endswith(".sh"):
            run = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (name, run.stderr)
        else:
            py_compile.compile(str(path), cfile=str(tmp_path / f"{name}c"), doraise=True)


def _report(correct: list[int], kept: list[int]) -> dict:
    return {"ids": ["a", "b", "c"],
            "results": [{"method": "arr_coc_trained", "budget": 0.1, "encode": "before", "correct": correct,
                         "answers": ["red", "2", "star"], "item_kept": kept, "e2e_flops_mean": 1.5e9}]}


def test_eval_compare_passes_identical_reports_and_fails_a_changed_item(tmp_path):
    same, changed = tmp_path / "same.json", tmp_path / "changed.json"
    same.write_text(json.dumps(_report([1, 0, 1], [16, 16, 16])))
    changed.write_text(json.dumps(_report([1, 0, 1], [16, 17, 16])))          # one item kept another count
    tool = [sys.executable, str(SCRIPTS / "eval_compare.py")]
    run = subprocess.run(tool + [str(same), str(same)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "3 of 3 item-rows identical" in run.stdout, run.stdout
    run = subprocess.run(tool + [str(same), str(changed)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "2 of 3 item-rows identical" in run.stdout, run.stdout
    assert "'item_kept': (16, 17)" in run.stdout
