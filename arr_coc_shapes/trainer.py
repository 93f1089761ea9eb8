"""Train the embedded Qwen2-VL-architecture model from scratch on ShapesVQA (CPU, about 1.5 hours).

Plain end-to-end training does not learn here in 20 minutes (measured while building
this recipe: the merger's tokens collapse and the language model ignores the image). So the
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
              without gradient: the LM's gradient into the tower measured ~1e-3 of its
              own, and a full-image backward through the tower costs more than
              the LM's whole step). Letters are the tower's slowest attribute, so the LM
              can learn to bind colours and shapes while the tower still learns letters.

Binding a question to its object is what a small LM learns slowest (measured: near the
text prior after 20 minutes even with ideal visual tokens). So in stages 2-3 head 0
of layers 1-3 is also supervised to put its attention, at the answer position, on the
answer's cells (an auxiliary attention loss, as in supervised-attention VQA, e.g. Qiao
et al., AAAI 2018); the heads stay free to do anything else elsewhere.

Visual-token dropout throughout stages 2-3 (keep the answer's cells plus a random
share of the rest, at their ORIGINAL M-RoPE positions, as ARR-COC prunes) makes the
model tolerate missing visual tokens, like large VLMs do.

    python -m arr_coc_shapes train-vlm --out checkpoints/shapes-qwen2vl [--resume] [--steps 600,2400,600]

The recipe is `vlm_config`; what it trains on, `supervision`; the LM batch, `batching`; the
attention recorder, `attention`; the losses, `losses`; checkpoints, `checkpoint`; the command
line, `arr_coc_shapes.cli.train_vlm`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from arr_coc.schedule import lr_at
from .attention import SUPERVISED_SDPA, AttentionRecorder
from .batching import Batcher, visual_tokens
from .checkpoint import save, warm_start
from .embedded import build_embedded
from .items import make_item
from .losses import DenseHead, attention_loss, count_answer_weights, count_loss, dense_loss
from .supervision import choose_kept, training_item
from .vlm_config import LR_FLOOR, STAGES, VLMTrainConfig
from .vocabulary import QUESTION_TYPES


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


@dataclass
class _Run:
    """The embedded VLM's training between steps: the model and its helpers, the progress state, the generator."""

    cfg: VLMTrainConfig
    model: Any
    processor: Any
    head: DenseHead
    batcher: Batcher
    recorder: AttentionRecorder
    answer_weights: torch.Tensor | None
    state: dict
    gen: torch.Generator
    opt_state: dict | None = None  # a resumed optimiser's state, loaded into the first stage's optimiser


def train(cfg: VLMTrainConfig, resume: bool = False, progress: bool = True) -> dict:
    """Train (or resume) the embedded model through its STAGES, checkpointing as it goes; returns the progress."""
    run = _start(cfg, resume)
    while run.state["stage"] < len(STAGES):
        _train_stage(run, progress)
        run.state["stage"] += 1
        run.state["step"] = 0
        run.opt_state = None
    save(run.model, run.processor, run.head, None, run.state, run.gen, cfg)
    return run.state


def _attention_recorder(model, cfg: VLMTrainConfig) -> AttentionRecorder:
    """A recorder of the supervised heads' attention rows (head 0 of the attention layers, the count heads)."""
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
    return recorder


def _start(cfg: VLMTrainConfig, resume: bool) -> _Run:
    """Build the seeded model and its helpers, then warm-start it or resume the saved run."""
    torch.manual_seed(cfg.seed)
    model, processor = build_embedded(seed=cfg.seed)
    recorder = _attention_recorder(model, cfg)
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
    return _Run(cfg=cfg, model=model, processor=processor, head=head, batcher=batcher, recorder=recorder,
                answer_weights=answer_weights, state=state, gen=gen, opt_state=opt_state)


def _train_stage(run: _Run, progress: bool) -> None:
    """The current stage's optimiser steps, from the state's step to the stage's total, under a progress bar."""
    from tqdm import tqdm

    cfg, state = run.cfg, run.state
    k = state["stage"]
    stage = STAGES[k]
    opt = make_optimizer(run.model, run.head, stage, cfg)
    if run.opt_state is not None:
        opt.load_state_dict(run.opt_state)
        run.opt_state = None
    total = cfg.steps[k]
    bar = tqdm(total=total, initial=state["step"], desc=f"train-vlm [{stage}]", disable=not progress,
               dynamic_ncols=True, mininterval=1.0 if os.isatty(2) else 30.0)
    while state["step"] < total:
        rec = _train_step(run, opt, k, total)
        bar.set_postfix(ans=f"{rec['loss_answer']:.3f}", dense=f"{rec['loss_dense']:.3f}",
                        attn=f"{rec['loss_attn']:.3f}", acc=f"{rec['train_token_acc']:.2f}")
        bar.update(1)
        _log_and_save(run, opt, rec, total, bar)
    bar.close()


def _train_step(run: _Run, opt: torch.optim.Optimizer, k: int, total: int) -> dict:
    """One optimiser step of stage `k`: the tower's dense loss and/or the LM's answer and attention losses."""
    cfg, state = run.cfg, run.state
    stage = STAGES[k]
    t0 = time.perf_counter()
    lr = lr_at(state["step"], total, cfg.lr[k], cfg.warmup, floor=LR_FLOOR)
    for g in opt.param_groups:
        g["lr"] = lr
    loss_dense = loss_answer = loss_attn = torch.zeros(())
    acc = float("nan")
    if stage != "language":
        loss_dense = dense_loss(run.model, run.processor, run.head, cfg, state["item"], cfg.images_per_step[k])
        state["item"] += cfg.images_per_step[k]
    if stage != "vision":
        loss_answer, loss_attn, acc = _answer_losses(run, k, loss_attn)
    loss = loss_answer + cfg.dense_weight * loss_dense + cfg.attn_weight * loss_attn
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gnorm = float(torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip))
    opt.step()
    state["step"] += 1
    state["elapsed"] += time.perf_counter() - t0
    return {"stage": stage, "step": state["step"], "lr": lr, "loss_answer": float(loss_answer.detach()),
            "loss_dense": float(loss_dense.detach()), "loss_attn": float(loss_attn.detach()), "train_token_acc": acc,
            "grad_norm": gnorm, "minutes": state["elapsed"] / 60}


def _answer_losses(run: _Run, k: int, loss_attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The LM's answer loss, supervised-attention loss (added to `loss_attn`) and token accuracy on fresh items."""
    cfg, state, model, recorder = run.cfg, run.state, run.model, run.recorder
    items = [training_item(cfg, state["item"] + i) for i in range(cfg.images_per_step[k])]
    state["item"] += len(items)
    with torch.no_grad():  # the LM's gradient never reaches the tower (see the module docstring)
        feats, grids = visual_tokens(model, run.processor, [it[0] for it in items])
    keep = [choose_kept(it[2], h, w, run.gen, cfg) for it, (h, w) in zip(items, grids)]
    inputs, pos, mask, targets, _, sup = run.batcher.build(feats, grids, [it[2] for it in items], keep)
    rows, positions, index = sup.rows()
    recorder.request(rows, positions)
    out = model.model.language_model(inputs_embeds=inputs, position_ids=pos, attention_mask=mask)
    recorder.rows = None
    sel = targets >= 0
    logits = model.lm_head(out.last_hidden_state[sel])
    loss_answer = F.cross_entropy(logits, targets[sel], reduction="none")
    if run.answer_weights is not None:
        loss_answer = loss_answer * run.answer_weights[targets[sel]]
    loss_answer = loss_answer.mean()
    if cfg.attn_weight > 0 and sup.cells:
        loss_attn = attention_loss(recorder.probs, sup.cells, index, cfg.attn_layers)
    if cfg.attn_weight > 0 and sup.words:
        loss_attn = loss_attn + attention_loss(recorder.probs, sup.words, index, (0,))
    if cfg.attn_weight > 0 and sup.count:
        for layer, h, sink in cfg.count_heads:
            loss_attn = loss_attn + count_loss(recorder.probs, sup.count, index, layer, h, sink)
    acc = float((logits.argmax(-1) == targets[sel]).float().mean())
    return loss_answer, loss_attn, acc


def _log_and_save(run: _Run, opt: torch.optim.Optimizer, rec: dict, total: int, bar) -> None:
    """After a step: keep every 25th record, validate when due (not in the vision stage), checkpoint when due."""
    cfg, state, stage = run.cfg, run.state, rec["stage"]
    if state["step"] % 25 == 0:
        state["log"].append(rec)
    last = state["step"] == total
    if stage != "vision" and (state["step"] % cfg.eval_every == 0 or last):
        val = validate(run.model, run.processor, run.batcher, cfg)
        state["log"].append({"stage": stage, "step": state["step"], "minutes": state["elapsed"] / 60, "val": val})
        bar.write(f"[{stage} {state['step']}] val acc {val['accuracy']:.3f} "
                  + " ".join(f"{t}={a:.2f}" for t, a in val["per_type"].items()))
    if state["step"] % cfg.save_every == 0 or last:
        save(run.model, run.processor, run.head, opt, state, run.gen, cfg)
