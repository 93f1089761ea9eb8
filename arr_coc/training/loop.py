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
One process, or data-parallel over several under `accelerate launch --multi_gpu` / `torchrun`
(`distributed.py`: each process scores its share of one global batch, gradients are summed,
only rank 0 validates and writes; feature extraction is shared out the same way).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from ..core.attending import calibrate_spread, relevant_cells
from ..core.config import SPREAD_SOURCES, ARRCOCConfig
from ..data import read_jsonl
from ..core.extent import ExtentHead, fit_extent_head
from ..core.layer import ARRCOCLayer
from ..core.persistence import LayerCard
from .config import VAL_BUDGETS, TrainConfig
from ..distributed import Processes
from .features import Features, load_features
from .losses import answer_loss, batch_scores, coverage, health, ranking_loss
from ..schedule import lr_at
from .widen import widen_texture

if TYPE_CHECKING:
    from ..front import ARRCOC
    from ..runtime import Runtime

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    """What one stage's run holds while it trains: the models, the data, the optimiser and the loop's state."""

    cfg: TrainConfig
    procs: Processes
    vlm: ARRCOC
    layer: ARRCOCLayer
    opt: torch.optim.Optimizer
    train_set: list[Features]
    val_set: list[Features]
    state: dict
    state_path: str
    card: LayerCard
    params: list[torch.nn.Parameter] = field(default_factory=list)
    t_start: float = 0.0


def train(cfg: TrainConfig, model_path: str, data: str | list[str], init: str | None = None, resume: bool = False,
          progress: bool = True, vlm: ARRCOC | None = None, stop_after: int | None = None,
          feature_cache: str | None = None, runtime: Runtime | None = None, processes: Processes | None = None) -> dict:
    """Run (or resume) one stage; `stop_after` ends this process early at that step (resumable).

    `data` is one JSONL or several; the first `val_fraction` of each file is held out for validation.
    `feature_cache`: a folder where the frozen VLM's features are kept between runs (see `load_features`).
    `runtime`: where the VLM is loaded (device, dtype, attention); None: this process's device under a
    launcher, else the CPU in float32. The layer trains in float32 on the VLM's device.
    `processes`: this process among several (`distributed.Processes`); None: `Processes.start()`, one
    plain process unless launched by torchrun / accelerate. With several, `cfg.batch_size` is per
    process, and only rank 0 validates and writes checkpoints and logs (its returned state is the full one).
    """
    from tqdm import tqdm

    if init and cfg.attn_dim is not None:  # before minutes of feature extraction
        raise ValueError(f"attn_dim sets the width of a fresh layer; {init} already has its own (drop --attn-dim)")
    procs = processes or Processes.start()
    progress = progress and procs.is_main
    feature_cache = _shared_feature_cache(cfg, procs, feature_cache)
    torch.manual_seed(cfg.seed)
    vlm = _load_vlm(cfg, model_path, vlm, runtime, procs)
    train_set, val_set = _load_data(cfg, vlm, data, feature_cache, progress, procs)
    layer = _build_layer(cfg, vlm, init)
    run = _start_run(cfg, procs, vlm, layer, train_set, val_set, layer_card(cfg, model_path, data, init), resume)
    bar = tqdm(total=cfg.steps, initial=run.state["step"], desc=f"train stage {cfg.stage}", disable=not progress,
               dynamic_ncols=True)
    while run.state["step"] < min(cfg.steps, stop_after or cfg.steps):
        _log_step(run, _train_step(run), bar)
    bar.close()
    if procs.is_main:
        _finish(run, progress)
    procs.barrier()  # the checkpoint is on disk before any process returns
    return run.state


def _shared_feature_cache(cfg: TrainConfig, procs: Processes, feature_cache: str | None) -> str | None:
    """The feature cache folder: several processes share their features through one, by default in `cfg.out`."""
    if procs.world > 1 and not feature_cache:
        feature_cache = os.path.join(cfg.out, "feature_cache")
        if procs.is_main:
            logger.warning("%d processes share their features through files: caching them in %s "
                           "(--feature-cache chooses the folder)", procs.world, feature_cache)
    return feature_cache


def _load_vlm(cfg: TrainConfig, model_path: str, vlm: ARRCOC | None, runtime: Runtime | None,
              procs: Processes) -> ARRCOC:
    """The frozen VLM behind the front door (loaded unless given), refused in one line when its backend cannot train
    through it (`TrainsThrough`: before any feature is read), and for stage 2 if its attention cannot take a soft
    mask."""
    from ..front import ARRCOC
    from ..pipeline.backend import TrainsThrough, require
    from ..runtime import Runtime

    if vlm is None:
        run = runtime or Runtime.resolve(procs.device or "cpu")
        vlm = ARRCOC.from_pretrained(model_path, device=run.device, dtype=run.dtype,
                                     attn_implementation=run.attn_implementation)
    if cfg.stage == 2 and vlm.runtime.attn_implementation == "flash_attention_2":
        raise ValueError("stage 2 masks visual tokens softly with an additive attention bias, which flash_attention_2 "
                         "cannot apply: train stage 2 with --attn-implementation sdpa (the default) or eager")
    require(vlm.backend, TrainsThrough, "train the layer through the frozen VLM (train)")   # MissingCapability
    return vlm


def _load_data(cfg: TrainConfig, vlm: ARRCOC, data: str | list[str], feature_cache: str | None,
               progress: bool, procs: Processes) -> tuple[list[Features], list[Features]]:
    """The training and validation items' features, the first `val_fraction` of each file held out."""
    train_set, val_set = [], []
    for path in [data] if isinstance(data, str) else data:
        records = list(read_jsonl(path))
        if not records:
            raise ValueError(f"{path} holds no records")
        n_val = max(1, int(len(records) * cfg.val_fraction))
        feats = load_features(vlm, path, records, feature_cache, progress=progress, gist=cfg.gist,
                              processes=procs)
        if not cfg.reads_tokens:  # encode="before" without a gist: the layer sees no visual token, the LM all of them
            for f in feats:
                f.lm_tokens, f.visual_tokens = f.visual_tokens, None
        train_set, val_set = train_set + feats[n_val:], val_set + feats[:n_val]
    if cfg.stage == 1 and not any(f.target.any() for f in train_set):
        raise ValueError("stage 1 needs boxes in the JSONL records (the answer's pixel boxes); none were found")
    if len(train_set) < procs.world:
        raise ValueError(f"{len(train_set)} training items cannot be shared by {procs.world} processes; "
                         "use more data or fewer processes")
    return train_set, val_set


def _build_layer(cfg: TrainConfig, vlm: ARRCOC, init: str | None) -> ARRCOCLayer:
    """The layer to train, from `init` or fresh, strict, in training mode on the VLM's device."""
    if init:
        layer = ARRCOCLayer.from_pretrained(init)
        if cfg.add_texture:  # new channels with zero weights: it starts scoring exactly as `init` does
            layer = widen_texture(layer, cfg.add_texture)
    else:
        config = ARRCOCConfig(strict=True).with_query_dim(vlm.backend.text_hidden_size)
        if cfg.attn_dim:
            config = config.replace(knowing={"attn_dim": cfg.attn_dim})
        if cfg.add_texture:
            config = config.replace(texture={"groups": config.texture.groups + cfg.add_texture})
        layer = ARRCOCLayer(config)
    layer.config.strict = True  # training must see errors, not silently keep all tokens
    layer.to(vlm.device)  # float32, beside the VLM (a no-op on the CPU)
    layer.train()
    return layer


def _start_run(cfg: TrainConfig, procs: Processes, vlm: ARRCOC, layer: ARRCOCLayer,
               train_set: list[Features], val_set: list[Features], card: LayerCard, resume: bool) -> _Run:
    """The optimiser and the loop's state, fresh or resumed from the stage's state file, alike in every process."""
    run = _Run(cfg=cfg, procs=procs, vlm=vlm, layer=layer,
               opt=torch.optim.AdamW(layer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay),
               train_set=train_set, val_set=val_set, state={"step": 0, "log": [], "warnings": []},
               state_path=os.path.join(cfg.out, f"train_state_stage{cfg.stage}.pt"), card=card)
    if procs.agree(resume and os.path.isfile(run.state_path)):
        saved = torch.load(run.state_path, weights_only=True, map_location="cpu")
        layer.load_state_dict(saved["layer"])
        run.opt.load_state_dict(saved["optimizer"])
        run.state = saved["state"]
        torch.set_rng_state(saved["rng"])
        if run.state.get("processes", 1) != procs.world and procs.is_main:
            logger.warning("resuming a run of %d process(es) with %d: the global batch changes from here on",
                           run.state.get("processes", 1), procs.world)
    procs.broadcast_module(layer)  # every process starts from rank 0's weights
    run.state.update(train_items=len(train_set), val_items=len(val_set))
    if procs.world > 1:
        run.state.update(processes=procs.world)
    run.params = list(layer.parameters())
    run.t_start = time.perf_counter()
    return run


def _train_step(run: _Run) -> dict:
    """One optimiser step on the global batch (this process scoring its share); returns the step's log record."""
    cfg, procs, state = run.cfg, run.procs, run.state
    step = state["step"]
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # per step: resuming replays exactly
    lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup)
    for g in run.opt.param_groups:
        g["lr"] = lr
    # The global batch, drawn alike in every process; this process scores its share of it.
    pick = torch.randint(len(run.train_set), (min(cfg.batch_size * procs.world, len(run.train_set)),),
                         generator=gen).tolist()
    batch = [run.train_set[i] for i in pick]
    items = batch[procs.share(len(batch))]
    boxed, boxed_all = sum(bool(f.target.any()) for f in items), sum(bool(f.target.any()) for f in batch)
    maps = batch_scores(run.layer, items)
    rec = {"step": step + 1, "lr": lr}
    if cfg.stage == 1:
        loss = procs.weigh(ranking_loss(maps["relevance"], maps["valid"], maps["target"], cfg.tau),
                           boxed, boxed_all)
        logged = procs.sum_values({"loss": float(loss.detach())})  # contributions -> the global batch's
    else:
        loss, logged = _stage2_loss(run, items, batch, maps, (boxed, boxed_all), gen, rec)
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    procs.sum_gradients(run.params)  # every process now holds the global batch's gradient
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip))
    run.opt.step()
    state["step"] += 1
    rec.update(loss=logged["loss"], grad_norm=grad_norm, seconds=time.perf_counter() - run.t_start)
    for w in health(maps, [f.grid_hw for f in items], grad_norm):  # this process's share of the batch
        if procs.is_main:
            logger.warning("step %d: %s", step + 1, w)
        state["warnings"].append({"step": step + 1, "warning": w})
    return rec


def _stage2_loss(run: _Run, items: list[Features], batch: list[Features], maps: dict, boxed: tuple[int, int],
                 gen: torch.Generator, rec: dict) -> tuple[torch.Tensor, dict]:
    """Stage 2's loss on this process's share (answer + budget penalty [+ ranking]); fills `rec`'s stage-2 keys."""
    cfg, procs, step = run.cfg, run.procs, run.state["step"]
    budget = cfg.budgets[int(torch.randint(len(cfg.budgets), (1,), generator=gen))]
    t0, t1 = cfg.mask_temperature
    temperature = t0 * (t1 / t0) ** (step / max(1, cfg.steps - 1))
    ans, penalty, share = answer_loss(run.vlm, items, maps["relevance"], budget, temperature)
    ans, penalty = procs.weigh(ans, len(items), len(batch)), procs.weigh(penalty, len(items), len(batch))
    loss = ans + cfg.budget_weight * penalty
    if cfg.rank_weight:
        rank = procs.weigh(ranking_loss(maps["relevance"], maps["valid"], maps["target"], cfg.tau), *boxed)
        loss = loss + cfg.rank_weight * rank
    logged = procs.sum_values({"loss": float(loss.detach()), "answer_loss": float(ans.detach()),
                               "soft_kept_share": procs.weigh(share, len(items), len(batch)),
                               **({"ranking_loss": float(rank.detach())} if cfg.rank_weight else {})})
    if cfg.rank_weight:
        rec.update(ranking_loss=logged["ranking_loss"])
    rec.update(budget=budget, temperature=temperature, soft_kept_share=logged["soft_kept_share"],
               answer_loss=logged["answer_loss"])
    return loss, logged


def _log_step(run: _Run, rec: dict, bar) -> None:
    """After a step: validate and checkpoint when due (rank 0), log the step's record, move the progress bar."""
    cfg, state = run.cfg, run.state
    if (state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps) and run.procs.is_main:
        rec["val_coverage"] = validate(run.layer, run.val_set)
        bar.write(f"[stage {cfg.stage} step {state['step']}] loss {rec['loss']:.3f} val coverage "
                  + " ".join(f"{b}:{c:.3f}" for b, c in rec["val_coverage"].items()))
        save(run.layer, run.opt, state, cfg, run.state_path, run.card)
    state["log"].append(rec)
    bar.set_postfix(loss=f"{rec['loss']:.3f}")
    bar.update(1)


def _finish(run: _Run, progress: bool) -> None:
    """End of the run on rank 0: fit the budget spread once the stage is complete, and save."""
    from tqdm import tqdm

    cfg, state = run.cfg, run.state
    if state["step"] >= cfg.steps:
        state["budget_spread"] = calibrate_budget_spread(run.layer, run.train_set, cfg.spread_tau, cfg.budget_follows,
                                                         cfg.spread_bounds, cfg.spread_per_cell)
        if progress and cfg.spread_tau > 0:
            tqdm.write("budget follows the question: cells by {source} (median {median_cells:.1f}) / reference "
                       "{reference:.2f}, clipped to [{low}, {high}], at most {per_cell} tokens per cell"
                       .format(**state["budget_spread"]))
    save(run.layer, run.opt, state, cfg, run.state_path, run.card)


@torch.no_grad()
def calibrate_budget_spread(layer: ARRCOCLayer, items: list[Features], tau: float, source: str = "perplexity",
                            bounds: tuple[float, float] | None = None, per_cell: float | None = None) -> dict:
    """Let the trained layer's budgets follow the question: scale = relevant cells / reference, averaging 1.

    The relevant cells are the relevance map's perplexity at `tau` (source "perplexity") or, with
    source "extent", the prediction of an `ExtentHead` fitted here to the items' answer cells.
    The reference is set on `items` (the stage's training items) so that the scale, clipped to
    `bounds` (default: the layer's [spread_min, spread_max]), averages 1 there: over data like them
    the tokens kept average at most the budget (the cap of `per_cell` tokens per needed cell, default
    the layer's, only lowers counts). tau 0 turns the scaling off (exact budgets). Returns what was
    set, for the training log.
    """
    attending = layer.config.attending
    attending.spread_tau = tau
    if tau <= 0:
        return {"tau": 0.0}
    if source not in SPREAD_SOURCES:
        raise ValueError(f"budgets follow 'perplexity' or 'extent', got {source!r}")
    if bounds is not None:
        attending.spread_min, attending.spread_max = bounds
    if per_cell is not None:
        attending.spread_per_cell = per_cell
    attending.__post_init__()  # the config's own checks of what was set
    was = layer.training
    layer.eval()
    cells, features, answer_cells = [], [], []
    head = ExtentHead(layer.config.knowing.query_dim) if source == "extent" else None
    for s in range(0, len(items), 32):
        chunk = items[s : s + 32]
        maps = batch_scores(layer, chunk)
        rel, valid = maps["relevance"].cpu(), maps["valid"].cpu()
        if head is not None:  # the head's own features, image by image (each question unpadded)
            features += [head.features(rel[i : i + 1], valid[i : i + 1], f.query[None], None) for i, f in enumerate(chunk)]
            answer_cells += [float((f.target > 0).sum()) for f in chunk]
        else:
            cells += [relevant_cells(rel[i, : f.grid_hw[0], : f.grid_hw[1]], tau) for i, f in enumerate(chunk)]
    layer.train(was)
    out = {"tau": tau, "source": source}
    if head is not None:
        x = torch.cat(features)
        out["extent_r2"] = fit_extent_head(head, x, torch.tensor(answer_cells))
        cells = head.predict(x).tolist()
        layer.extent = head.to(next(layer.parameters()).device)
    else:
        layer.extent = None
    attending.spread_source = source
    attending.spread_reference = calibrate_spread(cells, attending.spread_min, attending.spread_max)
    return {**out, "reference": attending.spread_reference, "median_cells": sorted(cells)[len(cells) // 2],
            "low": attending.spread_min, "high": attending.spread_max, "per_cell": attending.spread_per_cell,
            "items": len(cells)}


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


def layer_card(cfg: TrainConfig, model_path: str, data: str | list[str], init: str | None) -> LayerCard:
    """What the saved layer's README says of this run (its results are added at each save)."""
    return LayerCard(vlm=str(model_path), encode=cfg.encode, data=[str(d) for d in ([data] if isinstance(data, str)
                                                                                     else data)],
                     training=f"`python -m arr_coc train` stage {cfg.stage}, {cfg.steps} steps of {cfg.batch_size} "
                              f"items, lr {cfg.lr:g}, seed {cfg.seed}" + (f", from {init}" if init else "")
                              + (f", gist {cfg.gist:g}" if cfg.gist else "")
                              + (f", texture + {', '.join(cfg.add_texture)}" if cfg.add_texture else ""))


def save(layer: ARRCOCLayer, opt: torch.optim.Optimizer, state: dict, cfg: TrainConfig, state_path: str,
         card: LayerCard | None = None) -> None:
    layer = getattr(layer, "module", layer)
    strict = layer.config.strict
    layer.config.strict = False  # the shipped layer degrades gracefully
    if card is not None:
        last = next((r["val_coverage"] for r in reversed(state.get("log", [])) if "val_coverage" in r), None)
        card.results = [] if last is None else [
            f"- validation coverage of the answer's cells at step {state['step']} (share of them kept by top-k at each "
            "budget): " + ", ".join(f"{b}: {c:.3f}" for b, c in last.items())]
    layer.save_pretrained(cfg.out, card)
    layer.config.strict = strict
    torch.save({"layer": layer.state_dict(), "optimizer": opt.state_dict(), "state": state,
                "rng": torch.get_rng_state()}, state_path + ".tmp")
    os.replace(state_path + ".tmp", state_path)
    with open(os.path.join(cfg.out, f"training_log_stage{cfg.stage}.json"), "w") as f:
        json.dump({"config": asdict(cfg), **state}, f, indent=1)
