"""Training the saccade gate against the frozen VLM (`python -m arr_coc train-saccade`).

1. `collect`: every item of a split takes two looks (the gate forced open), and per item we keep what
   each look cost and answered: the first answer token's uncertainty after look 1 (both signals), the
   answer loss (the gold answer's first token's negative log-likelihood under the frozen VLM) and the
   exact-match score after each look, and the whole-prefill FLOPs of look 1 alone and of both looks
   (gist + every look's tower + every look's LM prefill + the selector). With the hard gate, an item's
   outcome at any threshold is one of its two looks (the looks of other items never change it), so
   these rows give the accuracy and cost of every threshold exactly (`frontier`).
2. `fit`: the soft gate, strength = sigmoid((u - threshold) * sharpness), trained by Adam on

       L = mean[s * nll_2 + (1 - s) * nll_1]                       the answer loss of the look it takes
         + cost_weight * mean[s * (cost_2 - cost_1) / full_cost]    what the second look costs
         + rate_weight * (mean[s] - target_rate)^2                  saccades near a target share

   The saccade's budget is fixed by the configuration (not learned here).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..saccade import SaccadeConfig, SaccadeGate, uncertainty

if TYPE_CHECKING:
    from ..data import VQARecord
    from ..front import ARRCOC


@torch.no_grad()
def collect(vlm: ARRCOC, records: Sequence[VQARecord], budget: float, saccade: SaccadeConfig,
            batch_size: int = 8, progress: bool = True, method: str = "arr_coc") -> list[dict[str, Any]]:
    """Per item: {id, type, u_margin, u_entropy, nll_1, nll_2, correct_1, correct_2, cost_1, cost_2, full}
    (costs: whole-prefill FLOPs; `full`: the every-token model's). Two looks forced for every item."""
    from ..data import score_record
    from ..encode import EncodeConfig
    from ..evaluation.cost import vision_flops
    from ..evaluation.flops import CountedSelector, count_flops
    from ..pipeline.backend import Describes, require
    from ..pipeline.request import Pruning
    from ..pipeline.selection import get_selector

    forced = dataclasses.replace(saccade, passes=2, threshold=-1.0)
    encode = EncodeConfig(mode="before", saccade=forced)
    memo: dict[Any, int] = {}
    out: list[dict[str, Any]] = []
    batches = [list(records[i:i + batch_size]) for i in range(0, len(records), batch_size)]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(records), desc="looks", unit="item", dynamic_ncols=True)
    backend = vlm.backend
    tok = require(backend, Describes, "tokenize the gold answers (train-saccade)").tokenizer
    for batch in batches:
        inputs = backend.build_inputs([[r.load_image()] for r in batch], [r.question for r in batch])
        counted = CountedSelector(get_selector(method), method)
        looked = vlm.answer(inputs, Pruning.of(counted, budget, None, encode, strict=True), max_new_tokens=8)
        per_call = counted.flops_per_call() or []        # [first look, "grow": choosing again]
        first = len(batch)                               # the first look: one call per item (each chosen alone)
        selector = [sum(per_call[:first]) / len(batch), sum(per_call[first:]) / len(batch)]
        traces, prompt = looked.traces, looked.first.batch
        first_only = [dataclasses.replace(tr, looks=tr.looks[:1]) for tr in traces]
        vision_1 = vision_flops(backend, prompt, first_only, 0.0, memo)
        vision_2 = vision_flops(backend, prompt, traces, 0.0, memo)
        full_vision = vision_flops(backend, prompt, [dataclasses.replace(tr, encode="after") for tr in traces], 0.0,
                                   memo)
        every, _ = vlm.prepare(inputs, method="none").outputs
        gold = [tok(r.answers[0], add_special_tokens=False)["input_ids"][:1] or [0] for r in batch]
        gold_t = torch.as_tensor([g[0] for g in gold], device=looked.passes[0].first_logits.device)
        answers = [tok.batch_decode(p.answers, skip_special_tokens=True) for p in looked.passes]
        first_kept = [sum(int(c.numel()) for c in tr.looks[0].cells) for tr in traces]
        stats = []
        for p in looked.passes:
            logp = torch.log_softmax(p.first_logits.float(), -1)
            nll = -logp.gather(1, gold_t[p.rows].unsqueeze(1)).squeeze(1)
            stats.append((uncertainty(p.first_logits, "margin").tolist(), uncertainty(p.first_logits, "entropy").tolist(),
                          nll.tolist()))
        for b, (rec, tr) in enumerate(zip(batch, traces)):
            row: dict[str, Any] = {"id": rec.id, "type": rec.type or "other", "full": None}
            cost = selector[0]
            for n, p in enumerate(looked.passes):
                if b not in p.rows:
                    continue
                j = p.rows.index(b)
                length = p.pruned.lengths[j]
                if length not in memo:
                    memo[length] = count_flops(backend.prefill, p.pruned.rows([j]), logits_to_keep=1)[1]
                cost += memo[length] + (selector[1] if n == 1 else 0.0)
                row[f"correct_{n + 1}"] = float(score_record(answers[n][j].strip(), rec))
                row[f"nll_{n + 1}"] = stats[n][2][j]
                if n == 0:
                    row["u_margin"], row["u_entropy"] = stats[0][0][j], stats[0][1][j]
                    row.update(map_signals(tr, first_kept[b]))
                row[f"cost_{n + 1}"] = cost + (vision_1[b] if n == 0 else vision_2[b])
            if "correct_2" not in row:              # an image that fell back keeps every token: no second look
                row.update(correct_2=row["correct_1"], nll_2=row["nll_1"], cost_2=row["cost_1"])
            key = ("every token", every.lengths[b])
            if key not in memo:
                memo[key] = count_flops(backend.prefill, every.rows([b]), logits_to_keep=1)[1]
            row["full"] = memo[key] + full_vision[b]
            out.append(row)
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    return out


def map_signals(trace: Any, kept: int) -> dict[str, float]:
    """Two more candidate uncertainties from the selector, before any answer: the relevance map's spread (its
    normalised entropy over the image's cells: 1 = flat) and the extent head's cells against what was kept
    (predicted / kept; 0 without an extent head)."""
    out = trace.arr_coc
    if out is None:
        return {"u_spread": 0.0, "u_extent": 0.0}
    h, w = trace.grid_hw[0]
    rel = out.relevance[0, :h, :w].float().flatten().clamp_min(0) + 1e-12
    p = rel / rel.sum()
    spread = float(-(p * p.log()).sum() / math.log(p.numel()))
    extent = 0.0 if out.extent is None else float(out.extent[0]) / max(1, kept)
    return {"u_spread": spread, "u_extent": extent}


def frontier(rows: Sequence[dict[str, Any]], signal: str = "margin",
             thresholds: Sequence[float] | None = None) -> list[dict[str, float]]:
    """Accuracy and mean cost (share of the full prefill) of the hard gate at each threshold, exactly."""
    u = [r[f"u_{signal}"] for r in rows]
    if thresholds is None:
        thresholds = sorted(set([-1.0, 2.0] + [float(x) for x in u]))
    full = sum(r["full"] for r in rows) / len(rows)
    out = []
    for t in thresholds:
        go = [x > t for x in u]
        acc = sum(r["correct_2"] if g else r["correct_1"] for r, g in zip(rows, go)) / len(rows)
        cost = sum(r["cost_2"] if g else r["cost_1"] for r, g in zip(rows, go)) / len(rows) / full
        out.append({"threshold": t, "accuracy": acc, "cost": cost, "saccade_share": sum(go) / len(rows)})
    return out


def auroc(scores: Sequence[float], wrong: Sequence[bool]) -> float:
    """How well `scores` rank wrong answers above right ones (0.5: chance); ties count half."""
    pos = [s for s, w in zip(scores, wrong) if w]
    neg = [s for s, w in zip(scores, wrong) if not w]
    if not pos or not neg:
        return float("nan")
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def fit(rows: Sequence[dict[str, Any]], signal: str = "margin", steps: int = 400, lr: float = 0.05,
        cost_weight: float = 1.0, rate_weight: float = 1.0, target_rate: float = 0.3,
        init: SaccadeConfig = SaccadeConfig(), log: Any = None) -> tuple[SaccadeGate, list[dict[str, float]]]:
    """Train the soft gate on collected rows (module docstring); -> (gate, log lines)."""
    torch.manual_seed(0)
    u = torch.tensor([r[f"u_{signal}"] for r in rows])
    nll1, nll2 = torch.tensor([r["nll_1"] for r in rows]), torch.tensor([r["nll_2"] for r in rows])
    full = torch.tensor([r["full"] for r in rows], dtype=torch.float64).mean().float()
    extra = (torch.tensor([r["cost_2"] - r["cost_1"] for r in rows], dtype=torch.float64) / full).float()
    gate = SaccadeGate(init.threshold, init.sharpness)
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    lines = []
    for step in range(steps):
        s = gate(u)
        answer = (s * nll2 + (1 - s) * nll1).mean()
        cost = (s * extra).mean()
        rate = (s.mean() - target_rate) ** 2
        loss = answer + cost_weight * cost + rate_weight * rate
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            gate.sharpness.clamp_(min=1.0)
        line = {"step": step, "loss": loss.item(), "answer": answer.item(), "cost": cost.item(),
                "saccade_rate": s.mean().item(), "threshold": gate.threshold.item(), "sharpness": gate.sharpness.item()}
        lines.append(line)
        if log is not None:
            log.write(json.dumps(line) + "\n")
    return gate, lines
