"""Train LoRA adapters (peft) so the frozen VLM reads what ARR-COC keeps: the design's stages 2 and 3.

    python -m arr_coc train-adapter --data data/gqa/train.jsonl --out runs/adapter   # stage "frozen": the layer fixed
    python -m arr_coc_shapes train-adapter --stage joint --init-adapter runs/adapter/adapter --out runs/joint

Every step reads JSONL records (`--data`, docs/DATA.md) or draws a test bed's items on the fly (an `ItemSource`:
the checkout's ShapesVQA, `python -m arr_coc_shapes train-adapter`; `adapter_items.py`), in a DataLoader whose
workers draw them, a budget per
item uniform in [2%, 10%], and prunes them **through the pipeline itself** (`pipeline.look.prepare`: the shipped
layer chooses, encode="before" by default). Then, with gradients:

- frozen (stage 2a): the tower encodes the chosen cells again with the adapter on (`pipeline.fovea.foveate`, the
  one foveal encoding) and the language model, adapter on, reads exactly the pruned prompt it answers from; the loss
  is the answer's cross-entropy there (`VLMBackend.pruned_answer_loss`). With --encode after the tower is the stock
  one (its single pass serves the selector too), so only the language model's adapter learns.
- joint (stage 2b): the same loss, plus the layer's existing differentiable relaxation (`training.losses.soft_keep`
  + `VLMBackend.soft_answer_loss`, stage 2 of `train`): every visual token of the adapted tower's full encoding stays
  in the prompt, weighted in attention by sigmoid((z - t) / T) of the layer's relevance, so the answer's loss
  reaches the layer's scorers and both adapters; + the budget penalty.
- --hard (stage 3): question types that lose most when pruned (`--hard-types`, default count,letter) are drawn
  `--hard-weight` times as often (and ShapesVQA's hard scenes as often again: arr_coc_shapes/adapter_items.py).

The VLM's own weights never move (tested bit for bit). AdamW, warm-up + cosine, gradient clipping, seeded, resumable
(`--resume`: the state file in --out), a tqdm bar, a JSON log, a loss plot and a model card. --out receives the pair:
the layer's files (saved only when the layer trained, or when --out holds none) and the adapter in adapter/
(`ARRCOC.from_pretrained(model, arr_coc=OUT, adapter=OUT)` loads both).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..paths import shown_path
from ..schedule import lr_at
from .adapter_items import ItemSource, JsonlItems

if TYPE_CHECKING:
    from ..front import ARRCOC
    from ..pipeline.backend import TrainableAdapter
    from ..runtime import Runtime

logger = logging.getLogger(__name__)
STAGES = ("frozen", "joint")
STATE_FILE = "train_state_adapter.pt"
LOG_FILE, PLOT_FILE = "training_log_adapter.json", "training_loss.png"
NO_ITEMS = ("no --data: give JSONL splits to train on (docs/DATA.md; `python -m arr_coc convert` writes them), or "
            "draw ShapesVQA items on the fly with `python -m arr_coc_shapes train-adapter` (the checkout's test bed)")


@dataclass
class AdapterTrainConfig:
    """One train-adapter run (saved into its log)."""

    out: str = "runs/arr-coc-adapter"
    stage: str = "frozen"                  # "frozen": the layer fixed; "joint": the layer trained too
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3                       # the adapter's peak learning rate (the sweep: docs/TRAINING.md)
    layer_lr: float = 1e-4                 # joint: the layer's
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = ("tower_attn", "tower_mlp", "lm_attn")
    budgets: tuple[float, float] = (0.02, 0.10)   # a budget per item, uniform in this range
    encode: str = "before"
    mask_temperature: tuple[float, float] = (0.5, 0.1)   # joint: the relaxation's T, start -> end
    budget_weight: float = 1.0             # joint: (soft kept share - budget share)^2
    seed: int = 0
    data_seed: int = 21                    # the item source's seed (ShapesVQA's test split, VLM and layer use others);
                                           # with `data`, the seed of its shuffle and of its validation hold-out
    data: tuple[str, ...] = ()             # JSONL splits (docs/DATA.md) to train on; (): an ItemSource draws them
    hard: bool = False                     # stage 3: oversample the hard question types and scenes
    hard_types: tuple[str, ...] = ("count", "letter")
    hard_weight: float = 2.0
    workers: int = 0                       # DataLoader workers drawing items (0: in this process)
    val_items: int = 32
    eval_every: int = 50

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"stage {self.stage!r}: choose frozen or joint")
        if self.encode not in ("before", "after"):
            raise ValueError(f"encode {self.encode!r}: choose before or after")
        low, high = (float(b) for b in self.budgets)
        if not 0 < low <= high < 1:
            raise ValueError(f"budgets {self.budgets}: need shares 0 < LOW <= HIGH < 1, e.g. 0.02,0.10")
        self.budgets, self.targets, self.hard_types = (low, high), tuple(self.targets), tuple(self.hard_types)
        self.data = tuple(self.data)
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps}: train at least one step (0 would write an untrained adapter)")
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(f"--rank {self.rank} --alpha {self.alpha:g}: the LoRA rank is a whole number >= 1 and "
                             "alpha > 0 (the defaults: 16 and 32)")
        for name, value, least in (("--batch-size", self.batch_size, 1), ("--val-items", self.val_items, 1),
                                   ("--eval-every", self.eval_every, 1), ("--workers", self.workers, 0)):
            if value < least:
                raise ValueError(f"{name} {value}: must be >= {least}")
        if self.hard_weight < 1:
            raise ValueError(f"--hard-weight {self.hard_weight:g}: must be >= 1")


def check_run(cfg: AdapterTrainConfig, resume: bool = False, items: ItemSource | None = None) -> list[str]:
    """What a run is refused for before any model loads (ValueError, one line naming the cause): no data (neither
    --data nor an item source), what the source cannot draw, a JSONL split that does not read or is too small to
    hold out --val-items and train on the rest, an --out that cannot be written. -> notes to print (--resume with
    no saved state: it starts fresh)."""
    from ..data import read_jsonl

    if not cfg.data:
        if items is None:
            raise ValueError(NO_ITEMS)
        items.check(cfg)
    else:
        n = sum(len(read_jsonl(p)) for p in cfg.data)        # a malformed line: JSONLFormatError, its own words
        if n == 0:
            raise ValueError(f"--data {', '.join(cfg.data)}: no records (an empty split); give a JSONL split with "
                             "records (docs/DATA.md)")
        if n <= cfg.val_items:
            raise ValueError(f"--data has {n} records and --val-items {cfg.val_items} holds out that many for "
                             f"validation, leaving none to train on; pass --val-items {max(1, n // 4)}")
    writable_folder(cfg.out)
    state = os.path.join(cfg.out, STATE_FILE)
    return [f"--resume: no saved state in {shown_path(state)}; starting fresh"] if resume and not os.path.isfile(state) \
        else []


def writable_folder(path: str, option: str = "--out") -> None:
    """Make `path` a folder and write into it once (ValueError, one line, when it cannot be)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"{option} {path}: cannot write there ({exc.strerror or type(exc).__name__}); "
                         "pass a folder you can write") from None


def _collate(batch: list) -> list:
    return batch


@dataclass
class _Run:
    cfg: AdapterTrainConfig
    vlm: ARRCOC
    adapter: TrainableAdapter
    params: list[torch.nn.Parameter]
    layer_params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    loader: Any
    val: list
    state: dict = field(default_factory=lambda: {"step": 0, "log": []})
    t_start: float = 0.0
    rng: torch.Tensor | None = None      # a resumed run's random state, set once its data loader has started


def train_adapter(cfg: AdapterTrainConfig, model_path: str, layer: str | None, init_adapter: str | None = None,
                  resume: bool = False, progress: bool = True, runtime: Runtime | None = None,
                  vlm: ARRCOC | None = None, stop_after: int | None = None, items: ItemSource | None = None) -> dict:
    """Run (or resume) one train-adapter stage (module docstring) -> its state (step, log). Without cfg.data the
    items are drawn from `items`."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    run = _start(cfg, model_path, layer, init_adapter, resume, runtime, vlm, items)
    bar = tqdm(total=cfg.steps, initial=run.state["step"], desc=f"train-adapter {cfg.stage}", disable=not progress,
               dynamic_ncols=True)
    batches = iter(run.loader)
    if run.rng is not None:              # after the loader's iterator drew its seed, as a straight run's had
        torch.set_rng_state(run.rng)
    run.adapter.dropout(True)
    while run.state["step"] < min(cfg.steps, stop_after or cfg.steps):
        rec = _step(run, next(batches))
        if run.state["step"] % cfg.eval_every == 0 or run.state["step"] == cfg.steps:
            rec["val_loss"] = validate(run.vlm, run.adapter, run.val, cfg)
            bar.write(f"[{cfg.stage} step {run.state['step']}] loss {rec['loss']:.3f} val {rec['val_loss']:.3f}")
            save(run, model_path, layer)
        run.state["log"].append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}")
        bar.update(1)
    bar.close()
    run.adapter.dropout(False)
    save(run, model_path, layer)
    return run.state


def _start(cfg: AdapterTrainConfig, model_path: str, layer: str | None, init_adapter: str | None, resume: bool,
           runtime: Runtime | None, vlm: ARRCOC | None, items: ItemSource | None) -> _Run:
    """The VLM (frozen) with a trainable adapter, the layer, the optimiser, the data; a saved state when resuming."""
    from ..front import ARRCOC
    from ..pipeline.backend import Adapts, TrainsAdapters, TrainsThrough, require
    from ..runtime import Runtime

    if vlm is None:
        run_on = runtime or Runtime.resolve("cpu")
        vlm = ARRCOC.from_pretrained(model_path, arr_coc=layer, device=run_on.device, dtype=run_on.dtype,
                                     attn_implementation=run_on.attn_implementation, adapter=False)
    for capability in (TrainsThrough, TrainsAdapters, Adapts):     # MissingCapability, one line, before any work
        require(vlm.backend, capability, "train adapters (train-adapter)")
    adapter = vlm.backend.train_adapter(init_adapter, cfg.rank, cfg.alpha, cfg.targets, cfg.dropout, cfg.seed)
    adapter.name = adapter.name or cfg.out
    vlm.backend.load_adapter(adapter)
    adapter.trainable = True
    params = [p.requires_grad_(True) for p in adapter.parameters()]
    groups = [{"params": params, "lr": cfg.lr, "base": cfg.lr}]
    layer_params: list[torch.nn.Parameter] = []
    net = vlm.layer
    net.config.strict = True            # training must see the layer's errors
    if cfg.stage == "joint":
        layer_params = [p.requires_grad_(True) for p in net.parameters()]
        groups.append({"params": layer_params, "lr": cfg.layer_lr, "base": cfg.layer_lr})
        net.train()
    else:
        net.requires_grad_(False).eval()
    run = _Run(cfg, vlm, adapter, params, layer_params, torch.optim.AdamW(groups, weight_decay=cfg.weight_decay), None,
               [])
    if resume and os.path.isfile(os.path.join(cfg.out, STATE_FILE)):
        _resume(run)
    elif resume:
        logger.warning("--resume: no saved state in %s; starting fresh", shown_path(os.path.join(cfg.out, STATE_FILE)))
    data, val = training_items(cfg, items)
    run.loader = data_loader(cfg, run.state["step"], data)
    run.val = val
    run.t_start = time.perf_counter()
    return run


def type_weights(cfg: AdapterTrainConfig) -> dict[str, float]:
    """Stage 3 (--hard): question type -> weight; {} otherwise."""
    return {t: cfg.hard_weight for t in cfg.hard_types} if cfg.hard else {}


def training_items(cfg: AdapterTrainConfig, items: ItemSource | None = None
                   ) -> tuple[torch.utils.data.Dataset, list]:
    """(the training items, the fixed validation items): cfg.data's records with cfg.val_items of them held out,
    or drawn from `items` on the fly."""
    weights = type_weights(cfg)
    n = max(1, cfg.steps) * cfg.batch_size
    if cfg.data:
        return JsonlItems.split(cfg.data, n, cfg.val_items, cfg.data_seed, weights)
    if items is None:
        raise ValueError(NO_ITEMS)
    return items.draw(cfg, n, weights)


def data_loader(cfg: AdapterTrainConfig, start_step: int, data: torch.utils.data.Dataset) -> Any:
    """Batches of items for steps start_step.. (item k*B+j at step k, whatever the workers: resuming replays)."""
    order = list(range(start_step * cfg.batch_size, len(data)))
    return torch.utils.data.DataLoader(data, batch_size=cfg.batch_size, sampler=order, num_workers=cfg.workers,
                                       collate_fn=_collate, persistent_workers=cfg.workers > 0)


def _step(run: _Run, batch: list) -> dict:
    """One optimiser step on one batch -> its log record."""
    cfg, state = run.cfg, run.state
    step = state["step"]
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)      # per step: resuming replays exactly
    for g in run.opt.param_groups:
        g["lr"] = lr_at(step, cfg.steps, g["base"], cfg.warmup)
    low, high = cfg.budgets
    budgets = [low + (high - low) * float(u) for u in torch.rand(len(batch), generator=gen)]
    loss, rec = adapter_loss(run.vlm, batch, budgets, cfg, step)
    run.opt.zero_grad(set_to_none=True)
    if loss.requires_grad:            # every row kept every token (a fallback): nothing to learn from this batch
        loss.backward()
    grad = float(torch.nn.utils.clip_grad_norm_(run.params + run.layer_params, cfg.grad_clip))
    run.opt.step()
    state["step"] += 1
    rec.update(step=step + 1, lr=run.opt.param_groups[0]["lr"], grad_norm=grad if math.isfinite(grad) else None,
               budget_mean=sum(budgets) / len(budgets), seconds=round(time.perf_counter() - run.t_start, 3))
    return rec


def adapter_loss(vlm: ARRCOC, batch: Sequence, budgets: Sequence[float], cfg: AdapterTrainConfig,
                 step: int = 0) -> tuple[torch.Tensor, dict]:
    """The step's loss on `batch` [(image, question, answer, type)] at per-item `budgets` (module docstring)."""
    from ..encode import EncodeConfig
    from ..pipeline.request import Pruning
    from ..pipeline.selection import choose_before_encoding, get_selector

    backend = vlm.backend
    images, questions, answers = [[b[0]] for b in batch], [b[1] for b in batch], [b[2] for b in batch]
    inputs = backend.build_inputs(images, questions)
    contexts: list = []
    arr_coc = get_selector("arr_coc")

    @choose_before_encoding
    def arr_coc_seen(ctx):                # the shipped selector, its context kept for the relaxation
        contexts.append(ctx)
        return arr_coc(ctx)

    arr_coc_seen.handles_video = arr_coc_seen.runs_layer = True
    pruning = Pruning.of(arr_coc_seen, list(budgets), encode=EncodeConfig(cfg.encode))
    first = vlm.prepare(inputs, pruning)       # under no_grad: the choice itself trains nothing
    pruned = first.pruned
    if first.fovea is not None:          # the chosen cells again, with gradients into the tower's adapter
        fovea = _foveate_again(backend, first)
        pruned = backend.rewrite(first.batch, fovea.visual, fovea.lm_cells)
        pruned.adapted = first.pruned.adapted
    loss = backend.pruned_answer_loss(pruned, answers)
    rec = {"answer_loss": float(loss.detach()), "kept_share": sum(t.kept_ratio for t in first.traces) / len(batch)}
    if cfg.stage == "joint":
        relaxed, penalty = relaxed_loss(vlm, contexts[-1], inputs, answers, budgets, cfg, step)
        loss = loss + relaxed + cfg.budget_weight * penalty
        rec.update(relaxed_loss=float(relaxed.detach()), budget_penalty=float(penalty.detach()))
    rec["loss"] = float(loss.detach())
    return loss, rec


def _foveate_again(backend: Any, first: Any) -> Any:
    from ..pipeline.fovea import foveate

    adapted = first.pruned.adapted
    units = None if adapted is None else [adapted[b] for b in first.batch.item_of_image]
    return foveate(backend, first.batch, first.choice.kept, first.encoding, first.gist, None, units)


def relaxed_loss(vlm: ARRCOC, ctx: Any, inputs: dict, answers: Sequence[str], budgets: Sequence[float],
                 cfg: AdapterTrainConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint: the layer's relaxation (`train` stage 2) with the adapter on: (answer loss, budget penalty), both
    differentiable in the layer's scorers and the adapters."""
    from ..budget import resolve_count
    from ..methods.arrcoc import layer_batch_of
    from ..core.texture import texture_array
    from .losses import soft_keep

    backend, layer = vlm.backend, vlm.layer
    prompts = backend.answer_prompts(inputs)     # per row, its unpruned prompt (one image each)
    batch = layer_batch_of(ctx, layer)
    with torch.no_grad():
        tex = texture_array(batch.work, layer.config.texture, converge=True)[0]
    relevance = layer.score(tex, batch.grid.frame_valid, batch.query, batch.query_mask, batch.visual_tokens)["relevance"]
    t0, t1 = cfg.mask_temperature
    temperature = t0 * (t1 / t0) ** (step / max(1, cfg.steps - 1))
    prompt = ctx.prompt
    losses, penalties = [], []
    for i, (h, w) in enumerate(ctx.grid_hw):
        k = resolve_count(budgets[i], h * w)
        keep = soft_keep(relevance[i, :h, :w].reshape(-1), k, temperature)
        with backend.adapted(True):
            tokens, _ = backend.encode_cells(prompt, [i], [np.arange(h * w)])
            losses.append(backend.soft_answer_loss(prompts[i], tokens, answers[i], keep))
        penalties.append((keep.mean() - k / (h * w)) ** 2)
    return torch.stack(losses).mean(), torch.stack(penalties).mean()


@torch.no_grad()
def validate(vlm: ARRCOC, adapter: TrainableAdapter, items: Sequence, cfg: AdapterTrainConfig) -> float:
    """The pruned answer loss on fixed held-out items at the middle of the budget range (the adapter on, its
    dropout off)."""
    mid = sum(cfg.budgets) / 2
    losses = []
    adapter.dropout(False)
    for s in range(0, len(items), cfg.batch_size):
        chunk = items[s: s + cfg.batch_size]
        frozen = dataclasses.replace(cfg, stage="frozen")
        losses.append(float(adapter_loss(vlm, chunk, [mid] * len(chunk), frozen)[0]) * len(chunk))
    adapter.dropout(True)
    return sum(losses) / max(1, len(items))


def _resume(run: _Run) -> None:
    saved = torch.load(os.path.join(run.cfg.out, STATE_FILE), weights_only=True, map_location="cpu")
    with torch.no_grad():
        for p, q in zip(run.params, saved["adapter"]):
            p.copy_(q)
        for p, q in zip(run.layer_params, saved.get("layer", [])):
            p.copy_(q)
    run.opt.load_state_dict(saved["optimizer"])
    run.state = saved["state"]
    run.rng = saved["rng"]


def save(run: _Run, model_path: str, layer: str | None) -> None:
    """The adapter (peft's files + card) in out/adapter/, the layer when it trained (or out has none), the state
    file, the log and the loss plot."""
    from ..core.persistence import LayerCard
    from ..adapter_files import SUBFOLDER, AdapterCard

    cfg, state = run.cfg, run.state
    os.makedirs(cfg.out, exist_ok=True)
    folder = os.path.join(cfg.out, SUBFOLDER)
    last = next((r["val_loss"] for r in reversed(state["log"]) if "val_loss" in r), None)
    source = f"on {', '.join(shown_path(p) for p in cfg.data)}" if cfg.data else "on ShapesVQA items"
    recipe = (f"`python -m arr_coc train-adapter` stage {cfg.stage}{' + hard' if cfg.hard else ''} {source}, "
              f"{state['step']} of {cfg.steps} steps of {cfg.batch_size} items, "
              f"budgets {cfg.budgets[0]:g}-{cfg.budgets[1]:g}, lr {cfg.lr:g}, rank {cfg.rank}, seed {cfg.seed}")
    card = AdapterCard(vlm=shown_path(model_path), layer=shown_path(layer) if layer else "untrained", encode=cfg.encode,
                       training=recipe,
                       results=[] if last is None else [f"- validation answer loss (pruned, adapter on) at step "
                                                        f"{state['step']}: {last:.4f}"])
    run.adapter.save_pretrained(folder, card)
    net = run.vlm.layer
    if cfg.stage == "joint" or not os.path.isfile(os.path.join(cfg.out, "config.json")):
        strict, net.config.strict = net.config.strict, False
        net.save_pretrained(cfg.out, LayerCard(vlm=shown_path(model_path), encode=cfg.encode,
                                               training=recipe if cfg.stage == "joint" else f"as {layer}"))
        net.config.strict = strict
    torch.save({"adapter": [p.detach().cpu() for p in run.params],
                "layer": [p.detach().cpu() for p in run.layer_params], "optimizer": run.opt.state_dict(),
                "state": state, "rng": torch.get_rng_state()}, os.path.join(cfg.out, STATE_FILE + ".tmp"))
    os.replace(os.path.join(cfg.out, STATE_FILE + ".tmp"), os.path.join(cfg.out, STATE_FILE))
    with open(os.path.join(folder, LOG_FILE), "w") as f:
        json.dump({"config": asdict(cfg), **state}, f, indent=1)
    plot_losses(state["log"], os.path.join(folder, PLOT_FILE), cfg.stage)


def plot_losses(log: Sequence[dict], path: str, title: str = "") -> None:
    """The training loss per step (and its running mean) and the validation loss, as a PNG (matplotlib, Agg)."""
    if not log:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    loss = [r["answer_loss"] for r in log]
    mean = np.convolve(loss, np.ones(min(20, len(loss))) / min(20, len(loss)), mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, alpha=0.3, label="pruned answer loss (train)")
    ax.plot(steps[len(steps) - len(mean):], mean, label="running mean")
    val = [(r["step"], r["val_loss"]) for r in log if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"train-adapter {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["AdapterTrainConfig", "ItemSource", "adapter_loss", "data_loader", "plot_losses", "relaxed_loss", "save",
           "train_adapter", "type_weights", "validate"]
