"""The fork server the vLLM tests run their scripts through (`tests/_vllm.py`): a script's exit status, output,
environment and folder are what a fresh interpreter's would be, a timeout kills that script alone, and a script's
process is its own (not the server's)."""

from __future__ import annotations

import os
import subprocess

import pytest
from _vllm import ROOT, VLLM_PY, needs_vllm, run as vllm_run


SCRIPT = """import os, sys, time
import vllm
print("cwd", os.getcwd(), "flag", os.environ.get("FORKS_FLAG"), "argv", sys.argv[1:], "pid", os.getpid())
print("to stderr", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(60)
if sys.argv[1] == "stdin":
    sys.exit(f"stdin {os.read(0, 64)!r}")
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


@needs_vllm
def test_a_script_through_the_fork_server_is_run_as_a_fresh_interpreter_runs_it(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "FORKS_FLAG": "on"}
    ok, failed = vllm_run([VLLM_PY, script, "0"], env=env, timeout=120), vllm_run([VLLM_PY, script, "3"], env=env,
                                                                                  timeout=120)
    assert (ok.returncode, failed.returncode) == (0, 3)
    assert f"cwd {ROOT} flag on argv ['0']" in ok.stdout and ok.stderr.strip().endswith("to stderr")
    message = vllm_run([VLLM_PY, script, "bad words"], env={**os.environ}, timeout=120)
    assert message.returncode == 1 and "bad words" in message.stderr and "flag None" in message.stdout
    assert "stdin b''" in vllm_run([VLLM_PY, script, "stdin"], env=env, timeout=120).stderr   # empty, not a pipe
    pids = {int(r.stdout.split("pid")[1]) for r in (ok, failed, message)}
    assert len(pids) == 3 and os.getpid() not in pids            # each script a process of its own
    with pytest.raises(subprocess.TimeoutExpired):
        vllm_run([VLLM_PY, script, "sleep"], env=env, timeout=3)
    assert vllm_run([VLLM_PY, script, "0"], env=env, timeout=120).returncode == 0   # the server serves on
