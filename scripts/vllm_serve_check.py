"""The OpenAI-compatible server with the plugin: `vllm serve` on 127.0.0.1, asked through the `openai` client.

Run in the vLLM environment (`make vllm-env`); tests/test_vllm_plugin.py runs it:
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python scripts/vllm_serve_check.py --out serve.json
Asks the example image's question with the server's budget, with a per-request budget, with a bad one (the
server must answer 400 and keep serving), then again; writes what each got: {"answers": {...}, "errors": {...}}.
Pass `--tp 2` for tensor parallelism (on one NUMA node: VLLM_CPU_OMP_THREADS_BIND="0|1"). With `--requests`, a
request's clips (.npy frames) go as `video_url` parts (`clip_url`).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_compare import architecture   # the plugin's architecture for the checkpoint's family


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, layer: str, budget: str | None, port: int, tp: int, log: Path, encode: str = "after",
          adapter: bool = False, dp: int = 1, operator_budget: str | None = None,
          bare: bool = False, clips: bool = False, max_model_len: int = 2048) -> ForkedServer:
    arr_coc = {"layer": layer, "encode": encode, **({} if budget is None else {"budget": budget})}
    if bare:                        # the layer alone, its folder's adapter (if any) not served
        arr_coc["adapter"] = False
    overrides = {"architectures": [architecture(model)], "arr_coc": arr_coc}
    # The operator's default budget as vLLM users give defaults (the plugin reads it; transformers never sees it).
    operator = [] if operator_budget is None else \
        ["--mm-processor-kwargs", json.dumps({"arr_coc_budget": operator_budget})]
    # The layer's LoRA adapter: vLLM's LoRA, on the tower too, run by every chat request with an image.
    lora = ["--enable-lora", "--enable-tower-connector-lora", "--max-lora-rank", "16", "--default-mm-loras",
            json.dumps({"image": os.path.abspath(os.path.join(layer, "adapter"))})] if adapter else []
    # A clip's frames arrive as "video/jpeg" data URLs, read at --media-io-kwargs' fps (1 unless told,
    # multimodal/media/video.py:147): Qwen3-VL writes each group's time from it, so they are read at the 2 fps
    # the offline requests' metadata gives (`vllm_requests.clip_item`).
    media = ["--media-io-kwargs", json.dumps({"video": {"fps": 2.0}})] if clips and family(model) == "qwen3_vl" \
        else []
    # `vllm serve`, as its API-server entry: vllm-cpu's `vllm` command dies at start asking for the version of a
    # distribution named "vllm" (entrypoints/cli/main.py:99; the CPU build is named "vllm-cpu").
    # Per-request mm_processor_kwargs (the budget) need --trust-request-mm-kwargs (generate/base/protocol.py:72-88).
    argv = ["--model", model, "--host", "127.0.0.1", "--port", str(port), "--trust-request-mm-kwargs", "--dtype",
            "float32", "--enforce-eager", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
            str(256 << 20), "--limit-mm-per-prompt",
            json.dumps({"image": 4 if bare else 1, **({"video": 1} if clips else {})}),
            "--hf-overrides", json.dumps(overrides), "--tensor-parallel-size", str(tp), "--data-parallel-size",
            str(dp), *operator, *lora, *media]
    return ForkedServer(argv, log)


class ForkedServer:
    """`python -m vllm.entrypoints.openai.api_server ARGV` in a forked child of this process, as a new session (its
    engine processes in its process group), its output in `log`; `poll`, `wait` and `pid` as `subprocess.Popen`'s.

    Forked rather than started as a new interpreter: where this script runs with vLLM already imported (the tests'
    fork server, tests/_vllm_forks.py), the API server skips its 6 s of imports; run alone, the child imports them.
    The same module runs as `__main__`, so vLLM spawns its engine core just as under `python -m`. This process has
    started no thread when it forks."""

    def __init__(self, argv: list[str], log: Path):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            self._serve(argv, log)

    @staticmethod
    def _serve(argv: list[str], log: Path) -> None:
        """The child: never returns."""
        import atexit
        import runpy
        import traceback

        code = 1
        try:
            os.setsid()
            _die_with_parent()
            out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            module = "vllm.entrypoints.openai.api_server"
            sys.argv = [module, *argv]
            sys.path[0] = os.getcwd()                    # as `python -m` puts the working folder first
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the server's own traceback in its log, exit status 1
            traceback.print_exc()
        finally:
            try:
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(["vllm serve"], timeout)
            time.sleep(0.1)
        return self.returncode


def _die_with_parent() -> None:
    """SIGTERM to this process when the one that forked it dies (Linux's PR_SET_PDEATHSIG), so a check script killed
    mid-run (a test's timeout) does not leave its server serving in a session of its own: vLLM's API server then stops
    its engine as on any SIGTERM (measured: gone 0.5 s after the script's SIGKILL, through the tests' fork server and
    run alone). Not covered: a SIGTERM that lands while vLLM is still starting can be lost (its `_interrupt_init`
    raises KeyboardInterrupt into the start, entrypoints/launchers/api_server/entry.py:170-174; seen once: the server
    came up and served on); SIGKILL instead left the engine core running. Elsewhere a no-op."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)    # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def family(model: str) -> str:
    """The checkpoint's model_type (config.json)."""
    return json.loads((Path(model) / "config.json").read_text())["model_type"]


def wait_ready(port: int, proc: ForkedServer, timeout: float = 300.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            time.sleep(1.0)
    raise TimeoutError("vllm serve did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/shapes-qwen2vl")
    ap.add_argument("--layer", default="checkpoints/arr-coc-shapes")
    ap.add_argument("--budget", default="0.25", help="the server's default budget")
    ap.add_argument("--image", default="assets/examples/shapes_color.png")
    ap.add_argument("--question", default="What color is the circle?")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--encode", default="after", choices=["after", "before"])
    ap.add_argument("--adapter", action="store_true", help="serve the layer folder's adapter/ (vLLM's LoRA)")
    ap.add_argument("--dp", type=int, default=1, help="--data-parallel-size")
    ap.add_argument("--operator-budget", default=None, help="the default budget as --mm-processor-kwargs gives it")
    ap.add_argument("--requests", type=Path, default=None,
                    help="send these requests instead (scripts/vllm_requests.py's format), 8 at a time")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import openai

    port, log = free_port(), args.out.with_suffix(".log")
    reqs = json.loads(args.requests.read_text()) if args.requests else None
    clips = any(r.get("clips") for r in reqs or [])
    proc = start(args.model, args.layer, None if args.requests else args.budget, port, args.tp, log, args.encode,
                 args.adapter, args.dp, args.operator_budget, bare=args.requests is not None and not args.adapter,
                 clips=clips, max_model_len=4096 if clips else 2048)
    result: dict = {"answers": {}, "errors": {}, "usage": {}}
    try:
        result["ready_s"] = wait_ready(port, proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        if args.requests:
            result["requests"] = send_all(client, args.model, reqs)
            return
        url = "data:image/png;base64," + base64.b64encode(Path(args.image).read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": args.question}]
        for name, budget in (("server", None), ("5%", "5%"), ("64", 64), ("bad", "1"), ("after bad", "10%")):
            extra = {} if budget is None else {"extra_body": {"mm_processor_kwargs": {"arr_coc_budget": budget}}}
            try:
                t0 = time.perf_counter()
                r = client.chat.completions.create(model=args.model, temperature=0.0, max_tokens=16,
                                                   messages=[{"role": "user", "content": content}], **extra)
                result["answers"][name] = r.choices[0].message.content
                result["usage"][name] = {"prompt_tokens": r.usage.prompt_tokens, "s": time.perf_counter() - t0}
            except openai.APIStatusError as e:
                result["errors"][name] = {"status": e.status_code, "message": str(e)[:400]}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def send_all(client, model: str, reqs: list[dict]) -> dict[str, dict]:
    """Each request as a client sends it (image parts as data URLs, its budget and any other kwargs in
    mm_processor_kwargs), 8 in flight at once; then whether the server still answers."""
    from concurrent.futures import ThreadPoolExecutor

    def one(req: dict) -> tuple[str, dict]:
        urls = iter("data:image/png;base64," + base64.b64encode(Path(p).read_bytes()).decode() for p in req["images"])
        videos = iter(clip_url(p) for p in req.get("clips", []))
        part = {"image": lambda: {"type": "image_url", "image_url": {"url": next(urls)}},
                "video": lambda: {"type": "video_url", "video_url": {"url": next(videos)}}}
        messages = []
        for m in req["messages"]:
            content = m["content"]
            if isinstance(content, list):
                content = [part[c["type"]]() if c["type"] in part else c for c in content]
            messages.append({"role": m["role"], "content": content})
        kwargs = dict(req.get("mm_kwargs", {}))
        if req.get("budget") is not None:
            kwargs["arr_coc_budget"] = req["budget"]
        extra = {"extra_body": {"mm_processor_kwargs": kwargs}} if kwargs else {}
        try:
            r = client.chat.completions.create(model=model, temperature=0.0, max_tokens=16, messages=messages,
                                               **extra)
            return req["name"], {"answer": r.choices[0].message.content, "prompt_tokens": r.usage.prompt_tokens,
                                 "error": None}
        except openai_error() as e:
            return req["name"], {"error": {"status": e.status_code, "message": str(e)[:400]}}

    with ThreadPoolExecutor(8) as pool:
        got = dict(pool.map(one, reqs))
    name, after = one({**next(r for r in reqs if not r.get("mm_kwargs")), "name": "after"})
    got["__after"] = after
    return got


def clip_url(path: str) -> str:
    """A clip (.npy uint8 frames) as a data URL vLLM decodes frame by frame without loss: its "video/jpeg" form
    (frames' base64 joined by commas, each opened by PIL, which reads the PNG each frame is written as;
    multimodal/media/video.py:130-145)."""
    import io

    import numpy as np
    from PIL import Image

    frames = []
    for frame in np.load(path):
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="PNG")
        frames.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(frames)


def openai_error() -> type:
    import openai

    return openai.APIStatusError


if __name__ == "__main__":
    main()
