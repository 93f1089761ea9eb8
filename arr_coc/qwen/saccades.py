"""encode="before" with passes > 1: look, answer, decide, look again (`arr_coc.saccade` says what and why).

1. pass 1 is the one-pass before mode exactly (`ARRCOCQwen.prepare_state`), and its answer is generated
   with the first answer token's logits kept;
2. the uncertainty of that token (`saccade.uncertainty`, on the device, read once per pass for the whole
   batch) goes through the gate's hard decision; the items that look again are the pass's `go` rows;
3. for their images, `saccade.saccade_cells` picks cells the LM has not read, from the selector's
   relevance map (read once per pass); the tower encodes those it has not encoded (+ the margin / whole windows of context,
   minus every cell encoded before: a saccade never re-encodes a cell) in one packed pass over those
   images, their queries attending to the earlier looks' keys and values as well (`tower_memory`), and
   their tokens join the first pass's (`VisualRows`);
4. the prompt is rewritten with every kept token at its original M-RoPE position and the `go` rows are
   prefilled and answered again, on their own (`PrunedInputs.rows`). Repeats up to `passes`.

Why re-run the prefill instead of extending the first pass's KV cache: the prompt puts the image before
the question, and a token appended after the question is one the question's tokens never attend to (a
causal LM), so the model would read another prompt than the one it was trained on. The prefix before the
image is a few system tokens, so reusing it would save almost nothing. The cost of every look is counted
(the evaluation: every pass's tower and prefill; the trace: `Trace.looks`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..saccade import decide, grown, saccade_cells, strength, uncertainty
from ..stopwatch import Stopwatch, lap
from .encoding import as_encode_config, cells_to_encode, encode_packed
from .foveation import nearest_cells
from .rewrite import PrunedInputs, VisualRows, rewrite
from .tower_memory import TowerMemory, attending, remembering, supports
from .trace import Look

if TYPE_CHECKING:
    from .wrapper import ARRCOCQwen, Prepared


@dataclass
class Pass:
    """One look over the batch: which rows took part, their prompt (those rows only) and the time it took."""

    rows: list[int]                    # batch rows that were answered on this look
    pruned: PrunedInputs               # their prompt (rows in `rows` order)
    new_cells: dict[int, np.ndarray]   # image -> cells this look added to what the LM reads
    encoded: dict[int, np.ndarray]     # image -> cells the tower encoded on this look
    answers: torch.Tensor              # [R, T] this look's new tokens (rows in `rows` order)
    first_logits: torch.Tensor         # [R, V] the first answer token's logits (what the gate read)
    prefill_s: float = 0.0
    seconds: float = 0.0               # the whole look: selection, tower, rewrite, prefill and decoding
    vision_s: float = 0.0              # looks after the first: the tower's pass on the new cells
    own_s: float = 0.0                 # looks after the first: ARR-COC's own work (aiming, packing, rewrite)


@dataclass
class Looked:
    """Every look of a batch: the final answers' new tokens [B, T] (pad after the end), traces, the passes."""

    new_tokens: torch.Tensor
    traces: list[Any]
    passes: list[Pass]
    first: Prepared

    @property
    def ttft_s(self) -> float:
        """Time to the final answers' first token: every look but the last in full (its decoding included, as
        it ran), then the last look's preparation and prefill."""
        if len(self.passes) == 1:
            return self.passes[0].prefill_s
        return sum(p.seconds for p in self.passes[:-1]) + self.passes[-1].prefill_s


def _answer(wrapper: ARRCOCQwen, pruned: PrunedInputs, gen_kwargs: dict[str, Any]):
    """Greedy answers with the first answer token's logits: -> (new tokens [R, T], logits [R, V], prefill s)."""
    out, prefill_s = wrapper.generate_pruned(pruned, output_logits=True, return_dict_in_generate=True, **gen_kwargs)
    return out.sequences[:, pruned.input_ids.shape[1]:], out.logits[0], prefill_s


def relevance_maps(first: Prepared, images: list[int]) -> dict[int, np.ndarray]:
    """image -> its selector's relevance map, float[h * w] raster, read from the device once for all `images`."""
    from ..output import ARRCOCOutput
    from .selecting import slice_output

    out = first.choice.arr_out
    if out is None:
        raise ValueError("a saccade aims by the selector's relevance map, and this selector has none: use "
                         "method='arr_coc' (or a trained layer) with passes > 1")
    sliced = out if isinstance(out, ARRCOCOutput) else slice_output(out, images)
    pick = images if sliced is out else list(range(len(images)))
    if sliced is None or sliced.relevance is None:
        raise ValueError("the selector's relevance map is missing for an image that would look again")
    maps = sliced.relevance[torch.as_tensor(pick, device=sliced.relevance.device)].float().cpu().numpy()
    return {i: maps[j, :h, :w].reshape(-1) for j, (i, (h, w)) in enumerate(
        zip(images, (first.batch.grid_hw[i] for i in images)))}


def _aim(wrapper: ARRCOCQwen, first: Prepared, images: list[int], kept: list[np.ndarray], encoded: list[np.ndarray],
         clock: Stopwatch | None) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Where a saccade looks: image -> (cells it adds to what the LM reads, cells the tower must encode for them:
    the new cells + their context, minus every cell encoded before)."""
    config, batch = first.encoding.saccade, first.batch
    if config.target == "grow":
        larger = _choose_again(wrapper, first, images, clock)
    else:
        relevance = relevance_maps(first, images) if images else {}
    new, to_encode = {}, {}
    for i in images:
        g = batch.grid_hw[i]
        if config.target == "grow":
            c = np.setdiff1d(larger[i], kept[i]).astype(np.int64)
        else:
            c = saccade_cells(relevance[i], kept[i], g, config.budget, config.target)
        context = cells_to_encode(wrapper.model, batch.grid_thw[i:i + 1], [g], [torch.from_numpy(c)],
                                  first.encoding)[0].numpy()
        new[i], to_encode[i] = c, np.setdiff1d(context, encoded[i]).astype(np.int64)
    return new, to_encode


def _choose_again(wrapper: ARRCOCQwen, first: Prepared, images: list[int], clock: Stopwatch | None
                  ) -> dict[int, np.ndarray]:
    """target "grow": image -> the cells the selector chooses for it at its first budget plus the saccade's."""
    from .preparing import selection_context
    from .selecting import as_selection

    batch, extra = first.batch, first.encoding.saccade.budget
    budgets = [grown(b, extra, n) for b, n in zip(first.budgets, batch.n_tokens)]
    tokens = first.gist.on_full_grid if first.gist is not None else None
    ctx = selection_context(wrapper.model, lambda: wrapper.arr_coc_layer, wrapper.tokens, wrapper.processor, batch,
                            tokens, budgets, first.budget_mode, wrapper.seed, clock).subset(images)
    chosen = as_selection(first.selector(ctx), len(images)).kept
    return {i: np.asarray(k.cpu().numpy(), dtype=np.int64) for i, k in zip(images, chosen)}


def _reads(kept: np.ndarray, periphery: np.ndarray, grid_hw: tuple[int, int],
           gist_hw: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """What the LM reads of an image: the kept cells + the periphery tokens whose gist region holds no kept cell.
    -> (read cells ascending, the periphery cells still read)."""
    if gist_hw is None or len(periphery) == 0:
        return kept, periphery
    under = nearest_cells(grid_hw, gist_hw).numpy()
    still = periphery[~np.isin(under[periphery], under[kept])]
    return np.union1d(kept, still).astype(np.int64), still


def _extend(visual: VisualRows, tokens: torch.Tensor, deep: list[torch.Tensor] | None,
            new: dict[int, np.ndarray]) -> VisualRows:
    """`visual` with `tokens` (rows for the cells of `new`, image after image in `new`'s order) appended."""
    cells, rows = list(visual.cells), list(visual.rows)
    start = visual.source.shape[0]
    for i, c in new.items():
        merged = np.concatenate([cells[i], c])
        order = np.argsort(merged, kind="stable")
        cells[i] = merged[order]
        rows[i] = np.concatenate([rows[i], start + np.arange(len(c))])[order]
        start += len(c)
    source = torch.cat([visual.source, tokens.to(visual.source.dtype)])
    deep_source = None if visual.deep is None else [torch.cat([a, b.to(a.dtype)]) for a, b in zip(visual.deep, deep)]
    return VisualRows(source, deep_source, cells, rows, visual.n_tokens)


def _n_units(inputs: dict[str, torch.Tensor]) -> int:
    """Visual units (images) in the batch: what look 1's tower pass has as segments, in order."""
    grid = inputs.get("image_grid_thw")
    return 0 if grid is None else int(grid.shape[0])


def _patches_of(pixel_values: torch.Tensor, grid_thw: torch.Tensor, images: list[int]) -> torch.Tensor:
    """The patch rows of `images` (processor order), concatenated."""
    sizes = [int(t) * int(h) * int(w) for t, h, w in grid_thw.tolist()]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in images])
    return pixel_values.index_select(0, torch.as_tensor(rows, device=pixel_values.device))


@torch.no_grad()
def look(wrapper: ARRCOCQwen, inputs: dict[str, torch.Tensor], budget: Any = None, method: Any = "arr_coc",
         budget_mode: Any = None, strict: bool = False, encode: Any = None, clock: Stopwatch | None = None,
         **gen_kwargs: Any) -> Looked:
    """Answer with up to `encode.saccade.passes` looks (module docstring). Greedy decoding, one sequence per row."""
    t0 = time.perf_counter()
    if gen_kwargs.get("do_sample") or int(gen_kwargs.get("num_return_sequences", 1)) != 1 \
            or int(gen_kwargs.get("num_beams", 1)) != 1:
        raise ValueError("passes > 1 decides each look from the greedy answer's first token: use greedy decoding "
                         "(no do_sample, num_beams or num_return_sequences > 1), or passes=1")
    if inputs.get("pixel_values_videos") is not None:
        raise ValueError("passes > 1 looks again at images only: a video's budget is spread over its temporal "
                         "groups by the time stage, which a second look would have to re-run per clip; answer "
                         "videos with passes=1 (docs/DESIGN.md, Saccades)")
    config = as_encode_config(encode).saccade
    memory = TowerMemory() if config.memory and config.passes > 1 and supports(wrapper.model) else None
    n_images = _n_units(inputs)
    with remembering(wrapper.model, memory, range(n_images)) if memory is not None else nullcontext():
        first = wrapper.prepare_state(inputs, budget, method, None, budget_mode, strict, encode, clock)
    batch, fovea = first.batch, first.fovea
    if fovea is None:
        raise ValueError("passes > 1 needs encode='before' with a selector (a saccade adds cells to a foveal look)")
    B, pad = batch.rows, wrapper.pad_token_id
    new_tokens, logits, prefill_s = _answer(wrapper, first.pruned, gen_kwargs)
    lap(clock, "answer")                                                  # the LM: prefill + decoding
    answers = list(new_tokens)
    u = uncertainty(logits, config.signal)
    go_now = decide(u, config)
    u_host, go_host = u.cpu().tolist(), go_now.cpu().tolist()          # one read per look
    lap(clock, "saccade")
    passes = [Pass(list(range(B)), first.pruned, {i: k.numpy() for i, k in enumerate(first.choice.kept)},
                   {i: e.numpy() for i, e in enumerate(fovea.encoded)}, new_tokens, logits, prefill_s,
                   time.perf_counter() - t0)]
    record = {b: [(u_host[b], bool(go_host[b]))] for b in range(B)}
    kept = [k.cpu().numpy().astype(np.int64) for k in first.choice.kept]
    encoded = [e.numpy().astype(np.int64) for e in fovea.encoded]
    periphery = [p.numpy().astype(np.int64) for p in fovea.periphery]
    gist_hw = first.gist.grid_hw if first.gist is not None and first.encoding.periphery else None
    lm_cells = [c.numpy().astype(np.int64) for c in fovea.lm_cells]
    visual = fovea.visual
    rows = list(range(B))
    for _ in range(config.passes - 1):
        rows = [b for b, go in zip(rows, go_host) if go]
        if not rows:
            break
        t_pass = time.perf_counter()
        images = [i for i, r in enumerate(batch.item_of_image) if r in rows and first.choice.fallback[i] != "keep_all"]
        new, to_encode = _aim(wrapper, first, images, kept, encoded, clock)
        lap(clock, "saccade")                                             # aiming: ARR-COC's own work
        todo = [i for i in images if len(to_encode[i])]
        t_tower = time.perf_counter()
        if todo:
            grid_thw = batch.grid_thw[todo]
            pixels = _patches_of(batch.inputs["pixel_values"], batch.grid_thw, todo)
            with attending(wrapper.model, memory, todo) if memory is not None else nullcontext():
                tokens, deep = encode_packed(wrapper.model, pixels, grid_thw, [to_encode[i] for i in todo], clock)
            visual = _extend(visual, tokens, deep, {i: to_encode[i] for i in todo})
        vision_s = time.perf_counter() - t_tower
        for i in images:
            kept[i] = np.union1d(kept[i], new[i]).astype(np.int64)
            encoded[i] = np.union1d(encoded[i], to_encode[i]).astype(np.int64)
            lm_cells[i], periphery[i] = _reads(kept[i], periphery[i], batch.grid_hw[i],
                                               None if gist_hw is None else gist_hw[i])
        full = rewrite(batch.host["input_ids"], batch.host["attention_mask"], batch.pos3_host, batch.spans, visual,
                       [torch.from_numpy(c) for c in lm_cells], batch.encoder_output_cls, batch.item_of_image,
                       batch.grid_hw, pad, wrapper.device, batch.units.kind)
        pruned = full.rows(rows)
        lap(clock, "packing")
        own_s = time.perf_counter() - t_pass - vision_s
        got, logits, prefill_s = _answer(wrapper, pruned, gen_kwargs)
        lap(clock, "answer")
        u = uncertainty(logits, config.signal)
        go_now = decide(u, config)
        u_rows, go_host = u.cpu().tolist(), go_now.cpu().tolist()       # one read per look
        lap(clock, "saccade")
        for j, b in enumerate(rows):
            answers[b] = got[j]
            record[b].append((u_rows[j], bool(go_host[j])))
        passes.append(Pass(rows, pruned, {i: new[i] for i in images}, {i: to_encode[i] for i in images}, got,
                           logits, prefill_s, time.perf_counter() - t_pass, vision_s, own_s))
    traces = _final_traces(first, passes, record, kept, encoded, lm_cells, periphery, config)
    width = max(int(a.shape[0]) for a in answers)
    padded = torch.full((B, width), pad, dtype=answers[0].dtype, device=answers[0].device)
    for b, a in enumerate(answers):
        padded[b, :a.shape[0]] = a
    return Looked(padded, traces, passes, first)


def _final_traces(first: Prepared, passes: list[Pass], record: dict[int, list[tuple[float, bool]]],
                  kept: list[np.ndarray], encoded: list[np.ndarray], lm_cells: list[np.ndarray],
                  periphery: list[np.ndarray], config: Any) -> list[Any]:
    """The first look's traces, updated to what every look kept and encoded, each with its `looks`."""
    batch = first.batch
    for b, tr in enumerate(first.traces):
        imgs = [i for i, r in enumerate(batch.item_of_image) if r == b]
        mine = [p for p in passes if b in p.rows]
        looks = []
        for n, (p, (u, go)) in enumerate(zip(mine, record[b])):
            looks.append(Look(cells=[torch.from_numpy(p.new_cells.get(i, np.empty(0, np.int64))) for i in imgs],
                              encoded=[torch.from_numpy(p.encoded.get(i, np.empty(0, np.int64))) for i in imgs],
                              prompt_tokens=p.pruned.lengths[p.rows.index(b)], uncertainty=u, strength=strength(u, config),
                              go=go, saccade=n + 1 < len(mine)))
        tr.looks = looks
        tr.kept_indices = [torch.from_numpy(kept[i]) for i in imgs]
        tr.kept_per_image = [int(len(lm_cells[i])) for i in imgs]
        tr.kept_tokens = sum(tr.kept_per_image)
        tr.encoded_cells = [torch.from_numpy(encoded[i]) for i in imgs]
        tr.periphery_cells = [torch.from_numpy(periphery[i]) for i in imgs]
        tr.prompt_tokens = looks[-1].prompt_tokens
        tr.vision_s += sum(p.vision_s for p in passes[1:])           # the batch's, as the first look's times are
        tr.arr_coc_s += sum(p.own_s for p in passes[1:])
    return first.traces
