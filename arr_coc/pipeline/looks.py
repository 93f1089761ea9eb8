"""encode="before" with passes > 1: look, answer, decide, look again (`arr_coc.saccade` says what and why).

1. look 1 is the one-look before mode exactly (`look.prepare`), and its answer is generated with the first
   answer token's logits kept;
2. the uncertainty of that token (`saccade.uncertainty`, on the device, read once per look for the whole
   batch) goes through the gate's hard decision; the items that look again are the look's `go` rows;
3. for their units, `saccade.saccade_cells` picks cells the LM has not read, from the selector's relevance
   map (read once per look); the tower encodes those it has not encoded (+ the margin / whole windows of
   context, minus every cell encoded before: a saccade never re-encodes a cell) in one packed pass over those
   units, their queries attending to the earlier looks' keys and values as well (`VLMBackend.attending`), and
   their tokens join the first look's (`VisualRows.extended`);
4. the prompt is rewritten with every kept token at its original position and the `go` rows are prefilled and
   answered again, on their own (`PrunedPrompt.rows`). Repeats up to `passes`.

Why re-run the prefill instead of extending the first look's KV cache: the prompt puts the image before the
question, and a token appended after the question is one the question's tokens never attend to (a causal
LM), so the model would read another prompt than the one it was trained on. The prefix before the image is a
few system tokens, so reusing it would save almost nothing. The cost of every look is counted (the
evaluation: every look's tower and prefill; the trace: `Trace.looks`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from ..core.output import ARRCOCOutput
from ..saccade import SaccadeConfig, decide, grown, saccade_cells, strength, uncertainty
from ..stopwatch import lap
from .backend import PrunedPrompt, RemembersTower, adapted as adapted_on, has
from .context import RequestContext
from .choose import PerImageOutputs, as_selection, context, slice_output
from .fovea import reads
from .look import Prepared, prepare
from .trace import Look, Trace



@dataclass
class Pass:
    """One look over the batch: which rows took part, their prompt (those rows only) and the time it took."""

    rows: list[int]                    # batch rows that were answered on this look
    pruned: PrunedPrompt               # their prompt (rows in `rows` order)
    new_cells: dict[int, np.ndarray]   # unit -> cells this look added to what the LM reads
    encoded: dict[int, np.ndarray]     # unit -> cells the tower encoded on this look
    answers: torch.Tensor              # [R, T] this look's new tokens (rows in `rows` order)
    first_logits: torch.Tensor | None  # [R, V] the first answer token's logits (what the gate read)
    prefill_s: float = 0.0
    seconds: float = 0.0               # the whole look: selection, tower, rewrite, prefill and decoding
    vision_s: float = 0.0              # looks after the first: the tower's pass on the new cells
    own_s: float = 0.0                 # looks after the first: ARR-COC's own work (aiming, packing, rewrite)


@dataclass
class Looked:
    """Every look of a batch: the final answers' new tokens [B, T] (pad after the end), traces, the passes."""

    new_tokens: torch.Tensor
    traces: list[Trace]
    passes: list[Pass]
    first: Prepared

    @property
    def ttft_s(self) -> float:
        """Time to the final answers' first token: every look but the last in full (its decoding included, as
        it ran), then the last look's preparation and prefill."""
        if len(self.passes) == 1:
            return self.passes[0].prefill_s
        return sum(p.seconds for p in self.passes[:-1]) + self.passes[-1].prefill_s


@dataclass
class _State:
    """What the looks so far have kept, encoded and read, per unit (host), and the tower's tokens."""

    kept: list[np.ndarray]
    encoded: list[np.ndarray]
    periphery: list[np.ndarray]
    lm_cells: list[np.ndarray]
    visual: Any
    gist_hw: list[tuple[int, int]] | None

    @classmethod
    def of(cls, first: Prepared) -> _State:
        fovea = first.fovea
        as_np = lambda xs: [x.cpu().numpy().astype(np.int64) for x in xs]  # noqa: E731
        gist_hw = first.gist.grid_hw if first.gist is not None and first.encoding.periphery else None
        return cls(as_np(first.choice.kept), as_np(fovea.encoded), as_np(fovea.periphery), as_np(fovea.lm_cells),
                   fovea.visual, gist_hw)


def relevance_maps(first: Prepared, units: list[int]) -> dict[int, np.ndarray]:
    """unit -> its selector's relevance map, float[h * w] raster, read from the device once for all `units`."""
    out = first.choice.arr_out
    if out is None:
        raise ValueError("a saccade aims by the selector's relevance map, and this selector has none: use "
                         "method='arr_coc' (or a trained layer) with passes > 1")
    if isinstance(out, PerImageOutputs):        # each image chosen alone (`run_selector`): its own output
        return {i: relevance_maps_of(out.piece(i), [0], [first.batch.grid_hw[i]])[0] for i in units}
    sliced = out if isinstance(out, ARRCOCOutput) else slice_output(out, units)
    pick = units if sliced is out else list(range(len(units)))
    return dict(zip(units, relevance_maps_of(sliced, pick, [first.batch.grid_hw[i] for i in units])))


def relevance_maps_of(out: Any, pick: list[int], grid_hw: list[tuple[int, int]]) -> list[np.ndarray]:
    """The relevance maps of images `pick` of one selector output, float[h * w] raster each."""
    if out is None or getattr(out, "relevance", None) is None:
        raise ValueError("the selector's relevance map is missing for an image that would look again")
    maps = out.relevance[torch.as_tensor(pick, device=out.relevance.device)].float().cpu().numpy()
    return [maps[j, :h, :w].reshape(-1) for j, (h, w) in enumerate(grid_hw)]


class Looker:
    """The looks of one batch over a backend (module docstring): `run` answers with up to `passes` looks."""

    def __init__(self, req: RequestContext, **gen_kwargs: Any):
        if gen_kwargs.get("do_sample") or int(gen_kwargs.get("num_return_sequences", 1)) != 1 \
                or int(gen_kwargs.get("num_beams", 1)) != 1:
            raise ValueError("passes > 1 decides each look from the greedy answer's first token: use greedy "
                             "decoding (no do_sample, num_beams or num_return_sequences > 1), or passes=1")
        self.req, self.backend, self.clock = req, req.backend, req.clock
        self.config: SaccadeConfig = req.pruning.encode.saccade
        self.gen_kwargs = gen_kwargs

    def _answer(self, pruned: PrunedPrompt) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Greedy answers with the first answer token's logits: -> (new tokens [R, T], logits [R, V], prefill s)."""
        out = self.backend.decode(pruned, first_logits=True, **self.gen_kwargs)
        return out.new_tokens, out.first_logits, out.prefill_s

    def _decide(self, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
        u = uncertainty(logits, self.config.signal)
        go = decide(u, self.config)
        return u.cpu().tolist(), [bool(g) for g in go.cpu().tolist()]       # one read per look

    @torch.no_grad()
    def run(self, inputs: Mapping[str, Any]) -> Looked:
        t0 = time.perf_counter()
        remembers = has(self.backend, RemembersTower) and self.config.memory and self.config.passes > 1
        memory = self.backend.new_tower_memory() if remembers else None
        with self.backend.remembering(memory, None) if memory is not None else nullcontext():
            first = prepare(self.req, inputs)      # a clip is refused there (`Pruning.check_prompt`)
        if first.fovea is None:
            raise ValueError("passes > 1 needs encode='before' with a selector (a saccade adds cells to a foveal look)")
        B = first.batch.rows
        new_tokens, logits, prefill_s = self._answer(first.pruned)
        lap(self.clock, "answer")                                             # the LM: prefill + decoding
        u, go = self._decide(logits)
        lap(self.clock, "saccade")
        passes = [Pass(list(range(B)), first.pruned, {i: k.numpy() for i, k in enumerate(first.choice.kept)},
                       {i: e.numpy() for i, e in enumerate(first.fovea.encoded)}, new_tokens, logits, prefill_s,
                       time.perf_counter() - t0)]
        record = {b: [(u[b], go[b])] for b in range(B)}
        answers, state, rows = list(new_tokens), _State.of(first), list(range(B))
        for _ in range(self.config.passes - 1):
            rows = [b for b, g in zip(rows, go) if g]
            if not rows:
                break
            step, (u_rows, go) = self._look_again(first, state, rows, memory)
            for j, b in enumerate(rows):
                answers[b] = step.answers[j]
                record[b].append((u_rows[j], go[j]))
            passes.append(step)
        traces = _final_traces(first, passes, record, state, self.config)
        return Looked(_padded(answers, self.backend.pad_token_id), traces, passes, first)

    def _look_again(self, first: Prepared, state: _State, rows: list[int], memory: Any
                    ) -> tuple[Pass, tuple[list[float], list[bool]]]:
        """One more look for batch rows `rows`: aim, encode the new cells, rewrite, answer, decide."""
        t_pass = time.perf_counter()
        batch = first.batch
        units = [i for i, r in enumerate(batch.item_of_image) if r in rows and first.choice.fallback[i] != "keep_all"]
        new, to_encode = self._aim(first, units, state)
        lap(self.clock, "saccade")                                           # aiming: ARR-COC's own work
        todo = [i for i in units if len(to_encode[i])]
        t_tower = time.perf_counter()
        adapted = first.pruned.adapted        # look 1's decision holds for every look of a row
        if todo:
            # only rows that lost tokens on look 1 have cells left to encode, so with an adapter every one is on
            on = adapted is not None and all(adapted[batch.item_of_image[i]] for i in todo)
            with self.backend.attending(memory, todo) if memory is not None else nullcontext(), \
                    adapted_on(self.backend, on):
                tokens, side = self.backend.encode_cells(batch, todo, [to_encode[i] for i in todo], self.clock)
            state.visual = state.visual.extended(tokens, side, {i: to_encode[i] for i in todo})
        vision_s = time.perf_counter() - t_tower
        for i in units:
            state.kept[i] = np.union1d(state.kept[i], new[i]).astype(np.int64)
            state.encoded[i] = np.union1d(state.encoded[i], to_encode[i]).astype(np.int64)
            state.lm_cells[i], state.periphery[i] = reads(state.kept[i], state.periphery[i], batch.grid_hw[i],
                                                          None if state.gist_hw is None else state.gist_hw[i])
        rewritten = self.backend.rewrite(batch, state.visual, [torch.from_numpy(c) for c in state.lm_cells])
        rewritten.adapted = adapted
        pruned = rewritten.rows(rows)
        lap(self.clock, "packing")
        own_s = time.perf_counter() - t_pass - vision_s
        got, logits, prefill_s = self._answer(pruned)
        lap(self.clock, "answer")
        decided = self._decide(logits)
        lap(self.clock, "saccade")
        step = Pass(rows, pruned, {i: new[i] for i in units}, {i: to_encode[i] for i in units}, got, logits,
                    prefill_s, time.perf_counter() - t_pass, vision_s, own_s)
        return step, decided

    def _aim(self, first: Prepared, units: list[int], state: _State
             ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Where a saccade looks: unit -> (cells it adds to what the LM reads, cells the tower must encode for
        them: the new cells + their context, minus every cell encoded before)."""
        batch = first.batch
        if self.config.target == "grow":
            larger = self._choose_again(first, units)
        else:
            relevance = relevance_maps(first, units) if units else {}
        new, to_encode = {}, {}
        for i in units:
            if self.config.target == "grow":
                c = np.setdiff1d(larger[i], state.kept[i]).astype(np.int64)
            else:
                c = saccade_cells(relevance[i], state.kept[i], batch.grid_hw[i], self.config.budget,
                                  self.config.target)
            context_cells = self.backend.context_cells(batch, [i], [torch.from_numpy(c)], first.encoding)[0].numpy()
            new[i], to_encode[i] = c, np.setdiff1d(context_cells, state.encoded[i]).astype(np.int64)
        return new, to_encode

    def _choose_again(self, first: Prepared, units: list[int]) -> dict[int, np.ndarray]:
        """target "grow": unit -> the cells the selector chooses for it at its first budget plus the saccade's."""
        batch, extra = first.batch, self.config.budget
        budgets = [grown(b, extra, n) for b, n in zip(first.budgets, batch.n_tokens)]
        tokens = first.gist.on_full_grid if first.gist is not None else None
        ctx = context(self.req, batch, tokens, budgets, first.budget_mode).subset(units)
        chosen = as_selection(first.selector(ctx), len(units)).kept
        return {i: np.asarray(k.cpu().numpy(), dtype=np.int64) for i, k in zip(units, chosen)}


def _padded(answers: list[torch.Tensor], pad: int) -> torch.Tensor:
    width = max(int(a.shape[0]) for a in answers)
    out = torch.full((len(answers), width), pad, dtype=answers[0].dtype, device=answers[0].device)
    for b, a in enumerate(answers):
        out[b, :a.shape[0]] = a
    return out


def _final_traces(first: Prepared, passes: list[Pass], record: dict[int, list[tuple[float, bool]]],
                  state: _State, config: SaccadeConfig) -> list[Trace]:
    """The first look's traces, updated to what every look kept and encoded, each with its `looks`."""
    batch = first.batch
    empty = np.empty(0, np.int64)
    for b, tr in enumerate(first.traces):
        imgs = batch.units_of(b)
        mine = [p for p in passes if b in p.rows]
        tr.looks = [Look(cells=[torch.from_numpy(p.new_cells.get(i, empty)) for i in imgs],
                         encoded=[torch.from_numpy(p.encoded.get(i, empty)) for i in imgs],
                         prompt_tokens=p.pruned.lengths[p.rows.index(b)], uncertainty=u,
                         strength=strength(u, config), go=go, saccade=n + 1 < len(mine))
                    for n, (p, (u, go)) in enumerate(zip(mine, record[b]))]
        tr.kept_indices = [torch.from_numpy(state.kept[i]) for i in imgs]
        tr.kept_per_image = [int(len(state.lm_cells[i])) for i in imgs]
        tr.kept_tokens = sum(tr.kept_per_image)
        tr.encoded_cells = [torch.from_numpy(state.encoded[i]) for i in imgs]
        tr.periphery_cells = [torch.from_numpy(state.periphery[i]) for i in imgs]
        tr.prompt_tokens = tr.looks[-1].prompt_tokens
        tr.vision_s += sum(p.vision_s for p in passes[1:])           # the batch's, as the first look's times are
        tr.arr_coc_s += sum(p.own_s for p in passes[1:])
    return first.traces


__all__ = ["Looked", "Looker", "Pass", "relevance_maps"]
