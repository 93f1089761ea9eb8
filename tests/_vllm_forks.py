"""One vLLM import for a whole test session: a fork server the vLLM tests run their scripts through.

Every engine the tests start used to be a fresh `.venv-vllm/bin/python scripts/...` process, and each paid about
11 s of imports (vLLM, torch, transformers) and 2 s of interpreter exit before and after its engine's few seconds of
work. This process imports them once, then forks a child per job: the child starts from that imported state (no
engine, no thread, no torch op has run in the parent, so nothing half-initialised is inherited), takes the job's
working folder, environment, argv and output files, runs the script as `__main__`, and exits; each engine still
lives and dies in a process of its own, as before.

Started in vLLM's environment by `tests/_vllm.py` (its `run`). Protocol, one JSON object per line:
in on stdin {"argv": [script, args...], "cwd", "env", "stdout", "stderr"} (the last two: file paths); out on stdout
{"pid"} when the child starts, then {"returncode"} when it ends.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback


def _preload() -> None:
    """The slow imports every job repeats (measured: 11 s of a 15 s one-request engine run)."""
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import transformers  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401


def _child(job: dict) -> None:
    """The job's script as `__main__` in this forked process; never returns."""
    code = 1
    try:
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        script = os.path.abspath(job["argv"][0])
        sys.argv = [script, *job["argv"][1:]]
        sys.path[0] = os.path.dirname(script)          # as `python script.py` puts the script's folder first
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)    # not the jobs' pipe: nothing it starts can read a job
        sys.stdin = open(os.devnull)
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the script's own traceback, exit status 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()                     # the engines' own shutdown hooks (tensor-parallel workers)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")               # the replies' own pipe: nothing else writes to it
    os.dup2(2, 1)                                    # what the imports print goes to the server's log
    _preload()
    for line in sys.stdin:
        job = json.loads(line)
        for stream in (reply, sys.stdout, sys.stderr):
            stream.flush()                           # nothing buffered is written twice after the fork
        pid = os.fork()
        if pid == 0:
            reply.close()
            _child(job)
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
