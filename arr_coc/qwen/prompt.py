"""Reading a Qwen-VL prompt: where each visual unit's pads are, its patch rows, the unpruned M-RoPE positions.

A Qwen-VL vision tower attends within one temporal group at a time (its `cu_seqlens` has one segment per
group, and its 2-D positions, Qwen2.5-VL's windows and Qwen3-VL's position table repeat per group), so a
video of grid (t, h, w) is encoded exactly as t pictures of grid (1, h, w) made of the same patch rows
(tests/test_video.py checks it on the three families). The prompt is therefore read as units
(`arr_coc.pipeline.prompt`): an image is one unit, a video's temporal group is one, each a (1, h, w) grid with
its own run of pads in the prompt.

Pads: Qwen2-VL and Qwen2.5-VL put one run of t * h * w / merge**2 `<|video_pad|>` per video (raster over
(t, h, w), so group g is the g-th slice of h * w / merge**2); Qwen3-VL one run per group, each after its
timestamp text. Either way each unit owns one contiguous span.

What the host already has stays on the host. The processor made the prompt, the grids and the patches
there, so the prompt's layout (pad runs, question tokens, the unpruned M-RoPE positions from the model's own
`get_rope_index`) is read from the host copies, and only results are uploaded; nothing here reads a value
back from the VLM's device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..cancel import checkpoint
from ..core.grid import upload
from ..pipeline.prompt import IMAGE, VIDEO, Prompt
from ..pipeline.tokens import VisualRows
from ..stopwatch import Stopwatch, lap

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class PromptTokens:
    """The special token ids the pruning path reads a Qwen-VL prompt by.

    user_turn: the ids that open a user turn, `<|im_start|>user\\n` as the tokenizer writes them (`user_header`);
    empty: the prompt is read as one turn (the question rule below, before conversations)."""

    image: int          # <|image_pad|>
    video: int          # <|video_pad|>
    vision_end: int     # <|vision_end|>
    im_end: int         # <|im_end|>
    pad: int            # what left-pads a row
    special: frozenset[int]
    user_turn: tuple[int, ...] = ()

    def question(self, ids: Sequence[int]) -> list[int]:
        """Question token ids of one unpadded row: what the user asks now.

        The turn read is the prompt's last user turn (from the last `user_turn` header up to its <|im_end|>; a
        prompt without one, e.g. a raw prompt, is read whole). In it, the question is the text after the last
        <|vision_end|> up to <|im_end|> (Qwen's template puts a turn's images first); where nothing is there (the
        turn has no image, or asks before it), every non-special text token of the turn, its header left out.
        So a follow-up turn of a chat is asked its own question, and a one-turn prompt reads as it always did.
        """
        ids = list(ids)
        turn = ids
        n = len(self.user_turn)
        if n:
            heads = [i for i in range(len(ids) - n + 1) if tuple(ids[i:i + n]) == self.user_turn]
            if heads:
                turn = ids[heads[-1] + n:]
                if self.im_end in turn:
                    turn = turn[: turn.index(self.im_end) + 1]
        ends = [i for i, t in enumerate(turn) if t == self.vision_end]
        seg: list[int] = []
        if ends:
            for t in turn[ends[-1] + 1:]:
                if t == self.im_end:
                    break
                seg.append(t)
        skip = self.special | {self.image, self.video, self.vision_end, self.im_end}
        seg = [t for t in seg if t not in skip]
        if not seg:
            seg = [t for t in turn if t not in skip] or ids[-1:]
        return seg


def user_header(tokenizer: Any) -> tuple[int, ...]:
    """The ids that open a user turn in Qwen's chat template (`<|im_start|>user\\n`), as `tokenizer` writes them."""
    return tuple(tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Units:
    """The batch's visual units in prompt order (row-major over the prompt), all on the host.

    kind      per unit: IMAGE or VIDEO (a video's temporal group)
    grid_thw  LongTensor [N, 3] patch grid per unit, t = 1
    spans     per unit (row, start, end): its pads in input_ids
    clip      per unit: -1 for an image, else the video's index in `video_grid_thw`
    group     per unit: its temporal group in the clip (0 for an image)
    rows      patch rows of each unit, in unit order, into cat(pixel_values, pixel_values_videos); None when
              the batch holds images only (then `pixel_values` is already in unit order)
    """

    kind: list[int]
    grid_thw: torch.Tensor
    spans: list[tuple[int, int, int]]
    clip: list[int]
    group: list[int]
    rows: np.ndarray | None

    @property
    def has_video(self) -> bool:
        return VIDEO in self.kind

    @property
    def visual_index(self) -> list[int]:
        """Per unit, its image's or video's place among its row's visuals (a video's groups share one)."""
        out, seen = [], {}
        for (row, _, _), kind, group in zip(self.spans, self.kind, self.group):
            if kind == IMAGE or group == 0:
                seen[row] = seen.get(row, -1) + 1
            out.append(seen[row])
        return out



def pad_runs(mm: np.ndarray, mask: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Runs of equal non-zero `mm_token_type_ids` per row, row-major: [(row, start, end, kind)]."""
    runs = []
    for b in range(mm.shape[0]):
        kind = np.where(mask[b] != 0, mm[b], 0)
        change = np.flatnonzero(np.diff(np.concatenate([[0], kind, [0]])) != 0)
        for s, e in zip(change[:-1], change[1:]):
            if kind[s] != 0:
                runs.append((b, int(s), int(e), int(kind[s])))
    return runs


def visual_units(mm_token_type_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None,
                 video_grid_thw: torch.Tensor | None, merge: int) -> Units:
    """The units of a batch from its host tensors (mm_token_type_ids, attention_mask [B, S]; grids [N, 3])."""
    images = [] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()]
    videos = [] if video_grid_thw is None else [tuple(int(v) for v in g) for g in video_grid_thw.tolist()]
    image_rows = np.cumsum([0] + [t * h * w for t, h, w in images])
    video_rows = image_rows[-1] + np.cumsum([0] + [t * h * w for t, h, w in videos])
    kind, grid, spans, clip, group, rows = [], [], [], [], [], []
    next_image, next_video, groups_seen = 0, 0, 0
    for b, s, e, k in pad_runs(mm_token_type_ids.numpy(), attention_mask.numpy()):
        if k == IMAGE:
            if next_image >= len(images):
                raise ValueError(f"the prompts hold more image-pad runs than the {len(images)} images passed")
            t, h, w = images[next_image]
            if e - s != t * h * w // merge ** 2:
                raise ValueError(f"image {next_image}'s pad run has {e - s} tokens, its grid {t}x{h}x{w} makes "
                                 f"{t * h * w // merge ** 2}; build inputs with this model's processor")
            kind.append(IMAGE), grid.append((t, h, w)), spans.append((b, s, e)), clip.append(-1), group.append(0)
            rows.append(np.arange(image_rows[next_image], image_rows[next_image + 1]))
            next_image += 1
            continue
        if next_video >= len(videos):
            raise ValueError(f"the prompts hold more video-pad runs than the {len(videos)} videos passed")
        t, h, w = videos[next_video]
        per_group = h * w // merge ** 2
        if (e - s) % per_group or groups_seen + (e - s) // per_group > t:
            raise ValueError(f"video {next_video}'s pads do not match its grid {t}x{h}x{w}; build inputs with this "
                             "model's processor")
        for g in range(groups_seen, groups_seen + (e - s) // per_group):
            at = s + (g - groups_seen) * per_group
            kind.append(VIDEO), grid.append((1, h, w)), spans.append((b, at, at + per_group))
            clip.append(next_video), group.append(g)
            first = video_rows[next_video] + g * h * w
            rows.append(np.arange(first, first + h * w))
        groups_seen += (e - s) // per_group
        if groups_seen == t:
            next_video, groups_seen = next_video + 1, 0
    if next_image != len(images) or next_video != len(videos) or groups_seen:
        raise ValueError(f"{len(images)} images and {len(videos)} videos were passed but the prompts hold pads for "
                         f"{next_image} and {next_video}; build inputs with this model's processor")
    return Units(kind, torch.tensor(grid, dtype=torch.long).reshape(-1, 3), spans, clip, group,
                 np.concatenate(rows).astype(np.int64) if videos else None)


def unit_pixels(inputs: dict[str, torch.Tensor], units: Units) -> torch.Tensor:
    """The units' patch rows on the VLM's device, in unit order: `pixel_values` itself for images only, else one
    gather from the images' and videos' rows."""
    if units.rows is None:
        return inputs["pixel_values"]
    parts = [inputs[k] for k in ("pixel_values", "pixel_values_videos") if inputs.get(k) is not None]
    source = parts[0] if len(parts) == 1 else torch.cat(parts)
    return source.index_select(0, upload(units.rows, source.device))


@dataclass
class QwenPrompt:
    """A Qwen backend's own state for one prompt (`Prompt.native`).

    inputs     the processor's tensors on the VLM's device; `pixel_values` / `image_grid_thw` hold every unit's
               patches and grids in unit order
    host       the same on the host (input_ids, attention_mask [B, S], ...)
    grid_thw   LongTensor [N, 3] patch grid per unit, t = 1 (host)
    pos3_host  [3, B, S] unpruned M-RoPE positions, zeros on padding (host); pos3: the same on the device
    units      which unit is an image, which a video's temporal group, where its pads are
    """

    inputs: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor]
    grid_thw: torch.Tensor
    pos3_host: torch.Tensor
    pos3: torch.Tensor
    units: Units
    encoder_output_cls: type
    tower_record: dict[str, Any] | None = None   # the tower's last block, when recorded (`QwenBackend.tower_attention`)

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        return self.units.spans


def encode_by_kind(model: PreTrainedModel, pixel_values: torch.Tensor, units: Units
                   ) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]] | None, type]:
    """The tower on every unit as the stock model calls it: one call for the batch's images, one for its videos'
    temporal groups (each group a picture: the same arithmetic, see the module docstring), so that every cell's
    features are the stock model's bit for bit (a matrix product's rounding can depend on how many rows it is
    given). pixel_values: every unit's patches in unit order. -> (per unit [n_i, D], per deepstack layer the same,
    or None; the encoder's output type)."""
    kinds = [IMAGE if k == IMAGE else VIDEO for k in units.kind]
    calls = [[i for i, k in enumerate(kinds) if k == kind] for kind in (IMAGE, VIDEO)]
    calls = [c for c in calls if c]
    sizes = units.grid_thw.prod(-1).tolist()
    pieces = pixel_values.split(sizes) if len(calls) > 1 else None
    feats: list[torch.Tensor | None] = [None] * len(kinds)
    deep: list[list[torch.Tensor | None]] | None = None
    enc = None
    for which in calls:
        px = pixel_values if pieces is None else torch.cat([pieces[i] for i in which])
        grid = units.grid_thw[which].to(pixel_values.device)
        enc = model.model.get_image_features(px, grid, return_dict=True)
        for i, f in zip(which, enc.pooler_output):
            feats[i] = f
        layers = getattr(enc, "deepstack_features", None)
        if layers is not None:
            deep = deep or [[None] * len(kinds) for _ in layers]
            for d, layer in zip(deep, layers):
                for i, f in zip(which, layer):
                    d[i] = f
    return tuple(feats), None if deep is None else [tuple(d) for d in deep], type(enc)


def read_prompt(model: PreTrainedModel, tokens: PromptTokens, inputs: Mapping[str, Any], encode_all: bool,
                encoder_output_cls: type, clock: Stopwatch | None = None, encode: Callable | None = None) -> Prompt:
    """Units, unpruned M-RoPE positions and grids of the processor's tensors; with encode_all, the vision tower
    + merger once on every patch (encode: how, `encoding.encode_every_cell`'s shape; None: the stock call)."""
    if inputs.get("pixel_values") is None and inputs.get("pixel_values_videos") is None:
        raise ValueError("no images or videos in the inputs (pixel_values / pixel_values_videos missing): nothing "
                         "to prune; build inputs with images, or call generate() which handles text-only prompts")
    host = {k: v.cpu() if isinstance(v, torch.Tensor) and not k.startswith("pixel_values") else v
            for k, v in inputs.items()}
    if host.get("attention_mask") is None:
        host["attention_mask"] = torch.ones_like(host["input_ids"])
    dev = model.device
    inputs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    inputs["attention_mask"] = host["attention_mask"].to(dev)
    ids, mask = host["input_ids"], host["attention_mask"]
    mm = host.get("mm_token_type_ids")
    if mm is None:
        mm = (ids == tokens.image).long() + 2 * (ids == tokens.video).long()
    merge = int(model.config.vision_config.spatial_merge_size)
    units = visual_units(mm, mask, host.get("image_grid_thw"), host.get("video_grid_thw"), merge)
    if units.has_video:   # the image path reads the units' patches as pictures, in unit order
        inputs["pixel_values"] = unit_pixels(inputs, units)
        inputs["image_grid_thw"] = upload(units.grid_thw, dev)
    lap(clock, "prompt")
    t0 = time.perf_counter()
    visual = feats = deep = None
    if encode_all and encode is not None:
        feats, deep = encode(inputs["pixel_values"], units.grid_thw)       # (Tensor[n_i, D], ...)
        visual = VisualRows.every_cell(feats, deep)
    elif encode_all:
        feats, deep, encoder_output_cls = encode_by_kind(model, inputs["pixel_values"], units)
        visual = VisualRows.every_cell(feats, deep)
    vision_s = time.perf_counter() - t0
    lap(clock, "vision")
    checkpoint("vision")
    rope = {k: host[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if host.get(k) is not None}
    pos3, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm, attention_mask=mask, **rope)
    thw = units.grid_thw.tolist()
    pos3_device = upload(pos3, dev)
    lap(clock, "prompt")
    native = QwenPrompt(inputs, host, units.grid_thw, pos3, pos3_device, units, encoder_output_cls)
    return Prompt(rows=int(ids.shape[0]), item_of_image=[b for b, _, _ in units.spans],
                  grid_hw=[(int(h) // merge, int(w) // merge) for _, h, w in thw], kind=list(units.kind),
                  clip=list(units.clip), group=list(units.group), visual_index=units.visual_index, native=native,
                  visual=visual, feats=feats, side=deep, vision_s=vision_s)


def question_tokens(tokens: PromptTokens, prompt: Prompt) -> list[list[int]]:
    """Each row's question token ids (host)."""
    host = prompt.native.host
    ids, mask = host["input_ids"].numpy(), host["attention_mask"].numpy() != 0
    return [tokens.question(ids[b][mask[b]].tolist()) for b in range(prompt.rows)]


__all__ = ["PromptTokens", "QwenPrompt", "user_header", "Units", "pad_runs", "question_tokens", "read_prompt", "unit_pixels",
           "visual_units"]
