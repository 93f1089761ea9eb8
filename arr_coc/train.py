"""Train ARR-COC's scorers against a frozen VLM: learn continuous scores, let top-k select.

    python -m arr_coc train --model checkpoints/shapes-qwen2vl --data data/train/train.jsonl \
        --stage 1 --out checkpoints/arr-coc-shapes
    python -m arr_coc train ... --stage 2 --init checkpoints/arr-coc-shapes --out checkpoints/arr-coc-shapes

Stage 1, relevance supervision: the JSONL boxes rasterised onto the merged-token grid
are the target, each box spreading a weight of 1 over its cells by the share of its area
in each (`boxes_to_cell_shares`: an object's centre cell, the token that carries most of
it, outranks its edge cells, and every counted instance weighs the same); the loss is a
listwise ranking loss on the continuous relevance map (softmax over the image's cells,
cross-entropy against those shares), never on the discrete selection. The VLM only
supplies fixed features (visual tokens, question embeddings), computed once per item and
cached.

Stage 2, end-to-end: the frozen VLM reads the WHOLE prompt, and each visual token j is
softly masked out of attention with an additive bias log m_j, m_j = sigmoid((r_j - t) / T),
t the midpoint between the k-th and (k+1)-th largest relevance for a budget of k tokens.
As T -> 0 this is exactly the pruned forward (masking a token out of attention at its
original position equals dropping it: tests/test_model.py proves that equivalence), and
for T > 0 the answer's cross-entropy has a true gradient into every token's relevance.
Chosen over straight-through top-k (biased, its forward is blind to near-threshold tokens)
and REINFORCE (unbiased but needs many samples per item, too slow on a 2-core CPU).

At the end of a stage the layer's budgets are made to follow the question
(`calibrate_budget_spread`): an image keeps its budget times the number of cells its
relevance points at (the perplexity of softmax(relevance / 0.02)) over a reference set on
the training items so that the factor averages 1, clipped to [0.6, 2], and raised to at
most 2 tokens per relevant cell. A budget is then at most the mean over questions like the
training ones: "How many stars?" over eight stars gets up to twice the tokens, "What color
is the cross?" down to 0.6 times.

Both stages: AdamW, warm-up + cosine, gradient clipping at 1.0, seeded, tqdm, periodic
validation of answer-cell coverage at fixed budgets, health checks (collapsed scores,
exploding gradients, allocations collapsing to one region), a JSON log, resumable.
Runs as one process here; under `accelerate launch` (if accelerate is installed) it
wraps the layer and optimiser with `Accelerator`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F

from .attending import calibrate_spread, relevant_cells
from .budget import resolve_count
from .config import ARRCOCConfig
from .data import boxes_to_cell_shares, read_jsonl
from .layer import ARRCOCLayer

logger = logging.getLogger(__name__)
VAL_BUDGETS = (0.05, 0.1, 0.25)


@dataclass
class TrainConfig:
    stage: int = 1
    out: str = "checkpoints/arr-coc-shapes"
    seed: int = 0
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3               # stage 2 uses --lr 1e-3 (the answer's gradient is small and noisy)
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    tau: float = 0.05              # stage 1: softmax temperature over relevance (relevance units)
    mask_temperature: tuple[float, float] = (0.5, 0.1)  # stage 2: soft-mask T (in relevance std units), start -> end
    budget_weight: float = 1.0     # stage 2: (soft kept share - budget share)^2 penalty
    budgets: tuple[float, ...] = (0.05, 0.1, 0.25)  # stage 2: budget drawn per step
    rank_weight: float = 0.0       # stage 2: + this x stage 1's ranking loss (keeps the answer's cells covered)
    attn_dim: int | None = None    # participatory width of a fresh layer (None: the config's default); not with `init`
    spread_tau: float = 0.02       # saved layer: budget scaled by the relevant cells at this softmax T (0: exact)
    val_fraction: float = 0.1
    eval_every: int = 50


# ---------------------------------------------------------------- features
@dataclass
class Features:
    """Fixed per-item inputs of the layer, from the frozen VLM (cached)."""

    image: torch.Tensor          # [3, H, W] uint8: the resized image the VLM saw (a quarter of float32's memory:
                                 # 6,000 large-canvas items as float32 overflowed 24 GiB during stage 2)
    grid_hw: tuple[int, int]
    visual_tokens: torch.Tensor  # [h * w, D]
    query: torch.Tensor          # [L, D]
    target: torch.Tensor         # [h * w] float: share of the answer's boxes in each cell (each box sums to 1)
    answer: str
    question: str
    image_path: str
    input_ids: torch.Tensor      # [1, S] the unpruned prompt (stage 2 appends the answer)
    image_grid_thw: torch.Tensor  # [1, 3]


@torch.no_grad()
def extract_features(wrapper, records, progress: bool = True) -> list[Features]:
    """Vision tower + question embeddings per record through the wrapper's own path."""
    from PIL import Image
    from tqdm import tqdm

    feats: list[Features] = []
    captured: list = []

    def capture(ctx):
        captured.append(ctx)
        return [torch.arange(h * w) for h, w in ctx.grid_hw]

    for rec in tqdm(records, desc="features", disable=not progress, dynamic_ncols=True):
        image = Image.open(rec.image).convert("RGB")
        captured.clear()
        inputs = wrapper.build_inputs([[image]], [rec.question])
        wrapper.prepare(inputs, method=capture)
        ctx = captured[0]
        h, w = ctx.grid_hw[0]
        target = answer_target(rec.boxes, image.size, tuple(ctx.images[0].shape[-2:]), (h, w))
        pixels = (ctx.images[0].float().clamp(0, 1) * 255).round().to(torch.uint8)
        feats.append(Features(pixels, (h, w), ctx.visual_tokens[0].float(), ctx.query_embeds[0].float(),
                              target, rec.answers[0], rec.question, str(rec.image),
                              inputs["input_ids"], inputs["image_grid_thw"]))
    return feats


def answer_target(boxes, original_wh: tuple[int, int], image_hw: tuple[int, int], grid_hw: tuple[int, int]):
    """[h * w] float: the answer's boxes (original pixels) as cell shares on the grid of the resized image."""
    (w0, h0), (hs, ws), (h, w) = original_wh, image_hw, grid_hw
    sx, sy = ws / w0, hs / h0  # the processor may have resized the image
    scaled = [[b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy] for b in (boxes or [])]
    return torch.from_numpy(boxes_to_cell_shares(scaled, (ws, hs), ws // w)).reshape(-1).float()


def features_key(wrapper, path: str, records) -> str:
    """Content hash of everything a record's features depend on: VLM weights, processor, JSONL, images.

    Hashing the weights takes about 0.8 s per GiB on this 2-core CPU (some 4 s for a 2B model in
    bf16), minutes less than re-extracting.
    """
    from .qwen.processing import image_processor_of

    h = hashlib.sha256()
    for name, tensor in sorted(wrapper.model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy())
    processor = wrapper.processor
    h.update(image_processor_of(processor).to_json_string().encode())
    h.update(str(getattr(processor, "chat_template", "")).encode())
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    with open(path, "rb") as f:
        h.update(f.read())
    for rec in records:
        with open(rec.image, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:20]


def load_features(wrapper, path: str, records, cache: str | None, progress: bool = True) -> list[Features]:
    """`extract_features`, or its copy in the `cache` folder if the same VLM already read the same data."""
    if not cache:
        return extract_features(wrapper, records, progress=progress)
    stem = os.path.splitext(os.path.basename(path))[0]
    file = os.path.join(cache, f"{stem}-{len(records)}-{features_key(wrapper, path, records)}.pt")
    if os.path.isfile(file):
        from PIL import Image

        logger.info("features of %s from %s", path, file)
        feats = [Features(**d) for d in torch.load(file, weights_only=True)]
        # The VLM's features are the cache's business, the targets the code's: they are cheap to
        # recompute, and a cache written before their definition changed must not train the old one.
        for rec, f in zip(records, feats):
            with Image.open(rec.image) as image:  # reads the header only
                f.target = answer_target(rec.boxes, image.size, tuple(f.image.shape[-2:]), f.grid_hw)
        return feats
    feats = extract_features(wrapper, records, progress=progress)
    os.makedirs(cache, exist_ok=True)
    torch.save([{k.name: getattr(f, k.name) for k in fields(Features)} for f in feats], file + ".tmp")
    os.replace(file + ".tmp", file)
    return feats


def batch_scores(layer: ARRCOCLayer, items: list[Features]) -> dict[str, torch.Tensor]:
    """The layer's differentiable maps for a list of items (padded batch); adds 'valid' and 'target'."""
    from .layer import _pad_grid, _pad_tokens

    grids = [f.grid_hw for f in items]
    hm, wm = max(h for h, _ in grids), max(w for _, w in grids)
    tex = _pad_grid(layer.textures([f.image.float() / 255 for f in items], grids), hm, wm)
    valid = _pad_grid([torch.ones(h, w, dtype=torch.bool) for h, w in grids], hm, wm)
    query, qmask = _pad_tokens([f.query for f in items])
    vis = _pad_grid([f.visual_tokens.T.reshape(-1, h, w) for f, (h, w) in zip(items, grids)], hm, wm)
    maps = layer.score(tex, valid, query, qmask, vis.flatten(2).transpose(1, 2))
    maps["valid"] = valid
    maps["target"] = _pad_grid([f.target.reshape(h, w) for f, (h, w) in zip(items, grids)], hm, wm)
    return maps


def ranking_loss(relevance: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, tau: float) -> torch.Tensor:
    """Listwise: cross-entropy of softmax(relevance / tau) over the image's cells against the target shares.

    relevance, valid, target: [B, h, w] (target: weights >= 0, normalised per item here). Items
    without answer cells are skipped.
    """
    logits = (relevance / tau).masked_fill(~valid, -1e4).flatten(1)
    logp = torch.log_softmax(logits, dim=-1)
    t = target.flatten(1).float()
    has = t.sum(1) > 0
    if not has.any():
        return relevance.sum() * 0.0
    per_item = -(logp * t).sum(1) / t.sum(1).clamp_min(1)
    return per_item[has].mean()


def coverage(relevance: torch.Tensor, valid: torch.Tensor, target: torch.Tensor, grids, budget: float) -> float:
    """Mean share of the answer's target weight (its boxes' area) inside the top-k, over items with answer cells."""
    from .attending import topk_indices

    out = []
    for i, (h, w) in enumerate(grids):
        t = target[i, :h, :w].reshape(-1)
        if not t.any():
            continue
        kept = topk_indices(relevance[i, :h, :w].reshape(-1), resolve_count(budget, h * w))
        out.append(float(t[kept].float().sum() / t.float().sum()))
    return sum(out) / max(1, len(out))


# ---------------------------------------------------------------- stage 2
def soft_keep(relevance: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """relevance [N] -> m [N] in (0, 1): ~1 for the top k, ~0 below, differentiable.

    The sigmoid is taken on relevance standardised over the image, so the relaxation is
    scale-free: flattening every score (which would let all tokens through at m = 0.5)
    does not pay.
    """
    n = relevance.numel()
    if k >= n:
        return torch.ones_like(relevance)
    z = (relevance - relevance.mean()) / (relevance.std() + 1e-6)
    top = torch.topk(z.detach(), k + 1).values
    threshold = 0.5 * (top[k - 1] + top[k])
    return torch.sigmoid((z - threshold) / temperature)


def answer_loss(wrapper, items: list[Features], relevance: torch.Tensor, budget: float, temperature: float):
    """Cross-entropy of the answers with visual tokens softly masked by relevance.

    Returns (answer loss, budget penalty = mean (soft kept share - budget share)^2, soft kept share).
    """
    model = wrapper.model
    tok = wrapper.tokenizer
    losses, shares, kept_share = [], [], []
    for i, f in enumerate(items):
        ids = f.input_ids  # cached at extraction: no image decode or processor call per step
        answer_ids = tok(f.answer, add_special_tokens=False)["input_ids"] + [wrapper.im_end_id]
        full = torch.cat([ids, torch.tensor([answer_ids])], 1)
        mm = (full == wrapper.image_token_id).int()
        pos, _ = model.model.get_rope_index(full, mm, image_grid_thw=f.image_grid_thw)
        pos = pos[-3:]
        with torch.no_grad():
            embeds = model.get_input_embeddings()(full)
            embeds[full == wrapper.image_token_id] = f.visual_tokens.to(embeds.dtype)
        h, w = f.grid_hw
        m = soft_keep(relevance[i, :h, :w].reshape(-1), resolve_count(budget, h * w), temperature)
        s = full.shape[1]
        bias = torch.zeros(s)
        bias = bias.index_put((torch.nonzero(full[0] == wrapper.image_token_id)[:, 0],), torch.log(m.clamp_min(1e-6)))
        causal = torch.full((s, s), float("-inf")).triu(1)
        mask = (causal + bias[None, :]).to(embeds.dtype)[None, None]
        hidden = model.model.language_model(inputs_embeds=embeds, position_ids=pos, attention_mask=mask).last_hidden_state
        n_ans = len(answer_ids)
        logits = model.lm_head(hidden[0, -n_ans - 1 : -1])
        losses.append(F.cross_entropy(logits.float(), torch.tensor(answer_ids)))
        shares.append((m.mean() - resolve_count(budget, h * w) / (h * w)) ** 2)
        kept_share.append(float(m.detach().mean()))
    return torch.stack(losses).mean(), torch.stack(shares).mean(), sum(kept_share) / len(kept_share)


# ---------------------------------------------------------------- training loop
def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def health(maps: dict[str, torch.Tensor], grids, grad_norm: float) -> list[str]:
    """Warnings: collapsed scores, exploding gradients, allocations collapsing to one region."""
    warnings = []
    rel, valid = maps["relevance"], maps["valid"]
    std = float(rel[valid].detach().std()) if valid.sum() > 1 else 0.0
    if std < 1e-3:
        warnings.append(f"relevance collapsed (std {std:.2e})")
    if not math.isfinite(grad_norm) or grad_norm > 100:
        warnings.append(f"exploding gradient (norm {grad_norm:.1f})")
    spreads = []
    for i, (h, w) in enumerate(grids):
        k = resolve_count(0.1, h * w)
        idx = torch.topk(rel[i, :h, :w].reshape(-1).detach(), k).indices
        ys, xs = (idx // w).float() / max(1, h - 1), (idx % w).float() / max(1, w - 1)
        spreads.append(float(ys.std() + xs.std()) if k > 1 else 1.0)
    if spreads and sum(spreads) / len(spreads) < 0.05:
        warnings.append("allocations collapsed to one region (top-10% cells within ~5% of the image)")
    return warnings


def train(cfg: TrainConfig, model_path: str, data: str | list[str], init: str | None = None, resume: bool = False,
          progress: bool = True, wrapper=None, stop_after: int | None = None, feature_cache: str | None = None) -> dict:
    """Run (or resume) one stage; `stop_after` ends this process early at that step (resumable).

    `data` is one JSONL or several; the first `val_fraction` of each file is held out for validation.
    `feature_cache`: a folder where the frozen VLM's features are kept between runs (see `load_features`).
    """
    from tqdm import tqdm

    from .qwen import ARRCOCQwen

    if init and cfg.attn_dim is not None:  # before minutes of feature extraction
        raise ValueError(f"attn_dim sets the width of a fresh layer; {init} already has its own (drop --attn-dim)")
    torch.manual_seed(cfg.seed)
    wrapper = wrapper or ARRCOCQwen.from_pretrained(model_path)
    train_set, val_set = [], []
    for path in [data] if isinstance(data, str) else data:
        records = list(read_jsonl(path))
        if not records:
            raise ValueError(f"{path} holds no records")
        n_val = max(1, int(len(records) * cfg.val_fraction))
        feats = load_features(wrapper, path, records, feature_cache, progress=progress)
        train_set, val_set = train_set + feats[n_val:], val_set + feats[:n_val]
    if cfg.stage == 1 and not any(f.target.any() for f in train_set):
        raise ValueError("stage 1 needs boxes in the JSONL records (the answer's pixel boxes); none were found")

    if init:
        layer = ARRCOCLayer.from_pretrained(init)
    else:
        config = ARRCOCConfig(strict=True).with_query_dim(wrapper.text_hidden_size)
        layer = ARRCOCLayer(config.replace(knowing={"attn_dim": cfg.attn_dim}) if cfg.attn_dim else config)
    layer.config.strict = True  # training must see errors, not silently keep all tokens
    layer.train()
    opt = torch.optim.AdamW(layer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    state = {"step": 0, "log": [], "warnings": []}
    state_path = os.path.join(cfg.out, f"train_state_stage{cfg.stage}.pt")
    if resume and os.path.isfile(state_path):
        saved = torch.load(state_path, weights_only=True)
        layer.load_state_dict(saved["layer"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        torch.set_rng_state(saved["rng"])
    state.update(train_items=len(train_set), val_items=len(val_set))
    accelerator = _maybe_accelerator()
    if accelerator is not None:
        layer, opt = accelerator.prepare(layer, opt)
    t_start = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=state["step"], desc=f"train stage {cfg.stage}", disable=not progress,
               dynamic_ncols=True)
    while state["step"] < min(cfg.steps, stop_after or cfg.steps):
        step = state["step"]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # per step: resuming replays exactly
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        pick = torch.randint(len(train_set), (min(cfg.batch_size, len(train_set)),), generator=gen).tolist()
        items = [train_set[i] for i in pick]
        maps = batch_scores(layer, items)
        rec = {"step": step + 1, "lr": lr}
        if cfg.stage == 1:
            loss = ranking_loss(maps["relevance"], maps["valid"], maps["target"], cfg.tau)
        else:
            budget = cfg.budgets[int(torch.randint(len(cfg.budgets), (1,), generator=gen))]
            t0, t1 = cfg.mask_temperature
            temperature = t0 * (t1 / t0) ** (step / max(1, cfg.steps - 1))
            ans, penalty, share = answer_loss(wrapper, items, maps["relevance"], budget, temperature)
            loss = ans + cfg.budget_weight * penalty
            if cfg.rank_weight:
                rank = ranking_loss(maps["relevance"], maps["valid"], maps["target"], cfg.tau)
                loss = loss + cfg.rank_weight * rank
                rec.update(ranking_loss=float(rank.detach()))
            rec.update(budget=budget, temperature=temperature, soft_kept_share=share, answer_loss=float(ans.detach()))
        opt.zero_grad(set_to_none=True)
        (accelerator.backward(loss) if accelerator is not None else loss.backward())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(layer.parameters(), cfg.grad_clip))
        opt.step()
        state["step"] += 1
        loss_value = float(loss.detach())
        rec.update(loss=loss_value, grad_norm=grad_norm, seconds=time.perf_counter() - t_start)
        for w in health(maps, [f.grid_hw for f in items], grad_norm):
            logger.warning("step %d: %s", step + 1, w)
            state["warnings"].append({"step": step + 1, "warning": w})
        if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
            rec["val_coverage"] = validate(layer, val_set)
            bar.write(f"[stage {cfg.stage} step {state['step']}] loss {loss_value:.3f} val coverage "
                      + " ".join(f"{b}:{c:.3f}" for b, c in rec["val_coverage"].items()))
            save(layer, opt, state, cfg, state_path)
        state["log"].append(rec)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        bar.update(1)
    bar.close()
    if state["step"] >= cfg.steps:
        state["budget_spread"] = calibrate_budget_spread(getattr(layer, "module", layer), train_set, cfg.spread_tau)
        if progress and cfg.spread_tau > 0:
            tqdm.write("budget follows the question: relevant cells (median {median_cells:.1f}) / reference "
                       "{reference:.2f}, clipped to [{low}, {high}]".format(**state["budget_spread"]))
    save(layer, opt, state, cfg, state_path)
    return state


@torch.no_grad()
def calibrate_budget_spread(layer: ARRCOCLayer, items: list[Features], tau: float) -> dict:
    """Let the trained layer's budgets follow the question: scale = relevant cells / reference, averaging 1.

    The reference is set on `items` (the stage's training items) so that the scale averages 1
    there: over data like them the tokens kept average at most the budget (the per-cell cap
    only lowers counts). tau 0 turns the scaling off (exact budgets).
    Returns what was set, for the training log.
    """
    attending = layer.config.attending
    attending.spread_tau = tau
    if tau <= 0:
        return {"tau": 0.0}
    was = layer.training
    layer.eval()
    cells = []
    for s in range(0, len(items), 32):
        chunk = items[s : s + 32]
        maps = batch_scores(layer, chunk)
        for i, f in enumerate(chunk):
            h, w = f.grid_hw
            cells.append(relevant_cells(maps["relevance"][i, :h, :w], tau))
    layer.train(was)
    attending.spread_reference = calibrate_spread(cells, attending.spread_min, attending.spread_max)
    return {"tau": tau, "reference": attending.spread_reference, "median_cells": sorted(cells)[len(cells) // 2],
            "low": attending.spread_min, "high": attending.spread_max, "items": len(cells)}


@torch.no_grad()
def validate(layer: ARRCOCLayer, items: list[Features]) -> dict[str, float]:
    """Coverage of the answer cells by top-k of the relevance map at VAL_BUDGETS."""
    was = layer.training
    layer.eval()
    out = {str(b): [] for b in VAL_BUDGETS}
    for s in range(0, len(items), 32):
        chunk = items[s : s + 32]
        maps = batch_scores(layer, chunk)
        grids = [f.grid_hw for f in chunk]
        n = sum(1 for f in chunk if f.target.any())
        for b in VAL_BUDGETS:
            out[str(b)].append((coverage(maps["relevance"], maps["valid"], maps["target"], grids, b), n))
    layer.train(was)
    return {b: sum(c * n for c, n in v) / max(1, sum(n for _, n in v)) for b, v in out.items()}


def save(layer, opt, state: dict, cfg: TrainConfig, state_path: str) -> None:
    layer = getattr(layer, "module", layer)
    strict = layer.config.strict
    layer.config.strict = False  # the shipped layer degrades gracefully
    layer.save_pretrained(cfg.out)
    layer.config.strict = strict
    torch.save({"layer": layer.state_dict(), "optimizer": opt.state_dict(), "state": state,
                "rng": torch.get_rng_state()}, state_path + ".tmp")
    os.replace(state_path + ".tmp", state_path)
    with open(os.path.join(cfg.out, f"training_log_stage{cfg.stage}.json"), "w") as f:
        json.dump({"config": asdict(cfg), **state}, f, indent=1)


def _maybe_accelerator():
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return None
    try:
        from accelerate import Accelerator
    except ImportError:
        logger.warning("launched distributed but accelerate is not installed; running as one process")
        return None
    return Accelerator()


# ---------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .embedded import DEFAULT_CHECKPOINT
    from .eval import parse_budgets

    d = TrainConfig()
    parser.add_argument("--model", default=DEFAULT_CHECKPOINT, help="VLM folder or hub id (frozen)")
    parser.add_argument("--data", required=True, nargs="+",
                        help="JSONL file(s) with answers and boxes (e.g. from gen-data); 10%% of each is held out")
    parser.add_argument("--stage", type=int, choices=(1, 2), required=True)
    parser.add_argument("--out", default=d.out, help="folder for the trained layer (save_pretrained)")
    parser.add_argument("--init", default=None, help="start from this trained layer folder (e.g. stage 1 output)")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--eval-every", type=int, default=d.eval_every)
    parser.add_argument("--rank-weight", type=float, default=d.rank_weight,
                        help="stage 2: add this x the stage-1 ranking loss on the boxes (0 = answer loss only)")
    parser.add_argument("--budgets", type=lambda text: tuple(parse_budgets(text)), default=d.budgets,
                        help="stage 2: comma-separated budgets (shares or counts), one drawn per step "
                             "(default: 0.05,0.1,0.25)")
    parser.add_argument("--feature-cache", default=None, metavar="DIR",
                        help="keep the frozen VLM's features of each data file here and reuse them while the VLM, "
                             "processor, JSONL and images are unchanged (stage-2 variants then skip 2-9 min of "
                             "extraction; about 0.8 GB per 1,000 items of the embedded model at 448 px)")
    parser.add_argument("--attn-dim", type=int, default=None,
                        help="width of a fresh layer's participatory scorer (default: knowing.attn_dim, 32); "
                             "not with --init")
    parser.add_argument("--spread-tau", type=float, default=d.spread_tau,
                        help="the saved layer scales each image's budget by the cells its relevance points at "
                             "(perplexity of softmax(relevance / T)), calibrated on the training items to average "
                             "1 and raised to at most 2 tokens per such cell, so the tokens kept average at most the "
                             "budget; 0 keeps every image's budget exact (default: 0.02)")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None, help="stop at this step (continue later with --resume)")


def run(args: argparse.Namespace) -> int:
    cfg = TrainConfig(stage=args.stage, out=args.out, seed=args.seed, steps=args.steps, batch_size=args.batch_size,
                      lr=args.lr, eval_every=args.eval_every, rank_weight=args.rank_weight, budgets=args.budgets,
                      attn_dim=args.attn_dim, spread_tau=args.spread_tau)
    os.makedirs(cfg.out, exist_ok=True)
    train(cfg, args.model, args.data, init=args.init, resume=args.resume, stop_after=args.stop_after,
          feature_cache=args.feature_cache)
    return 0
