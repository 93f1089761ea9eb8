"""The pure input rewrite: prompts with every visual token -> prompts with the kept ones.

No model runs here (the pipeline runs the vision tower, the selector and the language model through the
backend); the kept cells arrive validated (`arr_coc.pipeline.choose.validate_kept`).

1. `image_spans` finds each image's run of `<|image_pad|>` tokens;
2. `rewrite` drops the unkept pads, keeps every other token at its original position, and
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
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..core.grid import upload
from ..pipeline.tokens import VisualRows

INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids",
              "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


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
    adapted: list[bool] | None = None           # per row: the adapter runs for it (tokens were pruned); None: never

    @property
    def full_features(self) -> tuple[torch.Tensor, ...]:
        return self.visual.full()

    @property
    def full_deepstack(self) -> list[tuple[torch.Tensor, ...]] | None:
        return None if self.visual.side is None else [self.visual.full(d) for d in self.visual.side]

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
            unit_kind=None if self.unit_kind is None else [self.unit_kind[i] for i in imgs],
            adapted=None if self.adapted is None else [self.adapted[b] for b in rows])

    @property
    def width(self) -> int:
        """The rows' length, padding included."""
        return int(self.input_ids.shape[1])

    @property
    def kept_counts(self) -> list[int]:
        return [int(k.numel()) for k in self.kept_indices]


def model_tensors(kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
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


def rewrite(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, pos3: torch.Tensor, spans: list[tuple[int, int, int]],
    visual: VisualRows, kept: list[torch.Tensor], encoder_output_cls: type, item_of_image: list[int],
    grid_hw: list[tuple[int, int]], pad_token_id: int, device: torch.device | str,
    unit_kind: list[int] | None = None, round_length: Callable[[int], int] | None = None,
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
    S2 = S2 if round_length is None else max(S2, int(round_length(S2)))   # fixed shapes: more left padding
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
