"""Shared fixtures: tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL models, offline.

The models are built from configs by `arr_coc.qwen.tiny.build_tiny_qwen` (nothing is
downloaded), once per (family, attention) per session, frozen; tests must treat
them as read-only.
"""

from __future__ import annotations

import functools
import os

for _key, _value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("GRADIO_ANALYTICS_ENABLED", "False"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_key, _value)

# Subprocesses import this tree's library: `python scripts/x.py` puts scripts/ first on sys.path, so the vLLM
# environment's scripts would otherwise import whichever tree its editable install points at (another worktree, or
# the folder a copied environment came from). tests/test_install.py clears PYTHONPATH for its fresh interpreter.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core host two threads
    contend with other jobs (measured: 125 s with 2 threads vs 8 s with 1 beside a training run)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield before                         # torch's own thread count (`engine_threads` restores it)
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine_threads(_one_thread):
    """The vLLM tests' Hugging Face references run on the machine's threads, as vLLM's CPU worker beside them does:
    there nothing else runs at the same time (each engine runs, then the references), and on 2 cores a reference
    run took 0.65-0.75x the time of one thread's (docs/SERVING.md)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(_one_thread)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def _tiny(family: str, attn: str):
    from arr_coc.qwen.tiny import build_tiny_qwen

    return build_tiny_qwen(family, seed=0, attn_implementation=attn)


@pytest.fixture(scope="session")
def tiny_vlm():
    """`tiny_vlm(family, attn="sdpa") -> (model, processor)`; cached for the session, read-only."""
    return lambda family, attn="sdpa": _tiny(family, attn)


def shapes_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A flat background with a few coloured shapes (structure for the texture/scorers)."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (width, height), tuple(int(c) for c in rng.integers(180, 255, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = int(rng.integers(0, width - 24)), int(rng.integers(0, height - 24))
        size = int(rng.integers(14, 30))
        colour = tuple(int(c) for c in rng.integers(0, 160, 3))
        box = [x0, y0, min(width - 1, x0 + size), min(height - 1, y0 + size)]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    return img


@pytest.fixture(scope="session")
def make_image():
    """`make_image(height, width, seed=0) -> PIL.Image` with a few shapes on a flat background."""
    return shapes_image


def text_prefill_flops(vlm, length: int) -> int:
    """FLOPs of the language model's prefill of a text prompt of `length` tokens (last position's logits): the
    independent reference for the LM cost the evaluation counts on the real pruned prompt. vlm: the front door
    (`ARRCOC`) over a Qwen backend, or that backend."""
    import torch

    from arr_coc.evaluation.flops import count_flops

    backend = getattr(vlm, "backend", vlm)
    ids = torch.full((1, int(length)), int(backend.pad_token_id), dtype=torch.long, device=backend.device)
    with torch.no_grad():
        return count_flops(backend.model, input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)[1]
