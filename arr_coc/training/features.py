"""The frozen VLM's fixed per-item inputs of the layer (visual tokens, question embeddings, the
resized image, the answer's target cells, the backend's own record of the unpruned prompt), extracted once
through the front door's own path (`ARRCOC.prepare`) and kept in a content-addressed cache between runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

import torch

from ..data import VQARecord
from ..geometry import boxes_to_cell_shares, scale_boxes

if TYPE_CHECKING:
    from ..front import ARRCOC
    from ..distributed import Processes

logger = logging.getLogger(__name__)


@dataclass
class Features:
    """Fixed per-item inputs of the layer, from the frozen VLM (cached)."""

    image: torch.Tensor          # [3, H, W] uint8: the resized image the VLM saw (a quarter of float32's memory:
                                 # 6,000 large-canvas items as float32 overflowed 24 GiB during stage 2)
    grid_hw: tuple[int, int]
    visual_tokens: torch.Tensor | None  # [h * w, D]; None: the layer reads texture + question only
    query: torch.Tensor          # [L, D]
    target: torch.Tensor         # [h * w] float: share of the answer's boxes in each cell (each box sums to 1)
    answer: str
    question: str
    image_path: str
    prompt: dict[str, torch.Tensor]   # the backend's tensors of the unpruned prompt (`TrainsThrough.answer_prompts`:
                                      # what stage 2's `soft_answer_loss` appends the answer to)
    lm_tokens: torch.Tensor | None = None   # [h * w, D] what the LM reads in stage 2 when the layer reads
                                            # something else (encode="before": the gist); None: visual_tokens


@torch.no_grad()
def extract_features(vlm: ARRCOC, records: Sequence[VQARecord], progress: bool = True,
                     gist: float = 0.0) -> list[Features]:
    """Vision tower + question embeddings per record through the front door's own path (a backend that
    `TrainsThrough`).

    gist > 0: the layer's visual tokens are what it reads with encode="before" (the gist's token under
    each cell, from a gist of that share of the tokens); the full encoding is kept as `lm_tokens`.
    """
    from ..encode import EncodeConfig
    from ..pipeline.backend import TrainsThrough, require
    from ..pipeline.selection import choose_before_encoding
    from PIL import Image
    from tqdm import tqdm

    feats: list[Features] = []
    captured: list = []

    @choose_before_encoding
    def capture(ctx):
        captured.append(ctx)
        return [torch.arange(h * w) for h, w in ctx.grid_hw]

    before = EncodeConfig("before", gist=gist) if gist > 0 else None
    backend = require(vlm.backend, TrainsThrough, "train through the frozen VLM (train)")

    for rec in tqdm(records, desc="features", disable=not progress, dynamic_ncols=True):
        image = Image.open(rec.image).convert("RGB")
        captured.clear()
        inputs = backend.build_inputs([[image]], [rec.question])
        vlm.prepare(inputs, method=capture)
        if before is not None:
            vlm.prepare(inputs, method=capture, encode=before)
        ctx = captured[-1]
        h, w = ctx.grid_hw[0]
        target = answer_target(rec.boxes, image.size, tuple(ctx.images[0].shape[-2:]), (h, w))
        pixels = (ctx.images[0].float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
        # Kept on the CPU whatever device the VLM is on (a no-op there): the cache is device-free and
        # a GPU holds only a step's batch, not every item.
        feats.append(Features(pixels, (h, w), ctx.visual_tokens[0].float().cpu(), ctx.query_embeds[0].float().cpu(),
                              target, rec.answers[0], rec.question, str(rec.image),
                              backend.answer_prompts(inputs)[0],
                              captured[0].visual_tokens[0].float().cpu() if before is not None else None))
    return feats


def answer_target(boxes, original_wh: tuple[int, int], image_hw: tuple[int, int], grid_hw: tuple[int, int]):
    """[h * w] float: the answer's boxes (original pixels) as cell shares on the grid of the resized image."""
    (hs, ws), (_, w) = image_hw, grid_hw
    scaled = scale_boxes(boxes or [], original_wh, (ws, hs))  # the processor may have resized the image
    return torch.from_numpy(boxes_to_cell_shares(scaled, (ws, hs), ws // w)).reshape(-1).float()


FORMAT = b"features v2: the prompt as the backend's answer_prompts"   # a cache of another layout is not read


def features_key(vlm: ARRCOC, path: str, records: Sequence[VQARecord]) -> str:
    """Content hash of everything a record's features depend on: the VLM (weights, processor: the backend's
    `TrainsThrough.fingerprint`, seconds for a 2B model, minutes less than re-extracting), the JSONL, the images,
    the cache's layout."""
    h = hashlib.sha256(FORMAT)
    h.update(vlm.backend.fingerprint().encode())
    with open(path, "rb") as f:
        h.update(f.read())
    for rec in records:
        with open(rec.image, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:20]


def load_features(vlm: ARRCOC, path: str, records: Sequence[VQARecord], cache: str | None,
                  progress: bool = True, gist: float = 0.0, processes: Processes | None = None) -> list[Features]:
    """`extract_features`, or its copy in the `cache` folder if the same VLM already read the same data.

    Several `processes`: each extracts its contiguous share of the records into its own part file,
    rank 0 joins the parts into the one cache file a single process would have written and removes
    them, and every process maps the whole (one copy in a machine's RAM, not one per process); the
    folder must be one that every process sees.
    """
    world = processes.world if processes is not None else 1
    if not cache:
        if world > 1:
            raise ValueError("several processes share their features through files: pass a feature cache folder "
                             "that every process can read (train --feature-cache DIR)")
        return extract_features(vlm, records, progress=progress, gist=gist)
    stem = os.path.splitext(os.path.basename(path))[0]
    mode = f"-gist{gist:g}" if gist > 0 else ""
    file = os.path.join(cache, f"{stem}-{len(records)}{mode}-{features_key(vlm, path, records)}.pt")
    if processes is not None and world > 1:
        return _load_sharded(vlm, records, file, progress, gist, processes)
    if os.path.isfile(file):
        logger.info("features of %s from %s", path, file)
        return _read(file, records)
    feats = extract_features(vlm, records, progress=progress, gist=gist)
    _write(feats, file)
    return feats


def _load_sharded(vlm: ARRCOC, records: Sequence[VQARecord], file: str, progress: bool, gist: float,
                  processes: Processes) -> list[Features]:
    """Several processes: a shared cache hit, or extraction shared out and joined by rank 0 (see `load_features`)."""
    if not processes.agree(os.path.isfile(file)):  # one decision (rank 0's), or some processes would wait forever
        part = processes.share(len(records))
        mine = extract_features(vlm, records[part], progress=progress and processes.is_main, gist=gist)
        _write(mine, _part_file(file, processes.rank, processes.world))  # this process's own file
        processes.barrier()  # every part is written
        if processes.is_main:
            feats: list[Features] = []
            for rank in range(processes.world):
                part_file = _part_file(file, rank, processes.world)
                feats += [Features(**d) for d in torch.load(part_file, weights_only=True)]
                os.remove(part_file)
            _write(feats, file)
        processes.barrier()  # the joined file is complete
    else:
        logger.info("features from %s", file)
    return _read(file, records, mmap=True)  # memory-mapped: the processes of a machine share one copy in RAM


def _part_file(file: str, rank: int, world: int) -> str:
    return f"{file}.part{rank}of{world}"


def _write(feats: list[Features], file: str) -> None:
    os.makedirs(os.path.dirname(file) or ".", exist_ok=True)
    torch.save([_row(f) for f in feats], file + ".tmp")
    os.replace(file + ".tmp", file)


def _row(f: Features) -> dict:
    """One item as saved. The prompt's keys interned: pickle writes a key once per file and refers back to it
    where it is the same object, so the keys of parts read back from other processes (fresh strings) would
    otherwise change the joined file's bytes against one process's."""
    row = {k.name: getattr(f, k.name) for k in fields(Features)}
    row["prompt"] = {sys.intern(k): v for k, v in f.prompt.items()}
    return row


def _read(file: str, records: Sequence[VQARecord], mmap: bool = False) -> list[Features]:
    from PIL import Image

    feats = [Features(**d) for d in torch.load(file, weights_only=True, mmap=mmap)]
    # The VLM's features are the cache's business, the targets the code's: they are cheap to
    # recompute, and a cache written before their definition changed must not train the old one.
    for rec, f in zip(records, feats):
        with Image.open(rec.image) as image:  # reads the header only
            f.target = answer_target(rec.boxes, image.size, tuple(f.image.shape[-2:]), f.grid_hw)
    return feats
