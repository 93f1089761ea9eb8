"""The embedded model's losses besides the answer's cross-entropy: the vision tower's dense per-token loss,
the attention losses (answer cells, question words, counted objects) and the count answers' weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .batching import visual_tokens
from .supervision import crops_for_vision, dense_labels, letter_tiles, training_item
from .vlm_config import LETTER_TILE_CELLS, VLMTrainConfig
from .vocabulary import CELL_PX, COLOR_NAMES, LETTERS, SHAPES

if TYPE_CHECKING:
    from .batching import Batcher


class DenseHead(nn.Module):
    """Per-token classification against the LM's word embeddings (cosine), training-only."""

    def __init__(self, model, tokenizer, letter_weight: float = 1.0):
        super().__init__()
        self.weights = {"color": 1.0, "shape": 1.0, "letter": letter_weight}
        ids = lambda words: torch.tensor([tokenizer.convert_tokens_to_ids(w) for w in words])  # noqa: E731
        self.register_buffer("color_ids", ids(COLOR_NAMES), persistent=False)
        self.register_buffer("shape_ids", ids(SHAPES), persistent=False)
        self.register_buffer("letter_ids", ids([c.lower() for c in LETTERS]), persistent=False)
        d = model.config.text_config.hidden_size
        self.background = nn.Parameter(torch.randn(3, d) * 0.02)  # "no colour / no shape / no letter"
        self.centre = nn.Linear(d, 1)
        self.scale = 10.0
        self.background_weight = 0.2
        self.embed = model.get_input_embeddings()

    def forward(self, tokens: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
        """tokens [N, D]; labels: color/shape/letter ids [N] (0 = none) and centre [N] -> mean loss.

        Each attribute's loss is the mean over object cells plus `background_weight` x the mean
        over background cells: with ~85% background cells an unweighted mean is low as soon as
        background and colour are right, and shape and letter were never learned (measured:
        after 300 steps object cells were 99% right on colour, at chance on shape and letter).
        """
        v = F.normalize(tokens, dim=-1)
        loss = 0.0
        for k, (name, ids) in enumerate((("color", self.color_ids), ("shape", self.shape_ids), ("letter", self.letter_ids))):
            classes = F.normalize(torch.cat([self.background[k : k + 1], self.embed(ids)]), dim=-1)
            per_cell = F.cross_entropy(self.scale * v @ classes.T, labels[name], reduction="none")
            obj = labels["color"] > 0 if name != "letter" else labels["letter"] > 0
            fg = per_cell[obj].mean() if obj.any() else per_cell.sum() * 0
            bg = per_cell[~obj].mean() if (~obj).any() else per_cell.sum() * 0
            loss = loss + self.weights[name] * (fg + self.background_weight * bg)
        loss = loss + F.binary_cross_entropy_with_logits(self.centre(tokens)[:, 0], labels["centre"])
        return loss / (1 + sum(self.weights.values()))


def dense_loss(model, processor, head: DenseHead, cfg: VLMTrainConfig, first: int, n: int) -> torch.Tensor:
    """The vision tower's dense loss on training items first .. first + n - 1 (letter-rich scenes, tiled),
    plus `cfg.letter_tiles` letter-centred tiles cut from the same scenes."""
    items = [training_item(cfg, first + i, cfg.vision_letter_rate) for i in range(n)]
    rng = np.random.default_rng([cfg.seed, 11, first])
    if cfg.vision_crop:
        tiles = [t for it in items for t in crops_for_vision(it[0], it[1], cfg.vision_crop, rng)]
    else:
        tiles = [(it[0], dense_labels(it[1], it[0].height // CELL_PX, it[0].width // CELL_PX)) for it in items]
    if cfg.letter_tiles:
        extra = [t for it in items for t in letter_tiles(it[0], it[1], LETTER_TILE_CELLS, rng)]
        tiles += [extra[i] for i in rng.permutation(len(extra))[: cfg.letter_tiles]]
    images, labels = zip(*tiles)
    feats, _ = visual_tokens(model, processor, list(images))
    return sum(head(f, lab) for f, lab in zip(feats, labels)) / len(labels)


def attention_loss(probs: dict[tuple[int, int], torch.Tensor], sup, index, layers, head: int = 0) -> torch.Tensor:
    """Mean over (query position, layer) of -log(the head's attention mass on the supervised keys).

    probs: (layer, head) -> [R, L] recorded rows; sup: [(batch row, query position, key positions)].
    """
    which = torch.cat([torch.full((len(k),), index[(r, p)]) for r, p, k in sup])
    keys = torch.cat([k for _, _, k in sup])
    group = torch.cat([torch.full((len(k),), i) for i, (_, _, k) in enumerate(sup)])
    losses = []
    for layer in layers:
        picked = probs[(layer, head)][which, keys]
        mass = torch.zeros(len(sup), dtype=picked.dtype).index_add(0, group, picked)
        losses.append(-torch.log(mass.clamp_min(1e-6)))
    return torch.cat(losses).mean()


def count_loss(probs: dict[tuple[int, int], torch.Tensor], sup, index, layer: int, head: int, sink: float) -> torch.Tensor:
    """Cross-entropy of the head's attention row against "`sink` on position 0, 1 on each counted object".

    sup: [(batch row, query position, centre-cell positions)]. A softmax head cannot sum,
    but with this target its output is (sink * v_0 + sum of n object values) / (sink + n):
    a monotone function of the count n that the MLP after it can read (0 when n = 0).
    """
    which = torch.tensor([index[(r, p)] for r, p, _ in sup])
    logp = probs[(layer, head)][which].clamp_min(1e-9).log()  # [S, L]
    target = torch.zeros_like(logp)
    target[:, 0] = sink
    for i, (_, _, cells) in enumerate(sup):
        target[i, cells] = 1.0
    target = target / target.sum(-1, keepdim=True)
    return -(target * logp).sum(-1).mean()


def count_answer_weights(cfg: VLMTrainConfig, batcher: "Batcher", vocab: int) -> torch.Tensor:
    """Answer-loss weight per vocabulary id [vocab]: count answers reweighted to a uniform 0-9 prior.

    A training image carries one planned question (count answers uniform over 0-9, as in the
    benchmark) and seven drawn from its scene, whose counts are mostly small: over 300 training
    images, 2 was 21% of the count answers and 8 and 9 were 1.2% each. Trained on that prior the
    model answers large counts low (the release before count balancing never answered 8 on the
    test split). The weight of answer n is min(cap, 0.1 / p(n)), with p measured on the first
    `count_prior_items` training images, scaled so that the mean weight over training count
    answers stays 1. Every other answer keeps weight 1.
    """
    tally = {str(n): 0 for n in range(10)}
    for i in range(cfg.count_prior_items):
        for _, answer, qtype, _ in training_item(cfg, i)[2]:
            if qtype == "count":
                tally[answer] += 1
    total = sum(tally.values())
    if total == 0:
        raise ValueError(f"no count question in the first {cfg.count_prior_items} training images: raise count_prior_items")
    raw = {a: min(cfg.count_balance, 0.1 * total / max(1, k)) for a, k in tally.items()}
    mean = sum(tally[a] * w for a, w in raw.items()) / total
    weights = torch.ones(vocab)
    for a, w in raw.items():
        weights[batcher.answer_id(a)] = w / mean
    return weights
