"""Train the embedded Qwen2-VL-architecture model from scratch on ShapesVQA (CPU, about 1.5 hours).

Plain end-to-end training does not learn here in 20 minutes (shared/FINDINGS.md:
the merger's tokens collapse and the language model ignores the image). So the
model is trained in three stages, each a number of optimiser steps:

1. vision   — vision tower + merger with a dense per-token loss: each merged token
              must name the colour, shape and letter of the object under its cell
              (and whether the object's centre lies in it). The class vectors ARE the
              language model's word embeddings ("red", "triangle", "k"), compared by
              cosine, so visual tokens land next to the words a question uses: that is
              also what ARR-COC's training-free participatory path measures.
2. language — vision frozen; the language model learns to answer. Each image carries
              several questions in ONE sequence, each question in its own attention
              block that sees only the image and itself, at exactly the positions a
              single-question prompt would have: one vision pass serves 8 answers.
3. joint    — both at once: each step the tower takes its dense loss on one set of scenes
              and the LM its answer loss on another (whose visual tokens are computed
              without gradient: the LM's gradient into the tower is ~1e-3 of its own,
              FINDINGS.md, and a full-image backward through the tower costs more than
              the LM's whole step). Letters are the tower's slowest attribute, so the LM
              can learn to bind colours and shapes while the tower still learns letters.

Binding a question to its object is what a small LM learns slowest (FINDINGS.md: near
the text prior after 20 minutes even with ideal visual tokens). So in stages 2-3 head 0
of layers 1-3 is also supervised to put its attention, at the answer position, on the
answer's cells (an auxiliary attention loss, as in supervised-attention VQA, e.g. Qiao
et al., AAAI 2018); the heads stay free to do anything else elsewhere.

Visual-token dropout throughout stages 2-3 (keep the answer's cells plus a random
share of the rest, at their ORIGINAL M-RoPE positions, as ARR-COC prunes) makes the
model tolerate missing visual tokens, like large VLMs do.

    python -m arr_coc train-vlm --out checkpoints/shapes-qwen2vl [--resume] [--steps 600,2400,600]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .shapes.cells import cell_labels
from .shapes.items import make_item
from .shapes.questions import questions_for_scene
from .shapes.vocabulary import CELL_PX, COLOR_NAMES, LETTERS, P_LETTER, QUESTION_TYPES, SHAPES
from .shapes.embedded import DEFAULT_CHECKPOINT, build_embedded
from .geometry import box_cells, centre_cells
from .processing import IM_END, IMAGE_TOKEN, render_prompt
from .training.schedule import lr_at

STAGES = ("vision", "language", "joint")
LR_FLOOR = 0.1   # each stage's cosine decays to a tenth of its peak learning rate
LETTER_TILE_CELLS = 4


@dataclass
class VLMTrainConfig:
    out: str = DEFAULT_CHECKPOINT
    state: str = "runs/train_vlm_state.pt"     # optimiser + progress, for --resume (not shipped)
    seed: int = 1234
    steps: tuple[int, int, int] = (1100, 0, 2000)  # optimiser steps per stage (the shipped recipe; README)
    images_per_step: tuple[int, int, int] = (8, 8, 8)
    questions_per_image: int = 8
    lr: tuple[float, float, float] = (2e-3, 1.5e-3, 1.5e-3)
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    dense_weight: float = 1.0
    attn_weight: float = 0.5
    attn_layers: tuple[int, ...] = (1, 2, 3)   # head 0 of these LM layers is supervised onto the answer's cells;
                                                # head 0 of layer 0 onto the question's colour/shape words
    # (layer, head, sink): each head is supervised to spread over the counted objects and position 0
    # with weight `sink` (see count_loss); heads with different sinks resolve different ranges of n
    count_heads: tuple[tuple[int, int, float], ...] = ((2, 1, 5.0),)
    count_balance: float = 0.0      # > 0: reweight count answers to the benchmark's uniform 0-9 (weight cap; see
                                    # count_answer_weights); 0 = plain answer loss
    count_prior_items: int = 400    # training images that estimate the training distribution of count answers
    random_canvas_p: float = 0.3    # else the default 448 x 448 canvas
    keep_min: float = 0.05          # visual-token dropout: share of non-answer cells kept ~ U(keep_min, 1)
    vision_crop: int = 8            # vision stage trains on 8 x 8-cell tiles of its scenes (0 = whole images)
    letter_weight: float = 2.0      # letters are the slowest attribute to learn ...
    vision_letter_rate: float = 0.9  # ... and rare (35% of eligible objects): the vision stage sees more
    letter_tiles: int = 0           # per step, this many 4 x 4-cell tiles around lettered objects join the dense loss
    full_p: float = 0.35            # chance a sequence keeps every visual token
    val_items: int = 300
    val_seed: int = 99              # validation items: split "val", never the test seed
    eval_every: int = 200
    save_every: int = 100
    init: str | None = None         # start from the weights of another run's --state file
    log: list = field(default_factory=list)


# ------------------------------------------------------------------ data
def training_item(cfg: VLMTrainConfig, index: int, letter_rate: float = P_LETTER):
    """(image, scene, questions) for training item `index`: the planned, balanced question first."""
    rng = np.random.default_rng([cfg.seed, 7, index])
    canvas = "random" if rng.random() < cfg.random_canvas_p else (448, 448)
    image, record, scene = make_item(cfg.seed, "train", index, canvas=canvas, letter_rate=letter_rate)
    first = record["question"]
    extra = [q for q in questions_for_scene(scene, rng, cfg.questions_per_image) if q.text != first]
    questions = [(first, record["answers"][0], record["type"], [tuple(b) for b in record["boxes"]])]
    questions += [(q.text, q.answers[0], q.type, list(q.boxes)) for q in extra[: cfg.questions_per_image - 1]]
    return image, scene, questions


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


def centre_mask(scene, gh: int, gw: int) -> np.ndarray:
    """float32 [gh, gw]: 1 at the cell holding each object's centre (`arr_coc.geometry.centre_cells`)."""
    out = np.zeros(gh * gw, dtype=np.float32)
    out[centre_cells([o.box for o in scene.objects], (gh, gw), CELL_PX)] = 1.0
    return out.reshape(gh, gw)


def answer_cells(boxes, gh: int, gw: int) -> set[int]:
    """Raster indices of the cells of a gh x gw grid of 28 px cells under any of `boxes` (pixels).

    The cells are `arr_coc.geometry.box_cells`'; they are added box by box in raster order because
    the attention loss sums its targets in this set's iteration order, which depends on the order
    of insertion (so training stays bit-identical to the recipe that made the shipped checkpoint).
    """
    return {c for cells in box_cells(boxes, (gh, gw), (gw * CELL_PX, gh * CELL_PX)) for c in sorted(cells)}


@dataclass
class Supervision:
    """Attention targets of one batch, each a list of (batch row, answer position, key positions [K])."""

    cells: list   # the answer's kept cells (heads 0 of the attn_layers)
    words: list   # the question's colour / shape words (head 0 of layer 0)
    count: list   # count questions: the centre cell of each counted object (may be empty)

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], int]]:
        return supervised_rows(self.cells, self.words, self.count)


class Batcher:
    """Turns items into one padded LM batch with block-diagonal question segments."""

    def __init__(self, model, processor):
        self.model = model
        self.processor = processor
        self.tok = processor.tokenizer
        self.image_id = self.tok.convert_tokens_to_ids(IMAGE_TOKEN)
        self.end_id = self.tok.convert_tokens_to_ids(IM_END)
        self.pad_id = self.tok.pad_token_id
        # The words a question selects its object by: colours and shapes (singular or plural).
        keys = list(COLOR_NAMES) + list(SHAPES) + [f"{s}s" for s in SHAPES]
        self.key_ids = {i for i in self.tok.convert_tokens_to_ids(keys) if i != self.tok.unk_token_id}

    def encode(self, question: str, n_visual: int) -> tuple[list[int], list[int]]:
        """(prefix ids up to and including the image pads, suffix ids after them) of the single-question prompt."""
        text = render_prompt(self.processor, 1, question)
        head, tail = text.split(IMAGE_TOKEN)
        prefix = self.tok(head, add_special_tokens=False)["input_ids"] + [self.image_id] * n_visual
        return prefix, self.tok(tail, add_special_tokens=False)["input_ids"]

    def answer_id(self, answer: str) -> int:
        ids = self.tok(answer, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or ids[0] == self.tok.unk_token_id:
            raise ValueError(f"answer {answer!r} is not one known word of the tokenizer")
        return ids[0]

    def build(self, feats: list[torch.Tensor], grids: list[tuple[int, int]], questions: list[list], keep: list[torch.Tensor]):
        """feats: per image [N_i, D] visual tokens; keep: per image kept raster indices (ascending).

        Returns inputs_embeds [B, L, D], position_ids [3, B, L], mask [B, 1, L, L] (additive float:
        0 = attend, -inf = not), targets [B, L] (-100 = no loss), types (question type per target
        position, list of lists), and the batch's attention `Supervision`.
        """
        embed = self.model.get_input_embeddings()
        seqs = []
        for f, (gh, gw), qs, kept in zip(feats, grids, questions, keep):
            prefix, _ = self.encode(qs[0][0], gh * gw)
            n_text = len(prefix) - gh * gw
            # Unpruned Qwen2-VL positions: text 0..n_text-1, image (t, h, w) offset by n_text,
            # text after the image continues from n_text + max(gh, gw) (what get_rope_index gives).
            rows, cols = kept // gw, kept % gw
            pos = [torch.arange(n_text).repeat(3, 1),
                   torch.stack([torch.full_like(kept, n_text), rows + n_text, cols + n_text])]
            start = n_text + max(gh, gw)
            ids = prefix[:n_text]
            seg = [0] * (n_text + len(kept))
            target = [-100] * (n_text + len(kept))
            qtypes = [None] * (n_text + len(kept))
            slot = {int(c): n_text + i for i, c in enumerate(kept.tolist())}  # cell -> sequence position
            sup, word_sup, count_sup = [], [], []
            suffix_ids = []
            for j, (q, a, qtype, boxes) in enumerate(qs, start=1):
                _, suffix = self.encode(q, 0)
                body = suffix + [self.answer_id(a), self.end_id]
                suffix_ids += body
                pos.append(torch.arange(start, start + len(body)).repeat(3, 1))
                seg += [j] * len(body)
                t = [-100] * len(body)
                t[len(suffix) - 1], t[len(suffix)] = body[len(suffix)], self.end_id
                target += t
                qt = [None] * len(body)
                qt[len(suffix) - 1] = qtype
                cells = [slot[c] for c in answer_cells(boxes, gh, gw) if c in slot]
                answer_pos = len(qtypes) + len(suffix) - 1
                if cells:
                    sup.append((answer_pos, torch.tensor(cells)))
                words = [len(qtypes) + k for k, t in enumerate(suffix) if t in self.key_ids]
                if words:
                    word_sup.append((answer_pos, torch.tensor(words)))
                if qtype == "count":
                    centres = [slot[c] for c in centre_cells(boxes, (gh, gw), CELL_PX) if c in slot]
                    count_sup.append((answer_pos, torch.tensor(centres, dtype=torch.long)))
                qtypes += qt
            emb = torch.cat([embed(torch.tensor(ids)), f[kept], embed(torch.tensor(suffix_ids))])
            seqs.append((emb, torch.cat(pos, 1), torch.tensor(seg), torch.tensor(target), qtypes, sup, word_sup, count_sup))
        length = max(s[0].shape[0] for s in seqs)
        b = len(seqs)
        d = seqs[0][0].shape[1]
        inputs = torch.zeros(b, length, d)
        positions = torch.zeros(3, b, length, dtype=torch.long)
        segs = torch.full((b, length), -1)
        targets = torch.full((b, length), -100)
        types, supervision = [], Supervision([], [], [])
        for i, (emb, pos, seg, tgt, qt, sup, word_sup, count_sup) in enumerate(seqs):
            n = emb.shape[0]
            inputs[i, :n], positions[:, i, :n], segs[i, :n], targets[i, :n] = emb, pos, seg, tgt
            types.append(qt + [None] * (length - n))
            supervision.cells += [(i, p, cells) for p, cells in sup]
            supervision.words += [(i, p, words) for p, words in word_sup]
            supervision.count += [(i, p, cells) for p, cells in count_sup]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same = (segs[:, None, :] == 0) | (segs[:, None, :] == segs[:, :, None])
        mask = causal & same & (segs[:, None, :] >= 0)
        mask |= torch.eye(length, dtype=torch.bool)  # padded rows attend to themselves (no NaN)
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # eager and sdpa alike
        return inputs, positions, additive[:, None], targets, types, supervision


def visual_tokens(model, processor, images):
    """Merged visual tokens per image [N_i, D] and merged grids (h, w)."""
    vis = processor.image_processor(images=images, return_tensors="pt")
    out = model.model.get_image_features(vis["pixel_values"], vis["image_grid_thw"])
    grids = [(int(h) // 2, int(w) // 2) for _, h, w in vis["image_grid_thw"].tolist()]
    return list(out.pooler_output), grids


def dense_labels(scene, gh: int, gw: int) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(a[:gh, :gw]).reshape(-1)) for k, a in _label_maps(scene, gh, gw).items()}


def crops_for_vision(image, scene, cells: int, rng: np.random.Generator):
    """Cell-aligned `cells` x `cells` tiles of a scene (random grid offset) and their dense labels.

    The vision tower attends over all patches, so its cost grows with the square of the
    image's patch count; shape and letter recognition are local. Tiling a 448 px scene into
    four 224 px crops costs the tower about a quarter of the full image and reuses the scene
    (generation is ~10 ms of CPU per scene). Whole images come back in the language and
    joint stages.
    """
    gh, gw = image.height // CELL_PX, image.width // CELL_PX
    ch, cw = min(cells, gh), min(cells, gw)
    r_off, c_off = int(rng.integers(0, gh % ch + 1)), int(rng.integers(0, gw % cw + 1))
    maps = _label_maps(scene, gh, gw)
    return [_tile(image, maps, r0, c0, ch, cw)
            for r0 in range(r_off, gh - ch + 1, ch) for c0 in range(c_off, gw - cw + 1, cw)]


def letter_tiles(image, scene, cells: int, rng: np.random.Generator):
    """One `cells` x `cells` tile around each lettered object (random placement), with dense labels.

    Letters are what the tower learns slowest: in whole scenes or 8 x 8 tiles most cells are
    background or unlettered, so each step carries few letter cells. A 4 x 4 tile per lettered
    object costs the tower 1/16 of a 448 px scene and is mostly glyph.
    """
    gh, gw = image.height // CELL_PX, image.width // CELL_PX
    maps = _label_maps(scene, gh, gw)
    out = []
    for o in scene.objects:
        x0, y0, x1, y1 = o.box
        # First / last cell the box touches (x1, y1 exclusive); every tile placement that holds both.
        c_lo, c_hi = max(0, int((x1 - 1) // CELL_PX) - cells + 1), min(gw - cells, int(x0 // CELL_PX))
        r_lo, r_hi = max(0, int((y1 - 1) // CELL_PX) - cells + 1), min(gh - cells, int(y0 // CELL_PX))
        if o.letter and c_lo <= c_hi and r_lo <= r_hi:
            r0, c0 = int(rng.integers(r_lo, r_hi + 1)), int(rng.integers(c_lo, c_hi + 1))
            out.append(_tile(image, maps, r0, c0, cells, cells))
    return out


def _label_maps(scene, gh: int, gw: int) -> dict[str, np.ndarray]:
    lab = cell_labels(scene, CELL_PX, min_cover=0.15)
    return {"color": lab.color, "shape": lab.shape, "letter": lab.letter, "centre": centre_mask(scene, gh, gw)}


def _tile(image, maps: dict[str, np.ndarray], r0: int, c0: int, ch: int, cw: int):
    crop = image.crop((c0 * CELL_PX, r0 * CELL_PX, (c0 + cw) * CELL_PX, (r0 + ch) * CELL_PX))
    return crop, {k: torch.from_numpy(np.ascontiguousarray(a[r0 : r0 + ch, c0 : c0 + cw]).reshape(-1)) for k, a in maps.items()}


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


def choose_kept(questions, gh: int, gw: int, gen: torch.Generator, cfg: VLMTrainConfig) -> torch.Tensor:
    """All cells, or the questions' answer cells plus a random share of the rest (ascending)."""
    n = gh * gw
    if torch.rand((), generator=gen) < cfg.full_p:
        return torch.arange(n)
    must = set().union(*(answer_cells(q[3], gh, gw) for q in questions))
    share = cfg.keep_min + (1 - cfg.keep_min) * float(torch.rand((), generator=gen))
    rand = torch.rand(n, generator=gen) < share
    keep = rand.clone()
    keep[list(must)] = True
    if not keep.any():
        keep[int(torch.randint(n, (1,), generator=gen))] = True
    return keep.nonzero()[:, 0]


SUPERVISED_SDPA = "arr_coc_supervised_sdpa"


class AttentionRecorder:
    """Head-0 attention rows at chosen query positions, recorded during an sdpa forward.

    The auxiliary loss needs a handful of attention rows (head 0, answer positions)
    per layer; `output_attentions` would need eager attention, which materialises and
    backpropagates every head's full L x L matrix (measured: 10.7 of 12 s per step).
    This records only the rows asked for, from the same rotated queries and keys the
    sdpa kernel uses, through transformers' public AttentionInterface.
    """

    def __init__(self, language_model, heads: dict[int, tuple[int, ...]]):
        """heads: layer -> the query heads to record in it."""
        from transformers import AttentionInterface

        AttentionInterface.register(SUPERVISED_SDPA, _supervised_sdpa)
        self.heads = heads
        self.rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (batch index [R], query position [R])
        self.probs: dict[tuple[int, int], torch.Tensor] = {}         # (layer, head) -> [R, L]
        for layer in heads:
            language_model.layers[layer].self_attn.arr_coc_recorder = self

    def request(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        self.rows, self.probs = (rows, positions), {}


def _supervised_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorder = getattr(module, "arr_coc_recorder", None)
    if recorder is not None and recorder.rows is not None:
        b, p = recorder.rows
        for h in recorder.heads[module.layer_idx]:
            # query [B, H, L, d], key [B, H_kv, L, d]: query head h reads key/value head h // groups.
            scores = torch.einsum("rd,rld->rl", query[b, h, p], key[b, h // module.num_key_value_groups])
            scores = scores * module.scaling
            if attention_mask is not None:
                mask = attention_mask[b, 0, p]
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            recorder.probs[(module.layer_idx, h)] = scores.softmax(-1)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def supervised_rows(*sups) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], int]]:
    """The distinct (batch row, query position) pairs of attention supervisions, and their index."""
    pairs = sorted({(r, p) for sup in sups for r, p, _ in sup})
    index = {pair: i for i, pair in enumerate(pairs)}
    rows = torch.tensor([r for r, _ in pairs], dtype=torch.long)
    positions = torch.tensor([p for _, p in pairs], dtype=torch.long)
    return rows, positions, index


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


# ------------------------------------------------------------------ evaluation
@torch.no_grad()
def validate(model, processor, batcher, cfg: VLMTrainConfig, n: int | None = None) -> dict:
    """First-token accuracy of single-question prompts with all visual tokens, per type."""
    model.eval()
    n = n or cfg.val_items
    hits = {t: [] for t in QUESTION_TYPES}
    bs = 16
    for s in range(0, n, bs):
        items = [make_item(cfg.val_seed, "val", i, canvas="random" if i % 3 == 0 else (448, 448)) for i in range(s, min(n, s + bs))]
        feats, grids = visual_tokens(model, processor, [it.image for it in items])
        qs = [[(it.record["question"], it.record["answers"][0], it.record["type"], [])] for it in items]
        inputs, pos, mask, targets, types, _ = batcher.build(feats, grids, qs, [torch.arange(h * w) for h, w in grids])
        logits = model.lm_head(model.model.language_model(inputs_embeds=inputs, position_ids=pos, attention_mask=mask).last_hidden_state)
        pred = logits.argmax(-1)
        for i in range(len(items)):
            for p, qt in enumerate(types[i]):
                if qt is not None:
                    hits[qt].append(bool(pred[i, p] == targets[i, p]))
    model.train()
    per_type = {t: (sum(v) / len(v) if v else float("nan")) for t, v in hits.items()}
    total = sum(len(v) for v in hits.values())
    return {"accuracy": sum(sum(v) for v in hits.values()) / max(1, total), "per_type": per_type, "n": total}


# ------------------------------------------------------------------ training
def make_optimizer(model, head, stage: str, cfg: VLMTrainConfig):
    k = STAGES.index(stage)
    if stage == "vision":
        params = list(model.model.visual.parameters()) + list(model.get_input_embeddings().parameters()) + list(head.parameters())
    elif stage == "language":
        params = [p for n, p in model.named_parameters() if not n.startswith("model.visual.")]
    else:
        params = list(model.parameters()) + list(head.parameters())
    seen, unique = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    model.requires_grad_(False)
    head.requires_grad_(False)
    for p in unique:
        p.requires_grad_(True)
    return torch.optim.AdamW(unique, lr=cfg.lr[k], weight_decay=cfg.weight_decay, betas=(0.9, 0.98))


def train(cfg: VLMTrainConfig, resume: bool = False, progress: bool = True) -> dict:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    model, processor = build_embedded(seed=cfg.seed)
    # The auxiliary loss reads head-0 attention rows: sdpa plus a recorder while training
    # (the saved config says plain sdpa; both use the same additive masks).
    heads = {layer: (0,) for layer in (0, *cfg.attn_layers)}
    text = model.config.text_config
    for layer, h, sink in cfg.count_heads:
        if not (0 <= layer < text.num_hidden_layers and 0 <= h < text.num_attention_heads and sink > 0):
            raise ValueError(f"count head {layer}.{h}:{sink:g} does not fit this LM ({text.num_hidden_layers} "
                             f"layers x {text.num_attention_heads} heads) or its sink is not > 0")
        heads[layer] = tuple(sorted({*heads.get(layer, ()), h}))
    recorder = AttentionRecorder(model.model.language_model, heads)
    model.model.language_model.set_attn_implementation(SUPERVISED_SDPA)
    model.train()
    head = DenseHead(model, processor.tokenizer, cfg.letter_weight)
    batcher = Batcher(model, processor)
    answer_weights = None
    if cfg.count_balance > 0:
        answer_weights = count_answer_weights(cfg, batcher, model.config.text_config.vocab_size)
    state = {"stage": 0, "step": 0, "item": 0, "elapsed": 0.0, "log": []}
    opt_state = None
    if cfg.init and not (resume and os.path.isfile(cfg.state)):
        state["item"] = warm_start(model, head, cfg.init)
        print(f"initialised from {cfg.init}")
    if resume and os.path.isfile(cfg.state):
        saved = torch.load(cfg.state, weights_only=True)
        model.load_state_dict(saved["model"])
        head.load_state_dict(saved["head"])
        opt_state = saved["optimizer"]
        state = saved["progress"]
        torch.set_rng_state(saved["torch_rng"])
        print(f"resumed at stage {STAGES[state['stage']]} step {state['step']} ({state['elapsed'] / 60:.1f} min so far)")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    if resume and "gen_state" in state:
        gen.set_state(state.pop("gen_state"))

    while state["stage"] < len(STAGES):
        k = state["stage"]
        stage = STAGES[k]
        opt = make_optimizer(model, head, stage, cfg)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
            opt_state = None
        total = cfg.steps[k]
        bar = tqdm(total=total, initial=state["step"], desc=f"train-vlm [{stage}]", disable=not progress,
                   dynamic_ncols=True, mininterval=1.0 if os.isatty(2) else 30.0)
        while state["step"] < total:
            t0 = time.perf_counter()
            lr = lr_at(state["step"], total, cfg.lr[k], cfg.warmup, floor=LR_FLOOR)
            for g in opt.param_groups:
                g["lr"] = lr
            loss_dense = loss_answer = loss_attn = torch.zeros(())
            acc = float("nan")
            if stage != "language":
                loss_dense = dense_loss(model, processor, head, cfg, state["item"], cfg.images_per_step[k])
                state["item"] += cfg.images_per_step[k]
            if stage != "vision":
                items = [training_item(cfg, state["item"] + i) for i in range(cfg.images_per_step[k])]
                state["item"] += len(items)
                with torch.no_grad():  # the LM's gradient never reaches the tower (see the module docstring)
                    feats, grids = visual_tokens(model, processor, [it[0] for it in items])
                keep = [choose_kept(it[2], h, w, gen, cfg) for it, (h, w) in zip(items, grids)]
                inputs, pos, mask, targets, _, sup = batcher.build(feats, grids, [it[2] for it in items], keep)
                rows, positions, index = sup.rows()
                recorder.request(rows, positions)
                out = model.model.language_model(inputs_embeds=inputs, position_ids=pos, attention_mask=mask)
                recorder.rows = None
                sel = targets >= 0
                logits = model.lm_head(out.last_hidden_state[sel])
                loss_answer = F.cross_entropy(logits, targets[sel], reduction="none")
                if answer_weights is not None:
                    loss_answer = loss_answer * answer_weights[targets[sel]]
                loss_answer = loss_answer.mean()
                if cfg.attn_weight > 0 and sup.cells:
                    loss_attn = attention_loss(recorder.probs, sup.cells, index, cfg.attn_layers)
                if cfg.attn_weight > 0 and sup.words:
                    loss_attn = loss_attn + attention_loss(recorder.probs, sup.words, index, (0,))
                if cfg.attn_weight > 0 and sup.count:
                    for layer, h, sink in cfg.count_heads:
                        loss_attn = loss_attn + count_loss(recorder.probs, sup.count, index, layer, h, sink)
                acc = float((logits.argmax(-1) == targets[sel]).float().mean())
            loss = loss_answer + cfg.dense_weight * loss_dense + cfg.attn_weight * loss_attn
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip))
            opt.step()
            state["step"] += 1
            state["elapsed"] += time.perf_counter() - t0
            rec = {"stage": stage, "step": state["step"], "lr": lr, "loss_answer": float(loss_answer.detach()),
                   "loss_dense": float(loss_dense.detach()), "loss_attn": float(loss_attn.detach()), "train_token_acc": acc, "grad_norm": gnorm,
                   "minutes": state["elapsed"] / 60}
            bar.set_postfix(ans=f"{rec['loss_answer']:.3f}", dense=f"{rec['loss_dense']:.3f}",
                            attn=f"{rec['loss_attn']:.3f}", acc=f"{acc:.2f}")
            bar.update(1)
            if state["step"] % 25 == 0:
                state["log"].append(rec)
            last = state["step"] == total
            if stage != "vision" and (state["step"] % cfg.eval_every == 0 or last):
                val = validate(model, processor, batcher, cfg)
                state["log"].append({"stage": stage, "step": state["step"], "minutes": state["elapsed"] / 60, "val": val})
                bar.write(f"[{stage} {state['step']}] val acc {val['accuracy']:.3f} "
                          + " ".join(f"{t}={a:.2f}" for t, a in val["per_type"].items()))
            if state["step"] % cfg.save_every == 0 or last:
                save(model, processor, head, opt, state, gen, cfg)
        bar.close()
        state["stage"] += 1
        state["step"] = 0
        opt_state = None
    save(model, processor, head, None, state, gen, cfg)
    return state


def warm_start(model, head: DenseHead, init: str) -> int:
    """Load the weights of another run (its --state file, or a checkpoint folder such as the shipped
    model, whose dense head starts fresh) and return the first training item not used by that run."""
    if os.path.isdir(init):
        # The folder's keys are the saved (hub) layout; the model class maps them on load.
        loaded = type(model).from_pretrained(init)
        model.load_state_dict(loaded.state_dict())
        with open(os.path.join(init, "training_log.json")) as f:
            return json.load(f)["progress"]["item"]
    saved = torch.load(init, weights_only=True)
    model.load_state_dict(saved["model"])
    head.load_state_dict(saved["head"])
    return saved["progress"]["item"]  # fresh training items, never repeats of that run's


def save(model, processor, head, opt, state: dict, gen: torch.Generator, cfg: VLMTrainConfig) -> None:
    """Checkpoint folder (usable at any time) + resumable training state."""
    os.makedirs(cfg.out, exist_ok=True)
    lm = model.model.language_model
    trained_with = lm.config._attn_implementation
    lm.set_attn_implementation("sdpa")
    model.save_pretrained(cfg.out, safe_serialization=True)
    lm.set_attn_implementation(trained_with)
    processor.save_pretrained(cfg.out)
    os.makedirs(os.path.dirname(cfg.state) or ".", exist_ok=True)
    progress = dict(state, gen_state=gen.get_state())
    torch.save({"model": model.state_dict(), "head": head.state_dict(),
                "optimizer": opt.state_dict() if opt is not None else None,
                "progress": progress, "torch_rng": torch.get_rng_state()}, cfg.state + ".tmp")
    os.replace(cfg.state + ".tmp", cfg.state)
    cfg_dict = {k: v for k, v in asdict(cfg).items() if k != "log"}
    with open(os.path.join(cfg.out, "training_log.json"), "w") as f:
        json.dump({"config": cfg_dict, "progress": {k: v for k, v in state.items() if k != "log"}, "log": state["log"]}, f, indent=1)


# ------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = VLMTrainConfig()
    parser.add_argument("--out", default=d.out, help="checkpoint folder (default: %(default)s)")
    parser.add_argument("--state", default=d.state, help="resumable training state file (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--steps", default=",".join(map(str, d.steps)), help="steps per stage vision,language,joint")
    parser.add_argument("--images", default=",".join(map(str, d.images_per_step)), help="images per step, per stage")
    parser.add_argument("--val-items", type=int, default=d.val_items)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--resume", action="store_true", help="continue from --state")
    parser.add_argument("--init", default=None,
                        help="start from the weights of another run's state file or checkpoint folder (not its progress)")
    parser.add_argument("--lr", default=",".join(map(str, d.lr)), help="peak learning rate per stage vision,language,joint")
    parser.add_argument("--letter-tiles", type=int, default=d.letter_tiles,
                        help="letter-centred 4x4-cell tiles added to each step's dense loss (default: %(default)s)")
    parser.add_argument("--count-heads", default=",".join(f"{l}.{h}:{s:g}" for l, h, s in d.count_heads),
                        help="attention heads supervised to count, LAYER.HEAD:SINK,... (default: %(default)s)")
    parser.add_argument("--count-balance", type=float, default=d.count_balance, metavar="CAP",
                        help="reweight count answers to a uniform 0-9 prior, each weight at most CAP (0 = off; default: %(default)s)")
    parser.add_argument("--vision-crop", type=int, default=d.vision_crop, help="vision-stage crop in cells (0 = whole images)")


def parse_count_heads(text: str) -> tuple[tuple[int, int, float], ...]:
    """'2.1:5,2.2:1.5' -> ((2, 1, 5.0), (2, 2, 1.5)): LAYER.HEAD:SINK per supervised count head."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            where, sink = part.split(":")
            layer, head = where.split(".")
            out.append((int(layer), int(head), float(sink)))
        except ValueError:
            raise SystemExit(f"--count-heads wants LAYER.HEAD:SINK items like 2.1:5, got {part!r}")
    return tuple(out)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    steps = tuple(int(s) for s in args.steps.split(","))
    if len(steps) != 3:
        raise SystemExit("--steps needs three numbers: vision,language,joint")
    images = tuple(int(s) for s in args.images.split(","))
    lr = tuple(float(s) for s in args.lr.split(","))
    if len(images) != 3 or len(lr) != 3:
        raise SystemExit("--images and --lr need three numbers each: vision,language,joint")
    cfg = VLMTrainConfig(out=args.out, state=args.state, seed=args.seed, steps=steps, images_per_step=images,
                         val_items=args.val_items, init=args.init, vision_crop=args.vision_crop, lr=lr,
                         letter_tiles=args.letter_tiles, count_heads=parse_count_heads(args.count_heads),
                         count_balance=args.count_balance,
                         eval_every=args.eval_every, save_every=min(args.eval_every, VLMTrainConfig.save_every))
    train(cfg, resume=args.resume)
    return 0
