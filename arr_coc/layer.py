"""ARRCOCLayer: texture -> knowing -> balancing -> attending, on the VLM's merged-token grid.

The layer is built from one `ARRCOCConfig` but receives its stages, so an
ablation swaps one part (`ARRCOCLayer(cfg, perspectival=MyScorer(...))`).
It never crashes its caller: if a stage raises or yields NaN/Inf for an image,
that image keeps all its tokens and the output says why (`fallback`, `errors`).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from .attending import TokenAllocator
from .balancing import AdaptiveTensionBalancer
from .budget import Budget, BudgetMode
from .config import ARRCOCConfig
from .extent import ExtentHead
from .knowing import InformationScorer, ParticipatoryScorer, PerspectivalScorer
from .texture import ImageLike, channel_names, generate_texture_array

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class ARRCOCOutput:
    """Everything the layer decided and why, for B images.

    Grids are padded to the batch's largest (Hm, Wm); image i is valid in its top-left
    h_i x w_i (`valid`). Kept indices are raster indices into image i's own grid.
    """

    kept_indices: list[torch.Tensor]  # per image LongTensor[K_i], ascending
    positions: list[torch.Tensor]  # per image LongTensor[K_i, 3]: (t, h, w), t = 0
    budgets: torch.Tensor  # LongTensor[B]: K_i
    kept_relevance: list[torch.Tensor]  # per image Tensor[K_i]
    keep_mask: torch.Tensor  # BoolTensor[B, Hm, Wm]
    relevance: torch.Tensor  # [B, Hm, Wm] in [0, 1]
    grid_hw: list[tuple[int, int]]
    valid: torch.Tensor  # BoolTensor[B, Hm, Wm]
    fallback: list[str | None]  # None | "grid" (low-structure image) | "keep_all" (a stage failed)
    errors: list[str | None]
    information: torch.Tensor | None = None  # [B, Hm, Wm]
    perspectival: torch.Tensor | None = None  # [B, Hm, Wm]
    participatory: torch.Tensor | None = None  # [B, Hm, Wm]
    weights: torch.Tensor | None = None  # [B, 3]: information, perspectival, participatory
    texture: torch.Tensor | None = None  # [B, C, Hm, Wm] in [0, 1]
    channel_names: list[str] | None = None
    extent: torch.Tensor | None = None  # [B]: the cells each question needs, by the layer's ExtentHead (if it has one)

    def __len__(self) -> int:
        return len(self.kept_indices)

    def item(self, i: int) -> "ARRCOCOutput":
        """Image i alone (grids cropped to its own h x w)."""
        h, w = self.grid_hw[i]

        def crop(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[i : i + 1, ..., :h, :w]

        return ARRCOCOutput(
            kept_indices=[self.kept_indices[i]],
            positions=[self.positions[i]],
            budgets=self.budgets[i : i + 1],
            kept_relevance=[self.kept_relevance[i]],
            keep_mask=crop(self.keep_mask),
            relevance=crop(self.relevance),
            grid_hw=[self.grid_hw[i]],
            valid=crop(self.valid),
            fallback=[self.fallback[i]],
            errors=[self.errors[i]],
            information=crop(self.information),
            perspectival=crop(self.perspectival),
            participatory=crop(self.participatory),
            weights=None if self.weights is None else self.weights[i : i + 1],
            texture=crop(self.texture),
            channel_names=self.channel_names,
            extent=None if self.extent is None else self.extent[i : i + 1],
        )


def pad_grid(maps: Sequence[torch.Tensor], hm: int, wm: int) -> torch.Tensor:
    """List of [..., h_i, w_i] -> [B, ..., Hm, Wm], zero padded at the bottom/right."""
    return torch.stack([F.pad(m, (0, wm - m.shape[-1], 0, hm - m.shape[-2])) for m in maps])


def _pad_tokens(tokens: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """List of [L_i, D] -> ([B, Lm, D], mask [B, Lm])."""
    lm = max(t.shape[0] for t in tokens)
    out = torch.stack([F.pad(t.float(), (0, 0, 0, lm - t.shape[0])) for t in tokens])
    mask = torch.stack([torch.arange(lm) < t.shape[0] for t in tokens])
    return out, mask


OPTIONAL_PREFIXES = ("participatory.token_proj.", "participatory.context.", "participatory.pair_query.",
                     "participatory.pair_out.")  # weights added later, zero-initialised (see from_pretrained)


class ARRCOCLayer(nn.Module):
    def __init__(
        self,
        config: ARRCOCConfig | None = None,
        *,
        information: nn.Module | None = None,
        perspectival: nn.Module | None = None,
        participatory: nn.Module | None = None,
        balancer: nn.Module | None = None,
        allocator: nn.Module | None = None,
    ):
        super().__init__()
        self.config = config = config or ARRCOCConfig()
        self.information = information or InformationScorer(config.texture, config.knowing)
        self.perspectival = perspectival or PerspectivalScorer(config.texture, config.knowing)
        self.participatory = participatory or ParticipatoryScorer(config.texture, config.knowing)
        self.balancer = balancer or AdaptiveTensionBalancer(config.balancing, config.knowing)
        self.allocator = allocator or TokenAllocator(config.attending)
        # The question-following budget's estimate of the answer's cells (only layers fitted with one).
        self.extent = ExtentHead(config.knowing.query_dim) if config.attending.spread_source == "extent" else None
        self.channel_names = channel_names(config.texture)

    # ------------------------------------------------------------------ stages
    def textures(self, images: Sequence[ImageLike], grid_hw: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """Per image [C, h_i, w_i] texture arrays (no gradient: fixed features)."""
        return [generate_texture_array(im, hw, self.config.texture)[0] for im, hw in zip(images, grid_hw)]

    def score(
        self,
        texture: torch.Tensor,
        valid: torch.Tensor,
        query: torch.Tensor | None = None,
        query_mask: torch.Tensor | None = None,
        visual_tokens: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Differentiable part on a padded batch: texture [B, C, Hm, Wm] -> maps and relevance.

        This is what training optimises (learn scores, select by top-k later).
        visual_tokens: [B, Hm * Wm, D] on the padded grid, or None.
        """
        info = self.information(texture, valid)
        persp = self.perspectival(texture, valid)
        part = self.participatory(texture, valid, query, query_mask, visual_tokens)
        relevance, weights = self.balancer(torch.stack([info, persp, part], 1), valid, query, query_mask)
        return {
            "information": info,
            "perspectival": persp,
            "participatory": part,
            "relevance": relevance,
            "weights": weights,
        }

    def pad_inputs(
        self,
        images: Sequence[ImageLike],
        grid_hw: Sequence[tuple[int, int]],
        query_embeds: Sequence[torch.Tensor] | None = None,
        visual_tokens: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The padded batch `score` reads (grids padded to the largest (Hm, Wm), bottom/right):
        texture [B, C, Hm, Wm], valid [B, Hm, Wm], query [B, L, D] + its mask [B, L] (or None),
        visual tokens [B, Hm * Wm, D] (or None). `forward` and the scorers' training share it."""
        grid_hw = [(int(h), int(w)) for h, w in grid_hw]
        hm, wm = max(h for h, _ in grid_hw), max(w for _, w in grid_hw)
        tex = pad_grid(self.textures(images, grid_hw), hm, wm)
        valid = pad_grid([torch.ones(h, w, dtype=torch.bool) for h, w in grid_hw], hm, wm)
        query, qmask = _pad_tokens(list(query_embeds)) if query_embeds is not None else (None, None)
        vis = None
        if visual_tokens is not None:
            grids = []
            for i, ((h, w), v) in enumerate(zip(grid_hw, visual_tokens)):
                if v.shape[0] != h * w:
                    raise ValueError(f"image {i}: {v.shape[0]} visual tokens for a {h}x{w} grid")
                grids.append(v.float().T.reshape(-1, h, w))
            vis = pad_grid(grids, hm, wm).flatten(2).transpose(1, 2)  # [B, Hm*Wm, D]
        return tex, valid, query, qmask, vis

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        images: Sequence[ImageLike] | torch.Tensor,
        grid_hw: Sequence[tuple[int, int]],
        query_embeds: Sequence[torch.Tensor] | torch.Tensor | None = None,
        visual_tokens: Sequence[torch.Tensor] | None = None,
        budget: Budget | Sequence[Budget | None] | None = None,
        budget_mode: BudgetMode | None = None,
    ) -> ARRCOCOutput:
        """Score and allocate a batch.

        images: list of B images at the processor's resized size ([3, H_i, W_i] floats in
            [0, 1], PIL or HxWx3 arrays), or a [B, 3, H, W] tensor.
        grid_hw: list of B merged-token grids (h_i, w_i).
        query_embeds: list of B [L_i, D] question-token embeddings (a [B, L, D] tensor means
            every row is fully valid), or None for question-free scoring.
        visual_tokens: list of B [h_i * w_i, D] merged visual tokens (raster order), or None.
        budget: None (config), a share in (0, 1], a count, or one of those per image (arr_coc.budget).
        budget_mode: "exact" | "mean" | "adaptive" | None (the layer's default), see arr_coc.budget.
        """
        images = list(images)
        grid_hw = [(int(h), int(w)) for h, w in grid_hw]
        b = len(images)
        if len(grid_hw) != b:
            raise ValueError(f"got {b} images but {len(grid_hw)} grids; pass one (h, w) per image")
        if query_embeds is not None and len(query_embeds) != b:
            raise ValueError(f"got {b} images but {len(query_embeds)} question embeddings")
        if visual_tokens is not None and len(visual_tokens) != b:
            raise ValueError(f"got {b} images but {len(visual_tokens)} visual-token sets")
        errors: list[str | None] = [None] * b

        try:
            tex, valid, query, qmask, vis = self.pad_inputs(images, grid_hw, query_embeds, visual_tokens)
            maps = self.score(tex, valid, query, qmask, vis)
            bad = [not torch.isfinite(maps["relevance"][i]).all() or not torch.isfinite(maps["weights"][i]).all()
                   for i in range(b)]
        except Exception as exc:  # noqa: BLE001 - graceful degradation is the contract
            if self.config.strict:
                raise
            if b > 1:  # find the failing image(s); the others still get pruned
                return self._merge([self.forward(images[i : i + 1], grid_hw[i : i + 1],
                                                 None if query_embeds is None else [query_embeds[i]],
                                                 None if visual_tokens is None else [visual_tokens[i]],
                                                 budget if budget is None or isinstance(budget, (int, float))
                                                 else [list(budget)[i]], budget_mode) for i in range(b)])
            return self._keep_all(grid_hw, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=3))

        if any(bad):
            if self.config.strict:
                raise FloatingPointError(f"non-finite relevance for images {[i for i, x in enumerate(bad) if x]}")
            for i, x in enumerate(bad):
                if x:
                    errors[i] = "non-finite scores (NaN/Inf); kept all tokens"
        relevance = torch.where(torch.isfinite(maps["relevance"]), maps["relevance"], torch.zeros(()))
        # Bottom-up structure (question-independent) decides whether the image is a "void".
        structure = 0.5 * (maps["information"] + maps["perspectival"]).detach()
        structure = torch.where(torch.isfinite(structure), structure, torch.zeros(()))
        extent = None if self.extent is None else self.extent(relevance, valid, query, qmask)  # [B] cells
        alloc = self.allocator(relevance, grid_hw, budget, structure, budget_mode, extent)

        kept, fallback, budgets = list(alloc.kept_indices), list(alloc.fallback), alloc.budgets.clone()
        keep_mask = alloc.keep_mask.clone()
        for i, (h, w) in enumerate(grid_hw):
            if errors[i] is not None:
                kept[i] = torch.arange(h * w)
                fallback[i] = "keep_all"
                budgets[i] = h * w
                keep_mask[i, :h, :w] = True
        positions = [torch.stack([torch.zeros_like(k), k // w, k % w], dim=1) for k, (_, w) in zip(kept, grid_hw)]
        kept_rel = [relevance[i, :h, :w].reshape(-1)[kept[i]] for i, (h, w) in enumerate(grid_hw)]
        return ARRCOCOutput(
            kept_indices=kept,
            positions=positions,
            budgets=budgets,
            kept_relevance=kept_rel,
            keep_mask=keep_mask,
            relevance=relevance,
            grid_hw=grid_hw,
            valid=valid,
            fallback=fallback,
            errors=errors,
            information=maps["information"],
            perspectival=maps["perspectival"],
            participatory=maps["participatory"],
            weights=maps["weights"],
            texture=tex,
            channel_names=list(self.channel_names),
            extent=extent,
        )

    def _keep_all(self, grid_hw: list[tuple[int, int]], error: str, detail: str) -> ARRCOCOutput:
        (h, w), = grid_hw
        kept = torch.arange(h * w)
        return ARRCOCOutput(
            kept_indices=[kept],
            positions=[torch.stack([torch.zeros_like(kept), kept // w, kept % w], dim=1)],
            budgets=torch.tensor([h * w]),
            kept_relevance=[torch.zeros(h * w)],
            keep_mask=torch.ones(1, h, w, dtype=torch.bool),
            relevance=torch.zeros(1, h, w),
            grid_hw=list(grid_hw),
            valid=torch.ones(1, h, w, dtype=torch.bool),
            fallback=["keep_all"],
            errors=[error],
            channel_names=list(self.channel_names),
        )

    def _merge(self, outs: list[ARRCOCOutput]) -> ARRCOCOutput:
        """Concatenate single-image outputs into one padded batch output."""
        grid_hw = [o.grid_hw[0] for o in outs]
        hm, wm = max(h for h, _ in grid_hw), max(w for _, w in grid_hw)

        def cat(name: str) -> torch.Tensor | None:
            parts = [getattr(o, name) for o in outs]
            if any(p is None for p in parts):
                return None
            return pad_grid([p[0] for p in parts], hm, wm)

        return ARRCOCOutput(
            kept_indices=[o.kept_indices[0] for o in outs],
            positions=[o.positions[0] for o in outs],
            budgets=torch.cat([o.budgets for o in outs]),
            kept_relevance=[o.kept_relevance[0] for o in outs],
            keep_mask=cat("keep_mask"),
            relevance=cat("relevance"),
            grid_hw=grid_hw,
            valid=cat("valid"),
            fallback=[o.fallback[0] for o in outs],
            errors=[o.errors[0] for o in outs],
            information=cat("information"),
            perspectival=cat("perspectival"),
            participatory=cat("participatory"),
            weights=None if any(o.weights is None for o in outs) else torch.cat([o.weights for o in outs]),
            texture=cat("texture"),
            channel_names=list(self.channel_names),
            extent=None if any(o.extent is None for o in outs) else torch.cat([o.extent for o in outs]),
        )

    # ------------------------------------------------------------- persistence
    def save_pretrained(self, folder: str | os.PathLike) -> None:
        """Write config.json + model.safetensors into `folder`."""
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, CONFIG_NAME), "w") as f:
            f.write(self.config.to_json())
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt", "arr_coc": "1"})

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **overrides: dict) -> "ARRCOCLayer":
        """Load a folder written by `save_pretrained`; `overrides` go to `ARRCOCConfig.replace`
        (e.g. `attending={"budget": 0.1}`)."""
        cfg_path = os.path.join(folder, CONFIG_NAME)
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no {CONFIG_NAME} in {folder!s}; expected a folder written by ARRCOCLayer.save_pretrained")
        with open(cfg_path) as f:
            config = ARRCOCConfig.from_json(f.read())
        if overrides:
            config = config.replace(**overrides)
        layer = cls(config)
        weights = os.path.join(folder, WEIGHTS_NAME)
        if not os.path.isfile(weights):
            raise FileNotFoundError(f"no {WEIGHTS_NAME} in {folder!s}; save the layer with save_pretrained first")
        missing, unexpected = layer.load_state_dict(load_file(weights), strict=False)
        # Layers saved before the participatory scorer gained its token projection, context conv and
        # pair MLP lack those weights; at their zero initialisation the layer scores exactly as they did.
        missing = [k for k in missing if not k.startswith(OPTIONAL_PREFIXES)]
        if layer.extent is None:  # loaded to count cells by perplexity (an override): its extent head goes unused
            unexpected = [k for k in unexpected if not k.startswith("extent.")]
        if missing or unexpected:
            raise RuntimeError(f"{weights} does not fit this ARR-COC config: missing {missing}, unexpected {unexpected}")
        return layer


__all__ = ["ARRCOCLayer", "ARRCOCOutput"]
