"""The pure input rewrite: prompts with every visual token -> prompts with the kept ones.

No model runs here (the wrapper runs the vision tower, the selector and the language model):

1. `image_spans` finds each image's run of `<|image_pad|>` tokens;
2. `expand_budgets` gives each image its budget (one for all, or per question / per image);
3. `validate_kept` makes every selection sorted, unique, in range and non-empty (or keeps all
   and says why);
4. `rewrite` drops the unkept pads, keeps every other token at its original position, and
   left-pads the rows again: `position_ids` [4, B, S'] = [text row, t, h, w]. Which token goes where is
   worked out on the host (the prompt, its positions and the kept indices are there), uploaded once, and
   the visual tokens the language model reads are gathered in one op from the tokens the tower made
   (`VisualRows`), whatever the batch's size. The text row is a
   contiguous counter (cumsum(mask) - 1): transformers reads row 0 only to build the causal mask
   (a gap there would be read as a packed-sequence boundary); rows 1..3 carry the rotary
   positions, so each kept visual token keeps its original M-RoPE (t, h, w). `generate()`
   extends all four rows by +1 per new token, which is right because the last prompt token is
   text.

The pruned features go in as `mm_encoder_outputs={"image": <encoder output with
pooler_output=(V_i[kept_i], ...) [, deepstack_features=[(F_li[kept_i], ...)]]>}`, which
`forward()` scatters into the K_i pads per image and `generate()` forwards at prefill (and
expands per beam). `generate()` mutates that dict, so every call gets fresh kwargs
(`PrunedInputs.model_kwargs()`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..budget import Budget, BudgetSpec, parse_budget
from ..grid import upload

INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids",
              "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass
class VisualRows:
    """The visual tokens the tower made for a batch, concatenated, and which cell each one is.

    source  [R, D] rows: the merger's output of every image (after), or of the encoded cells (+ the gist's
            periphery tokens) (before)
    deep    Qwen3-VL: one [R, D] per deepstack layer, the same rows; else None
    cells   per image, int64[E_i] ascending: the cells that have a token in `source`
    rows    per image, int64[E_i]: those tokens' rows in `source`
    """

    source: torch.Tensor
    deep: list[torch.Tensor] | None
    cells: list[np.ndarray]
    rows: list[np.ndarray]
    n_tokens: list[int]

    @classmethod
    def every_cell(cls, feats: Sequence[torch.Tensor], deep: Sequence[Sequence[torch.Tensor]] | None) -> VisualRows:
        """The after-mode encoding: per image [n_i, D] (every cell), per layer per image for deepstack."""
        n = [int(f.shape[0]) for f in feats]
        start = np.cumsum([0] + n[:-1])
        return cls(torch.cat(list(feats)), None if deep is None else [torch.cat(list(layer)) for layer in deep],
                   [np.arange(k) for k in n], [np.arange(k) + s for k, s in zip(n, start)], n)

    def rows_of(self, kept: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per image, the source row of each kept cell (each must have a token)."""
        out = []
        for cells, rows, k in zip(self.cells, self.rows, kept):
            at = np.searchsorted(cells, k)
            if len(k) and (at.max() >= len(cells) or not np.array_equal(cells[at], k)):
                raise ValueError("a kept cell has no encoded token; the tower encodes every kept cell")
            out.append(rows[at])
        return out

    def gather(self, kept: Sequence[np.ndarray]) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]] | None]:
        """(per image [K_i, D], Qwen3-VL deepstack per layer per image) of the kept cells: one index op per tensor."""
        counts = [len(k) for k in kept]
        index = upload(np.concatenate(self.rows_of(kept)).astype(np.int64), self.source.device)
        feats = tuple(self.source.index_select(0, index).split(counts))
        deep = None if self.deep is None else [tuple(d.index_select(0, index).split(counts)) for d in self.deep]
        return feats, deep

    def full(self, source: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Per image [n_i, D]: every cell with a token in place, zeros elsewhere (made on demand)."""
        source = self.source if source is None else source
        out = []
        for cells, rows, n in zip(self.cells, self.rows, self.n_tokens):
            full = source.new_zeros(n, source.shape[-1])
            full[torch.as_tensor(cells, device=source.device)] = source[torch.as_tensor(rows, device=source.device)]
            out.append(full)
        return tuple(out)


@dataclass
class PrunedInputs:
    """Model inputs after pruning, plus what is needed to explain or redo them.

    input_ids / attention_mask  [B, S'] left-padded
    position_ids                [4, B, S'] rows (text, t, h, w)
    orig_index                  [B, S'] position of each token in the unpruned row, -1 on padding
    image_features              tuple of Tensor[K_i, D]
    deepstack_features          Qwen3-VL: list over deepstack layers of tuple of Tensor[K_i, D]; else None
    kept_indices                list of LongTensor[K_i] (host)
    visual                      the tower's tokens the features were gathered from (`VisualRows`)
    full_features / full_deepstack  per image, the full grid's tokens (n_i rows; before mode: zeros where
                                nothing was encoded), made when asked for
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    orig_index: torch.Tensor
    image_features: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]] | None
    kept_indices: list[torch.Tensor]
    visual: VisualRows
    encoder_output_cls: type
    item_of_image: list[int]
    grid_hw: list[tuple[int, int]]
    lengths: list[int]                          # tokens in each row, padding excluded (host)
    unit_kind: list[int] | None = None          # per unit: 1 an image, 2 a video's temporal group (None: images)

    @property
    def full_features(self) -> tuple[torch.Tensor, ...]:
        return self.visual.full()

    @property
    def full_deepstack(self) -> list[tuple[torch.Tensor, ...]] | None:
        return None if self.visual.deep is None else [self.visual.full(d) for d in self.visual.deep]

    def model_kwargs(self) -> dict[str, Any]:
        """Fresh kwargs for `model(**kw)` / `model.generate(**kw)` (generate mutates them)."""
        kinds = self.unit_kind or [1] * len(self.image_features)
        outputs = {}
        for name, kind in (("image", 1), ("video", 2)):   # the forward scatters each into its own pads, in order
            which = [i for i, k in enumerate(kinds) if k == kind]
            if not which:
                continue
            enc: dict[str, Any] = {"pooler_output": tuple(self.image_features[i] for i in which)}
            if self.deepstack_features is not None:
                enc["deepstack_features"] = [tuple(layer[i] for i in which) for layer in self.deepstack_features]
            outputs[name] = self.encoder_output_cls(**enc)
        return {
            "input_ids": self.input_ids.clone(),
            "attention_mask": self.attention_mask.clone(),
            "position_ids": self.position_ids.clone(),
            "mm_encoder_outputs": outputs,
        }

    def with_features(
        self, image_features: Sequence[torch.Tensor] | None = None,
        deepstack_features: Sequence[Sequence[torch.Tensor]] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> "PrunedInputs":
        """A copy with some parts swapped (tests' negative controls, ablations)."""
        return dataclasses.replace(
            self,
            image_features=tuple(image_features) if image_features is not None else self.image_features,
            deepstack_features=[tuple(x) for x in deepstack_features] if deepstack_features is not None
            else self.deepstack_features,
            position_ids=position_ids if position_ids is not None else self.position_ids,
        )

    def rows(self, rows: Sequence[int]) -> PrunedInputs:
        """Batch rows `rows` on their own (their images renumbered), left padding trimmed to the longest of them."""
        rows = list(rows)
        at = torch.as_tensor(rows, dtype=torch.long)
        lengths = [self.lengths[b] for b in rows]
        cols = slice(self.input_ids.shape[1] - max(lengths), None)
        imgs = [i for i, r in enumerate(self.item_of_image) if r in rows]
        new_row = {b: j for j, b in enumerate(rows)}
        deep = self.deepstack_features
        on = lambda t: t[at.to(t.device)][:, cols] if t.dim() == 2 else t[:, at.to(t.device)][:, :, cols]  # noqa: E731
        return dataclasses.replace(
            self, input_ids=on(self.input_ids), attention_mask=on(self.attention_mask),
            position_ids=on(self.position_ids), orig_index=on(self.orig_index),
            image_features=tuple(self.image_features[i] for i in imgs),
            deepstack_features=None if deep is None else [tuple(layer[i] for i in imgs) for layer in deep],
            kept_indices=[self.kept_indices[i] for i in imgs], item_of_image=[new_row[self.item_of_image[i]] for i in imgs],
            grid_hw=[self.grid_hw[i] for i in imgs], lengths=lengths,
            unit_kind=None if self.unit_kind is None else [self.unit_kind[i] for i in imgs])

    @property
    def kept_counts(self) -> list[int]:
        return [int(k.numel()) for k in self.kept_indices]


def model_tensors(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The processor tensors among `kwargs` (what `prepare` reads)."""
    return {k: kwargs[k] for k in INPUT_KEYS if kwargs.get(k) is not None}


def image_spans(is_image: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of image pads per row, row-major: [(row, start, end)]. Host tensors [B, S] (read with numpy)."""
    valid = (is_image.cpu().numpy() != 0) & (attention_mask.cpu().numpy() != 0)
    spans = []
    for b in range(valid.shape[0]):
        d = np.diff(np.concatenate([[0], valid[b].astype(np.int8), [0]]))
        spans.extend((b, int(s), int(e)) for s, e in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))
    return spans


def expand_budgets(budget: BudgetSpec, item_of_image: list[int], batch: int,
                   visual_of_image: list[int] | None = None) -> list[Budget | None]:
    """One budget per image: a scalar for all, or one entry per row (scalar or per-visual list).

    Each budget goes through the one parser (`parse_budget`: numbers or strings like "10%"); None
    entries stay None (the selector's default). The pruning path's "images" are visual units (a video reaches
    it as its temporal groups): visual_of_image gives each unit its visual's place in its row, so a per-row
    list has one entry per image or video, and a video's entry is its clip's budget.
    """
    parse = lambda x: None if x is None else parse_budget(x)  # noqa: E731
    if budget is None or isinstance(budget, (int, float, str)):
        return [parse(budget)] * len(item_of_image)
    budget = list(budget)
    if len(budget) != batch:
        raise ValueError(f"got {len(budget)} budgets for a batch of {batch}; pass one per question (or one for all)")
    if visual_of_image is None:
        visual_of_image, seen = [], {}
        for b in item_of_image:
            visual_of_image.append(seen.get(b, 0))
            seen[b] = visual_of_image[-1] + 1
    out: list[Budget | None] = []
    for b, j in zip(item_of_image, visual_of_image):
        entry = budget[b]
        if isinstance(entry, (list, tuple)):
            n_visual = 1 + max(v for r, v in zip(item_of_image, visual_of_image) if r == b)
            if len(entry) != n_visual:
                raise ValueError(f"question {b} has {n_visual} images or videos but {len(entry)} budgets")
            out.append(parse(entry[j]))
        else:
            out.append(parse(entry))
    return out


def validate_kept(
    kept: Sequence[torch.Tensor | None], n_tokens: Sequence[int], fallback: Sequence[str | None],
    errors: Sequence[str | None],
) -> tuple[list[torch.Tensor], list[str | None], list[str | None]]:
    """Sorted unique in-range non-empty indices per image; anything else keeps all tokens (and says why).
    Host work (numpy); a selector that answered on the device is read back here."""
    out = []
    fallback, errors = list(fallback), list(errors)
    for i, (k, n) in enumerate(zip(kept, n_tokens)):
        problem = None
        if k is None:
            problem = "no indices returned"
        else:
            k = torch.as_tensor(k).detach().cpu().numpy().astype(np.int64).ravel()
            if k.size == 0:
                problem = "empty selection (every image keeps at least one token)"
            elif k.min() < 0 or k.max() >= n:
                problem = f"indices outside [0, {n})"
            else:
                k = torch.from_numpy(np.unique(k))  # sorted ascending
        if problem is not None:
            out.append(torch.from_numpy(np.arange(n)))
            fallback[i] = "keep_all"
            errors[i] = errors[i] or f"invalid selection: {problem}"
        else:
            out.append(k)
    return out, fallback, errors


def replacement(tokens: torch.Tensor, feats: torch.Tensor, i: int) -> torch.Tensor:
    """A selector's replacement tokens for image i, checked against the merger output [n_i, D]."""
    if tuple(tokens.shape) != tuple(feats.shape):
        raise ValueError(f"the selector returned visual_tokens of shape {tuple(tokens.shape)} for image {i}; "
                         f"expected {tuple(feats.shape)} (the merger output's raster layout [n_i, D])")
    return tokens.to(feats.device, feats.dtype)


def rewrite(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pos3: torch.Tensor, spans: list[tuple[int, int, int]],
    visual: VisualRows, kept: list[torch.Tensor], encoder_output_cls: type, item_of_image: list[int],
    grid_hw: list[tuple[int, int]], pad_token_id: int, device: torch.device | str,
    unit_kind: list[int] | None = None,
) -> PrunedInputs:
    """Drop the unkept image pads, keep every other token with its original positions, left-pad.

    input_ids / attention_mask [B, S] and pos3 [3, B, S] (the unpruned M-RoPE positions) on the host;
    visual: the tower's tokens (`VisualRows`); kept LongTensor[K_i] per image, validated, on the host.
    spans and kept are per visual unit (an image or a video's temporal group, `units.py`); unit_kind says which.
    The new prompt is laid out on the host and uploaded once; the features are one gather on the device.
    """
    ids, mask, pos = input_ids.cpu().numpy(), attention_mask.cpu().numpy(), pos3.cpu().numpy()
    B, S = ids.shape
    keep = mask != 0                                                     # [B, S]
    kept_np = [k.cpu().numpy().astype(np.int64) for k in kept]
    for (b, s, e), k in zip(spans, kept_np):
        keep[b, s:e] = False
        keep[b, s + k] = True
    S2 = int(keep.sum(-1).max())
    out = np.zeros((7, B, S2), dtype=np.int64)                           # ids, mask, orig, text, t, h, w
    out[0] = pad_token_id
    out[2] = -1
    for b in range(B):
        idx = np.flatnonzero(keep[b])                                    # ascending: order is preserved
        at = slice(S2 - len(idx), S2)
        out[0, b, at], out[1, b, at], out[2, b, at] = ids[b, idx], 1, idx
        out[3, b, at] = np.arange(len(idx))                              # text row: contiguous, 0 on pads
        out[4:, b, at] = pos[:, b, idx]
    packed = upload(out, device)
    image_features, deep = visual.gather(kept_np)
    return PrunedInputs(
        input_ids=packed[0].to(input_ids.dtype), attention_mask=packed[1].to(attention_mask.dtype),
        position_ids=packed[3:].to(pos3.dtype), orig_index=packed[2], image_features=image_features,
        deepstack_features=deep, kept_indices=[k.cpu() for k in kept], visual=visual,
        encoder_output_cls=encoder_output_cls, item_of_image=item_of_image, grid_hw=grid_hw,
        lengths=[int(n) for n in keep.sum(-1)], unit_kind=unit_kind,
    )
