"""Issue 27's experiment: do cancelled requests stop, and what do they cost the next user?

    python scripts/experiments/cancel_experiment.py                     # this checkout's app, results as JSON on stdout
    python scripts/experiments/cancel_experiment.py --app-dir DIR       # another copy of the repository (e.g. `git archive`)

The app (`python app.py`, the embedded model, one torch thread) runs in a subprocess with a private TMPDIR,
so the folders it writes per completed request can be counted. Then, through `gradio_client` as any user:

1. normal latency: a good small request, 3 times one after another (median);
2. steady state: `--steady` (6) requests with a `--side` x `--side` (8900 x 8900) PNG, sent at once from
   separate clients and NOT cancelled; the server's peak resident memory (VmHWM, reset before the phase);
3. the attack: `--requests` (20) such requests sent at once from separate clients, each cancelled
   `--cancel-after` (1.5) seconds after it was sent; the server's peak resident memory, and how many of
   them still ran to completion (request folders written);
4. the next good request right after the last cancel, timed.

Reported: peak memory of the attack / of the steady state (the issue asks <= 1.5) and the next good
request's latency / normal latency (<= 2). A guard kills the server if its resident memory passes
`--kill-gib` (default 14), so the experiment cannot take the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_big_png(path: Path, side: int) -> Path:
    """A side x side RGB PNG that compresses well (so it passes the 25 MB upload limit) but decodes in full."""
    if path.exists():
        return path
    import numpy as np
    from PIL import Image, ImageDraw

    y = np.arange(side, dtype=np.uint16)[:, None]
    x = np.arange(side, dtype=np.uint16)[None, :]
    rgb = np.empty((side, side, 3), dtype=np.uint8)
    rgb[..., 0] = ((x // 64) * 16 % 256).astype(np.uint8)
    rgb[..., 1] = ((y // 64) * 16 % 256).astype(np.uint8)
    rgb[..., 2] = 128
    im = Image.fromarray(rgb, "RGB")
    del rgb
    d = ImageDraw.Draw(im)
    for k in range(12):
        c = side * (k + 1) // 14
        d.ellipse([c - side // 30, c - side // 30, c + side // 30, c + side // 30], fill=(220, 30, 30))
    im.save(path, format="PNG", optimize=False, compress_level=6)
    return path


def make_small_png(path: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from _app_server import scene

    scene(224, 168).save(path)
    return path


class Server:
    def __init__(self, app_dir: Path, work: Path, kill_bytes: int):
        sys.path.insert(0, str(ROOT / "tests"))
        from _app_server import free_port, wait_http

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.tmp = work / "server_tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TMPDIR=str(self.tmp),
                   GRADIO_TEMP_DIR=str(self.tmp / "gradio"), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
        self.log = open(work / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, "app.py", "--port", str(self.port)], cwd=app_dir, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_http(self.url + "/", 300, self.proc, work / "server.log")
        self.kill_bytes = kill_bytes
        self.killed = False
        self.max_rss = 0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._guard, daemon=True)
        self._watch.start()

    def status(self) -> dict[str, int]:
        with open(f"/proc/{self.proc.pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    def reset_peak(self) -> None:
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        self.max_rss = 0

    def _guard(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                rss = self.status()["VmRSS"]
            except (OSError, KeyError):
                return
            self.max_rss = max(self.max_rss, rss)
            if rss > self.kill_bytes:
                self.killed = True
                self.proc.kill()
                return
            time.sleep(0.05)

    def completed(self) -> int:
        """Request folders the app wrote (one per request that ran to completion)."""
        root = self.tmp / "arr_coc_app"
        return len(list(root.iterdir())) if root.exists() else 0

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def client(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, analytics_enabled=False, download_files=False)


def ask(c, image: Path, question: str = "What color is the circle?"):
    from gradio_client import handle_file

    return c.predict(handle_file(str(image)), question, True, 0.25, False, "arr_coc", api_name="/ask")


def submit(c, image: Path, question: str = "What color is the circle?"):
    from gradio_client import handle_file

    return c.submit(handle_file(str(image)), question, True, 0.25, False, "arr_coc", api_name="/ask")


def timed_good(url: str, small: Path) -> tuple[float, str]:
    c = client(url)
    try:
        t0 = time.perf_counter()
        out = ask(c, small)
        return time.perf_counter() - t0, out[-1]
    finally:
        c.close()


def wait_idle(server: Server, settle_s: float, limit_s: float) -> int:
    """Wait until the count of completed requests stops changing for settle_s (at most limit_s)."""
    last, since, t0 = server.completed(), time.monotonic(), time.monotonic()
    while time.monotonic() - t0 < limit_s:
        time.sleep(0.5)
        now = server.completed()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
    return last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--app-dir", type=Path, default=ROOT)
    p.add_argument("--side", type=int, default=8900)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--steady", type=int, default=6)
    p.add_argument("--cancel-after", type=float, default=1.5)
    p.add_argument("--kill-gib", type=float, default=14.0)
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="arr_coc_cancel_"))
    work.mkdir(parents=True, exist_ok=True)
    big = make_big_png(Path(tempfile.gettempdir()) / f"arr_coc_big_{args.side}.png", args.side)
    small = make_small_png(work / "small.png")
    server = Server(args.app_dir.resolve(), work, int(args.kill_gib * 2**30))
    result: dict = {"app_dir": str(args.app_dir), "image": f"{args.side}x{args.side}",
                    "image_mb": round(big.stat().st_size / 1e6, 1), "requests": args.requests,
                    "cancel_after_s": args.cancel_after}
    try:
        timed_good(server.url, small)  # warm-up
        normal = [timed_good(server.url, small)[0] for _ in range(3)]
        result["normal_latency_s"] = round(statistics.median(normal), 3)

        # steady state: the same big requests, not cancelled
        clients = [client(server.url) for _ in range(args.steady)]
        server.reset_peak()
        done0 = server.completed()
        jobs = [submit(c, big) for c in clients]
        outs = [j.result(timeout=900) for j in jobs]
        result["steady"] = {"peak_rss_gib": round(server.status()["VmHWM"] / 2**30, 2),
                            "completed": server.completed() - done0,
                            "errors": sorted({o[-1][:120] for o in outs if o[-1]})}
        for c in clients:
            c.close()
        result["rss_after_steady_gib"] = round(server.status()["VmRSS"] / 2**30, 2)

        # the attack: every request cancelled after cancel_after seconds
        clients = [client(server.url) for _ in range(args.requests)]
        server.reset_peak()
        done0 = server.completed()
        cancelled: list = [None] * args.requests

        def one(k: int) -> None:
            job = submit(clients[k], big)
            time.sleep(args.cancel_after)
            cancelled[k] = job.cancel()

        t0 = time.perf_counter()
        threads = [threading.Thread(target=one, args=(k,)) for k in range(args.requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        result["cancel_calls_s"] = round(time.perf_counter() - t0, 2)
        next_s, next_error = timed_good(server.url, small)   # a good request writes one folder
        peak_attack = server.status()["VmHWM"]
        # every request folder written since the attack began, less the next good request's own
        finished = wait_idle(server, settle_s=10, limit_s=600) - done0 - (0 if next_error.startswith("**Error") else 1)
        peak_attack = max(peak_attack, server.status()["VmHWM"])
        for c in clients:
            c.close()
        result["attack"] = {"cancel_returned_true": sum(bool(c) for c in cancelled),
                            "ran_to_completion": finished,
                            "peak_rss_gib": round(peak_attack / 2**30, 2),
                            "next_good_latency_s": round(next_s, 3), "next_good_error": next_error}
        # ran_to_completion: cancelled requests that still ran to the end (the next good request not counted)
        result["rss_after_attack_gib"] = round(server.status()["VmRSS"] / 2**30, 2)
        result["memory_ratio"] = round(peak_attack / 2**30 / result["steady"]["peak_rss_gib"], 2)
        result["latency_ratio"] = round(next_s / result["normal_latency_s"], 2)
        result["passes"] = result["memory_ratio"] <= 1.5 and result["latency_ratio"] <= 2.0
    finally:
        result["killed_by_guard"] = server.killed
        server.stop()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
