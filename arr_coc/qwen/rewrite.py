"""The pure input rewrite: prompts with every visual token -> prompts with the kept ones.

No model runs here (the wrapper runs the vision tower, the selector and the language model):

1. `image_spans` finds each image's run of `<|image_pad|>` tokens;
2. `expand_budgets` gives each image its budget (one for all, or per question / per image);
3. `validate_kept` makes every selection sorted, unique, in range and non-empty (or keeps all
   and says why);
4. `rewrite` drops the unkept pads, keeps every other token at its original position, and
   left-pads the rows again: `position_ids` [4, B, S'] = [text row, t, h, w]. The text row is a
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

import torch

from ..budget import Budget, BudgetSpec, parse_budget

INPUT_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids")


@dataclass
class PrunedInputs:
    """Model inputs after pruning, plus what is needed to explain or redo them.

    input_ids / attention_mask  [B, S'] left-padded
    position_ids                [4, B, S'] rows (text, t, h, w)
    orig_index                  [B, S'] position of each token in the unpruned row, -1 on padding
    image_features              tuple of Tensor[K_i, D]
    deepstack_features          Qwen3-VL: list over deepstack layers of tuple of Tensor[K_i, D]; else None
    kept_indices                list of LongTensor[K_i]
    full_features / full_deepstack  the unpruned encoder outputs (same layout, n_i rows)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    orig_index: torch.Tensor
    image_features: tuple[torch.Tensor, ...]
    deepstack_features: list[tuple[torch.Tensor, ...]] | None
    kept_indices: list[torch.Tensor]
    full_features: tuple[torch.Tensor, ...]
    full_deepstack: list[tuple[torch.Tensor, ...]] | None
    encoder_output_cls: type
    item_of_image: list[int]
    grid_hw: list[tuple[int, int]]

    def model_kwargs(self) -> dict[str, Any]:
        """Fresh kwargs for `model(**kw)` / `model.generate(**kw)` (generate mutates them)."""
        enc: dict[str, Any] = {"pooler_output": tuple(self.image_features)}
        if self.deepstack_features is not None:
            enc["deepstack_features"] = [tuple(layer) for layer in self.deepstack_features]
        return {
            "input_ids": self.input_ids.clone(),
            "attention_mask": self.attention_mask.clone(),
            "position_ids": self.position_ids.clone(),
            "mm_encoder_outputs": {"image": self.encoder_output_cls(**enc)},
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

    @property
    def kept_counts(self) -> list[int]:
        return [int(k.numel()) for k in self.kept_indices]



def model_tensors(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The processor tensors among `kwargs` (what `prepare` reads)."""
    return {k: kwargs[k] for k in INPUT_KEYS if kwargs.get(k) is not None}


def image_spans(is_image: torch.Tensor, attention_mask: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of image pads per row, row-major: [(row, start, end)]."""
    spans = []
    valid = is_image & attention_mask.bool()
    for b in range(valid.shape[0]):
        x = valid[b].to(torch.int8)
        d = torch.diff(x, prepend=x.new_zeros(1), append=x.new_zeros(1))
        starts = (d == 1).nonzero().squeeze(1).tolist()
        ends = (d == -1).nonzero().squeeze(1).tolist()
        spans.extend((b, s, e) for s, e in zip(starts, ends))
    return spans


def expand_budgets(budget: BudgetSpec, item_of_image: list[int], batch: int) -> list[Budget | None]:
    """One budget per image: a scalar for all, or one entry per row (scalar or per-image list).

    Each budget goes through the one parser (`parse_budget`: numbers or strings like "10%"); None
    entries stay None (the selector's default).
    """
    parse = lambda x: None if x is None else parse_budget(x)  # noqa: E731
    if budget is None or isinstance(budget, (int, float, str)):
        return [parse(budget)] * len(item_of_image)
    budget = list(budget)
    if len(budget) != batch:
        raise ValueError(f"got {len(budget)} budgets for a batch of {batch}; pass one per question (or one for all)")
    out: list[Budget | None] = []
    seen: dict[int, int] = {}
    for b in item_of_image:
        entry = budget[b]
        j = seen.get(b, 0)
        seen[b] = j + 1
        if isinstance(entry, (list, tuple)):
            n_img = item_of_image.count(b)
            if len(entry) != n_img:
                raise ValueError(f"question {b} has {n_img} images but {len(entry)} budgets")
            out.append(parse(entry[j]))
        else:
            out.append(parse(entry))
    return out


def validate_kept(
    kept: Sequence[torch.Tensor | None], n_tokens: Sequence[int], fallback: Sequence[str | None],
    errors: Sequence[str | None],
) -> tuple[list[torch.Tensor], list[str | None], list[str | None]]:
    """Sorted unique in-range non-empty indices per image; anything else keeps all tokens (and says why)."""
    out = []
    fallback, errors = list(fallback), list(errors)
    for i, (k, n) in enumerate(zip(kept, n_tokens)):
        problem = None
        if k is None:
            problem = "no indices returned"
        else:
            k = torch.as_tensor(k).long().flatten().cpu()
            if k.numel() == 0:
                problem = "empty selection (every image keeps at least one token)"
            elif int(k.min()) < 0 or int(k.max()) >= n:
                problem = f"indices outside [0, {n})"
            else:
                k = torch.unique(k)  # sorted ascending
        if problem is not None:
            out.append(torch.arange(n))
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
    feats: tuple[torch.Tensor, ...], deep: list[tuple[torch.Tensor, ...]] | None, kept: list[torch.Tensor],
    encoder_output_cls: type, item_of_image: list[int], grid_hw: list[tuple[int, int]], pad_token_id: int,
) -> PrunedInputs:
    """Drop the unkept image pads, keep every other token with its original positions, left-pad.

    input_ids / attention_mask [B, S]; pos3 [3, B, S] unpruned M-RoPE positions; feats / deep the
    full encoder outputs (n_i rows per image); kept LongTensor[K_i] per image, validated.
    """
    B, S = input_ids.shape
    dev = input_ids.device
    keep = attention_mask.bool().clone()                                  # [B, S]
    for (b, s, e), k in zip(spans, kept):
        keep[b, s:e] = False
        keep[b, s + k.to(dev)] = True
    lengths = keep.sum(-1)
    S2 = int(lengths.max())
    new_ids = torch.full((B, S2), pad_token_id, dtype=input_ids.dtype, device=dev)
    new_mask = torch.zeros((B, S2), dtype=attention_mask.dtype, device=dev)
    new_pos = torch.zeros((3, B, S2), dtype=pos3.dtype, device=dev)
    orig = torch.full((B, S2), -1, dtype=torch.long, device=dev)
    for b in range(B):
        idx = keep[b].nonzero().squeeze(1)                               # ascending: order is preserved
        L = idx.numel()
        new_ids[b, S2 - L:] = input_ids[b, idx]
        new_mask[b, S2 - L:] = 1
        new_pos[:, b, S2 - L:] = pos3[:, b, idx]
        orig[b, S2 - L:] = idx
    text_row = (new_mask.long().cumsum(-1) - 1).masked_fill(new_mask == 0, 0)   # contiguous, 0 on pads
    position_ids = torch.cat([text_row[None].to(pos3.dtype), new_pos], dim=0)   # [4, B, S']
    kept_dev = [k.to(f.device) for k, f in zip(kept, feats)]
    image_features = tuple(f[k] for f, k in zip(feats, kept_dev))
    deep_pruned = [tuple(f[k] for f, k in zip(layer, kept_dev)) for layer in deep] if deep is not None else None
    return PrunedInputs(
        input_ids=new_ids, attention_mask=new_mask, position_ids=position_ids, orig_index=orig,
        image_features=image_features, deepstack_features=deep_pruned, kept_indices=[k.cpu() for k in kept],
        full_features=feats, full_deepstack=deep, encoder_output_cls=encoder_output_cls, item_of_image=item_of_image,
        grid_hw=grid_hw,
    )
