"""How the vLLM tests run their scripts: `run(cmd, env=..., timeout=...)`, like `subprocess.run(cmd,
capture_output=True, text=True)` in the repository root, through one fork server per test session
(`tests/_vllm_forks.py`): vLLM is imported once, and each script still runs in a process of its own, forked from
that imported state. `ARR_COC_VLLM_FORKS=0` runs each as a fresh interpreter instead (the same results, slower).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# Skipped where vLLM's environment is missing, except in CI (CI=true), where a missing environment fails.
needs_vllm = pytest.mark.skipif(not VLLM_PY.exists() and not os.environ.get("CI"),
                                reason="no vLLM environment (make vllm-env; `make test` builds it)")


class _ForkServer:
    """The fork server's process and a thread that reads its replies (so a reply can be waited for with a
    timeout)."""

    def __init__(self) -> None:
        self.log = Path(tempfile.mkdtemp(prefix="vllm-forks-")) / "server.log"
        self.proc = subprocess.Popen([str(VLLM_PY), str(ROOT / "tests" / "_vllm_forks.py")], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.replies.put(json.loads(line))
        self.replies.put(None)                      # the server is gone

    def _reply(self, timeout: float | None) -> dict:
        got = self.replies.get(timeout=timeout)
        if got is None:
            raise RuntimeError(f"the vLLM fork server stopped: {self.log.read_text()[-3000:]}")
        return got

    def run(self, cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="vllm-job-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            job = {"argv": cmd[1:], "cwd": str(ROOT), "env": env, "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(600)["pid"]        # at once, or once the server's first imports are done
            try:
                code = self._reply(timeout)["returncode"]
            except queue.Empty:
                os.kill(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: _ForkServer | None = None


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """`cmd` ([VLLM_PY, script, args...]) in the repository root with `env` (default: this process's), its input
    empty (/dev/null), its output captured as text; `subprocess.TimeoutExpired` after `timeout` seconds, as
    `subprocess.run` raises it."""
    global _server
    env = dict(os.environ if env is None else env)
    if str(cmd[0]) != str(VLLM_PY) or os.environ.get("ARR_COC_VLLM_FORKS") == "0":
        return subprocess.run(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    if _server is None or _server.proc.poll() is not None:
        _server = _ForkServer()
        atexit.register(_server.close)
    return _server.run([str(c) for c in cmd], env, timeout)
