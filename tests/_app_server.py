"""Helpers shared by test_app.py and test_browser.py: a free loopback port, the app in a
subprocess, a tiny saved model, and the catalogue of bad inputs with the message each must give."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the app exited with {proc.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s:\n{_tail(log)}")


def _tail(log: Path | None, n: int = 40) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


class AppProcess:
    """`python app.py --port N [args]` on 127.0.0.1, one torch thread, output in a log file.

    With `leak_mib`, the same app through `leaky_main` below: every request keeps that much memory alive
    (the memory check's negative control)."""

    def __init__(self, log_dir: Path, *args: str, timeout: float = 240, leak_mib: float = 0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log_dir) / f"app_{self.port}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   GRADIO_ANALYTICS_ENABLED="False", HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
        entry = [str(APP)] if not leak_mib else [__file__, "--leak-mib", str(leak_mib)]
        self._log_file = open(self.log, "w")
        self.proc = subprocess.Popen([sys.executable, *entry, "--port", str(self.port), *args], cwd=ROOT, env=env,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        try:
            wait_http(self.url + "/", timeout, self.proc, self.log)
        except Exception:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_kib(self) -> int:
        """Resident memory of the server process (VmRSS in /proc, kiB)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS line")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log_file.close()


def save_tiny_model(folder: Path, family: str = "qwen2_vl") -> Path:
    """A tiny random Qwen-VL (Qwen2-VL by default) saved like a real checkpoint (model + processor files)."""
    from arr_coc.qwen.tiny import build_tiny_qwen

    model, processor = build_tiny_qwen(family, seed=0)
    model.save_pretrained(folder)
    processor.save_pretrained(str(folder))
    return folder


# ----------------------------------------------------------------------------- bad inputs


@dataclass(frozen=True)
class BadInput:
    name: str
    image: str | None       # a file path, or None for "no image"
    question: str
    message: str            # substring the page must show
    refused: bool           # True: no answer; False: answered with a note


def scene(width: int = 224, height: int = 168, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (width, height), (200, 200, 190))
    from PIL import ImageDraw

    d = ImageDraw.Draw(img)
    for _ in range(4):
        x, y = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
        d.ellipse([x, y, x + 36, y + 36], fill=tuple(int(c) for c in rng.integers(0, 200, 3)))
    return img


def make_bad_inputs(folder: Path) -> list[BadInput]:
    """Every bad input issue 7 lists, written to `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    q = "What color is the circle?"
    good = scene()
    buf = io.BytesIO()
    good.save(buf, format="PNG")
    png = buf.getvalue()

    (folder / "unreadable.png").write_bytes(b"this is not an image at all\n" * 20)
    (folder / "truncated.png").write_bytes(png[: len(png) // 2])
    (folder / "empty.png").write_bytes(b"")
    frames = [scene(seed=i) for i in range(3)]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    deep = (np.asarray(good.convert("L"), dtype=np.uint16) * 257).astype(np.uint16)
    Image.fromarray(deep, "I;16").save(folder / "deep16.png")
    good.convert("CMYK").save(folder / "cmyk.jpg", quality=90)
    rgba = good.convert("RGBA")
    rgba.putalpha(Image.new("L", good.size, 128))
    rgba.save(folder / "rgba.png")
    Image.new("RGB", (1, 1), (255, 0, 0)).save(folder / "one_pixel.png")
    Image.new("RGB", (6000, 4000), (90, 120, 200)).save(folder / "huge.png")
    Image.new("L", (10000, 9000), 128).save(folder / "enormous.png")   # 90 MP: refused before decoding
    f = str
    return [
        BadInput("no_image", None, q, "No image", True),
        BadInput("unreadable", f(folder / "unreadable.png"), q, "Could not read the file as an image", True),
        BadInput("empty_file", f(folder / "empty.png"), q, "Could not read the file as an image", True),
        BadInput("truncated", f(folder / "truncated.png"), q, "truncated or damaged", True),
        BadInput("animated", f(folder / "animated.gif"), q, "The animated image (3 frames) is read as a clip", False),
        BadInput("16bit", f(folder / "deep16.png"), q, "16-bit image", False),
        BadInput("cmyk", f(folder / "cmyk.jpg"), q, "CMYK image", False),
        BadInput("rgba", f(folder / "rgba.png"), q, "flattened onto a white background", False),
        BadInput("one_pixel", f(folder / "one_pixel.png"), q, "1x1 px: too small", True),
        BadInput("huge", f(folder / "huge.png"), q, "downscaled to", False),
        BadInput("enormous", f(folder / "enormous.png"), q, "too large to decode", True),
        BadInput("empty_question", f(folder / "rgba.png"), "   ", "The question is empty", True),
        BadInput("long_question", f(folder / "rgba.png"), ("What color is the circle? " * 200)[:4999] + "?",
                 "5,000 characters long", True),
    ]


# ----------------------------------------------------------------------------- a leaking app (negative control)


def leaky_main(argv: list[str]) -> None:
    """`python tests/_app_server.py --leak-mib N APP_ARGS...`: the app as `python app.py APP_ARGS...` runs it,
    except that every `ask` request keeps N MiB alive, written so that the pages are resident."""
    assert argv[0] == "--leak-mib", argv
    size = int(float(argv[1]) * 2**20)
    sys.path.insert(0, str(ROOT))
    from arr_coc_microscope import handler, server

    kept: list[bytearray] = []
    ask = handler.ask

    def leaking_ask(*args, **kwargs):
        kept.append(bytearray(b"\x01") * size)
        return ask(*args, **kwargs)

    handler.ask = leaking_ask
    server.main(argv[2:])


if __name__ == "__main__":
    leaky_main(sys.argv[1:])


def predict(client, image, question, arr_coc=True, budget=0.25, adaptive=False, method="arr_coc"):
    from gradio_client import handle_file

    out = client.predict(handle_file(image) if image else None, question, arr_coc, budget, adaptive, method,
                         api_name="/ask")
    from arr_coc_microscope import handler

    return dict(zip(handler.OUTPUT_NAMES, out))


def check_full_answer(out: dict, question: str) -> dict:
    assert out["error"] == "" or out["error"].startswith("**Note:**"), out["error"]
    assert isinstance(out["answer_baseline"], str) and isinstance(out["answer_arr"], str)
    rows = {r[0]: r[1:] for r in out["stats"]["data"]}
    assert int(rows["visual tokens (kept)"][1].split()[0]) < int(rows["visual tokens (total)"][1])
    heat = Image.open(out["heatmap"])
    assert heat.format == "PNG" and min(heat.size) >= 28
    assert [m["caption"].split(" ")[0] for m in out["maps"]][-1] == "relevance"
    assert len(out["channels"]) >= 10 and all(Path(c["image"]).exists() for c in out["channels"])
    record = json.loads(Path(out["trace"]).read_text())
    assert record["question"] == question
    return record
