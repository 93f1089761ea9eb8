"""The toy backend the tests run the pipeline on: a VLM that is not Qwen, through the `VLMBackend` seam alone.

The toy model: a "tower" that turns each 16 px cell into a token from its mean colour (no context, so encoding
only the chosen cells is exact), and a "language model" that answers with the token whose embedding is closest to
the mean of what it reads. Its prompt is a row per question: its visuals' kept tokens, then its question's tokens.
`ToyBackend` is the core alone; `ToyBackendBefore` adds `EncodesBefore`. `stock_answer` is the toy model itself
over every token, with no pipeline: what keep-all must equal (tests/test_conformance.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arr_coc.core.grid import GridBatch
from arr_coc.core.texture import work_images
from arr_coc.geometry import dilate
from arr_coc.pipeline import IMAGE, VIDEO, Prompt
from arr_coc.pipeline.tokens import VisualRows

CELL, WIDTH, VOCAB = 16, 32, 50


@dataclass
class ToyPixels:
    pictures: list[torch.Tensor]          # per unit [3, H, W] in [0, 1]

    def work(self, px: int, grid: GridBatch | None = None):
        return work_images(self.pictures, grid, px)

    @property
    def images(self) -> list[torch.Tensor]:
        return self.pictures

    def subset(self, which):
        return ToyPixels([self.pictures[i] for i in which])


@dataclass
class ToyPruned:
    rows_tokens: list[torch.Tensor]       # per row [L, D]: kept visual tokens, then the question
    kept_indices: list[torch.Tensor]
    lengths: list[int]

    def rows(self, rows):
        return ToyPruned([self.rows_tokens[b] for b in rows], self.kept_indices, [self.lengths[b] for b in rows])

    @property
    def width(self) -> int:                # the toy never pads: its rows are read one by one
        return max(self.lengths)


@dataclass
class ToyDecoded:
    new_tokens: torch.Tensor
    sequences: torch.Tensor
    prefill_s: float
    first_logits: torch.Tensor | None = None


class ToyBackend:
    """The core of `arr_coc.pipeline.backend.VLMBackend` and nothing else, over a model a few lines long."""

    pad_token_id, eos_token_ids = 0, {1}
    device, text_hidden_size = torch.device("cpu"), WIDTH

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.colour = torch.randn(3, WIDTH, generator=g)
        self.embedding = torch.randn(VOCAB, WIDTH, generator=g)
        self.encoded_cells = 0            # cells the tower ran on (encode before encodes fewer)

    def build_inputs(self, visuals, questions):
        ids = [[2 + sum(map(ord, w)) % (VOCAB - 2) for w in q.split()] for q in questions]
        return {"visuals": [list(v) for v in visuals], "question_ids": ids}

    def read_prompt(self, inputs, encode_all, clock=None):
        pictures, rows, kinds, clips, groups, index, videos = [], [], [], [], [], [], 0
        for b, visuals in enumerate(inputs["visuals"]):
            for j, v in enumerate(visuals):
                is_clip = v.dim() == 4                           # [T, 3, H, W]: a clip of T temporal groups
                for g, frame in enumerate(list(v) if is_clip else [v]):
                    pictures.append(frame)
                    rows.append(b), index.append(j), groups.append(g)
                    kinds.append(VIDEO if is_clip else IMAGE)
                    clips.append(videos if is_clip else -1)
                videos += is_clip
        grids = [(p.shape[1] // CELL, p.shape[2] // CELL) for p in pictures]
        prompt = Prompt(len(inputs["visuals"]), rows, grids, kinds, clips, groups, index,
                        native={"pictures": pictures, "questions": inputs["question_ids"]})
        if encode_all:
            feats = tuple(self._tower(p, torch.arange(h * w)) for p, (h, w) in zip(pictures, grids))
            prompt.visual, prompt.feats = VisualRows.every_cell(feats, None), feats
        return prompt

    def _tower(self, picture, cells):
        h, w = picture.shape[1] // CELL, picture.shape[2] // CELL
        means = picture.reshape(3, h, CELL, w, CELL).mean((2, 4)).reshape(3, -1).T      # [h * w, 3]
        self.encoded_cells += len(cells)
        return torch.tanh(means[torch.as_tensor(cells)] @ self.colour)

    def pixels(self, prompt):
        return ToyPixels(prompt.native["pictures"])

    def question_tokens(self, prompt):
        return prompt.native["questions"]

    def embed_tokens(self, ids):
        return self.embedding[ids]

    def decode_text(self, ids):
        return " ".join(f"w{t}" for t in ids if t > 1)

    def rewrite(self, prompt, visual, lm_cells):
        feats, _ = visual.gather([c.numpy() for c in lm_cells])
        rows = []
        for b in range(prompt.rows):
            units = prompt.units_of(b)
            question = self.embedding[torch.tensor(prompt.native["questions"][b])]
            rows.append(torch.cat([feats[i] for i in units] + [question]))
        return ToyPruned(rows, [c.clone() for c in lm_cells], [len(r) for r in rows])

    def prefill(self, pruned, **forward):
        return SimpleOut(torch.stack([r.mean(0) @ self.embedding.T for r in pruned.rows_tokens]))

    def decode(self, pruned, first_logits=False, max_new_tokens=4, **generate):
        logits = self.prefill(pruned).logits                                  # [B, V]
        first = logits.argmax(-1, keepdim=True)
        new = torch.cat([first, torch.ones_like(first)], 1)[:, :max_new_tokens]   # the answer word, then the end
        return ToyDecoded(new, new, 0.0, logits if first_logits else None)


class ToyBackendBefore(ToyBackend):
    """The core + one capability, `EncodesBefore`: its tower on the chosen cells only (no context, so encoding only
    the chosen cells is exact)."""

    def check_encode(self, encode):
        pass

    def encode_gist(self, prompt, units, grids):
        return [self._tower(prompt.native["pictures"][i], torch.arange(g[0] * g[1] // 4)) for i, g in
                zip(units, grids)], None

    def context_cells(self, prompt, units, chosen, encode):
        return [dilate(c, prompt.grid_hw[i], encode.margin) for i, c in zip(units, chosen)]

    def encode_cells(self, prompt, units, cells, clock=None):
        return torch.cat([self._tower(prompt.native["pictures"][i], c) for i, c in zip(units, cells)]), None

    def cost_by_count(self):
        return True


@dataclass
class SimpleOut:
    logits: torch.Tensor


def scene(seed: int, h: int = 6, w: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.full((3, h * CELL, w * CELL), 0.8)
    for _ in range(3):
        r, c = int(torch.randint(0, h - 1, (1,), generator=g)), int(torch.randint(0, w - 1, (1,), generator=g))
        x[:, r * CELL:(r + 2) * CELL, c * CELL:(c + 2) * CELL] = torch.rand(3, 1, 1, generator=g)
    return x


@torch.no_grad()
def stock_answer(backend: ToyBackend, inputs: dict, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The toy model with every token, no pipeline: (first-token logits [B, V], greedy new tokens [B, T])."""
    logits = []
    for visuals, ids in zip(inputs["visuals"], inputs["question_ids"]):
        pictures = [f for v in visuals for f in (list(v) if v.dim() == 4 else [v])]
        tokens = [backend._tower(p, torch.arange((p.shape[1] // CELL) * (p.shape[2] // CELL))) for p in pictures]
        logits.append(torch.cat(tokens + [backend.embedding[torch.tensor(ids)]]).mean(0) @ backend.embedding.T)
    logits = torch.stack(logits)
    first = logits.argmax(-1, keepdim=True)
    return logits, torch.cat([first, torch.ones_like(first)], 1)[:, :max_new_tokens]
