"""Saccades (issue 38): encode="before" with passes > 1 looks again where the first answer was uncertain.

On tiny random Qwen-VL models (offline, seeded): one pass is today's before mode exactly; a gate forced
shut costs one look, forced open costs every look and never re-encodes a cell; the soft gate carries a
gradient to its threshold and sharpness and its rounding is the hard decision; a batch where one item looks
again and another does not equals each alone; the evaluation's costs and the training rows agree.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from arr_coc.encode import EncodeConfig
from arr_coc.saccade import SaccadeConfig, SaccadeGate, decide, ring, saccade_cells, uncertainty

Q = "What colour is the circle?"
SHUT, OPEN = 2.0, -1.0                      # thresholds no uncertainty in [0, 1] crosses / every one crosses


def _vlm(tiny_vlm, family="qwen2_vl"):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm(family, "sdpa")
    return ARRCOCQwen(model, processor)


def _noise(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _looks(passes, threshold, **kw):
    return EncodeConfig("before", saccade=SaccadeConfig(passes=passes, threshold=threshold, budget=0.1, **kw))


ITEMS = ([_noise(224, 224, 0), _noise(168, 224, 1)], [Q, "How many stars are there?"])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_one_pass_and_a_shut_gate_equal_todays_before_mode(tiny_vlm, family):
    vlm = _vlm(tiny_vlm, family)
    today, t0 = vlm.generate(*ITEMS, budget=0.1, encode="before", max_new_tokens=3)
    for encode in (_looks(1, OPEN), _looks(3, SHUT)):
        answers, traces = vlm.generate(*ITEMS, budget=0.1, encode=encode, max_new_tokens=3)
        assert answers == today
        for a, b in zip(traces, t0):
            assert [k.tolist() for k in a.kept_indices] == [k.tolist() for k in b.kept_indices]
            assert [e.tolist() for e in a.encoded_cells] == [e.tolist() for e in b.encoded_cells]
            assert a.kept_tokens == b.kept_tokens and a.prompt_tokens == b.prompt_tokens
            assert len(a.looks) == (1 if encode.passes > 1 else 0)


@pytest.mark.parametrize("margin", [0, 1])
def test_an_open_gate_takes_every_look_and_never_re_encodes_a_cell(tiny_vlm, margin):
    vlm = _vlm(tiny_vlm)
    encode = EncodeConfig("before", margin=margin, saccade=SaccadeConfig(passes=3, threshold=OPEN, budget=0.1))
    _, one = vlm.generate(*ITEMS, budget=0.1, encode=EncodeConfig("before", margin=margin), max_new_tokens=2)
    _, traces = vlm.generate(*ITEMS, budget=0.1, encode=encode, max_new_tokens=2)
    for tr, first in zip(traces, one):
        assert [look.saccade for look in tr.looks] == [True, True, False] and all(look.go for look in tr.looks)
        seen: set[int] = set()
        for look in tr.looks:
            cells = set(look.encoded[0].tolist())
            assert cells and not cells & seen            # each look encodes only cells no look encoded before
            seen |= cells
        assert seen == set(tr.encoded_cells[0].tolist()) and set(tr.kept_indices[0].tolist()) <= seen
        added = sum(look.cells[0].numel() for look in tr.looks)
        assert tr.kept_tokens == added == first.kept_tokens + 2 * round(0.1 * tr.total_tokens)
        assert tr.looks[0].prompt_tokens < tr.looks[1].prompt_tokens < tr.looks[2].prompt_tokens


def test_the_soft_gate_has_gradients_and_rounds_to_the_hard_decision():
    gate = SaccadeGate(0.3, 7.0).double()
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    s = gate(u)
    s.sum().backward()
    d = s * (1 - s)
    assert torch.allclose(gate.threshold.grad, -(7.0 * d).sum())          # ds/dthreshold = -k s (1 - s)
    assert torch.allclose(gate.sharpness.grad, ((u - 0.3) * d).sum())      # ds/dsharpness = (u - t) s (1 - s)
    assert torch.autograd.gradcheck(lambda t, k: torch.sigmoid((u - t) * k),
                                    (torch.tensor(0.3, dtype=torch.float64, requires_grad=True),
                                     torch.tensor(7.0, dtype=torch.float64, requires_grad=True)))
    assert torch.equal(gate.decide(u), gate(u).round().bool())
    cfg = SaccadeConfig(passes=2, threshold=0.3, sharpness=7.0)
    assert torch.equal(decide(u, cfg), gate.decide(u))
    assert gate.decide(u).any() and not gate.decide(u).all()               # the sample straddles the threshold


def test_uncertainty_signals_order_confident_below_unsure():
    sure = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    torn = torch.tensor([[3.0, 3.0, 0.0, 0.0]])
    flat = torch.zeros(1, 4)
    for signal in ("margin", "entropy"):
        u = [float(uncertainty(x, signal)) for x in (sure, torn, flat)]
        assert 0.0 <= u[0] < u[1] <= u[2] <= 1.0 + 1e-6
    assert float(uncertainty(flat, "entropy")) == pytest.approx(1.0)
    assert float(uncertainty(torn, "margin")) == pytest.approx(1.0)


def test_a_saccade_aims_at_the_most_relevant_unencoded_cells():
    rel = np.arange(16, dtype=float)[::-1].copy()             # cell 0 most relevant
    got = saccade_cells(rel, kept=np.array([0, 1]), grid_hw=(4, 4), budget=3)
    assert got.tolist() == [2, 3, 4]                         # next by relevance, skipping what the LM reads
    near = saccade_cells(rel, kept=np.array([0, 1]), grid_hw=(4, 4), budget=3, target="ring")
    assert near.tolist() == [2, 4, 5]                        # the ring of cells 0 and 1 first (4, 5, 2, 6 by relevance)
    assert ring(np.array([5]), (4, 4)).sum() == 8
    assert saccade_cells(rel, np.arange(16), (4, 4), 3).size == 0   # nothing left to look at


def test_a_batch_where_one_item_looks_again_equals_each_alone(tiny_vlm):
    vlm = _vlm(tiny_vlm)
    images, questions = ITEMS
    u = []
    for img, q in zip(images, questions):
        _, tr = vlm.generate(img, q, budget=0.1, encode=_looks(2, OPEN), max_new_tokens=3)
        u.append(tr.looks[0].uncertainty)
    assert abs(u[0] - u[1]) > 1e-4
    threshold = (u[0] + u[1]) / 2                              # one item above it, one below
    answers, traces = vlm.generate(images, questions, budget=0.1, encode=_looks(2, threshold), max_new_tokens=3)
    assert sorted(len(tr.looks) for tr in traces) == [1, 2]
    for img, q, ans, tr in zip(images, questions, answers, traces):
        alone, t1 = vlm.generate(img, q, budget=0.1, encode=_looks(2, threshold), max_new_tokens=3)
        assert alone == ans and len(t1.looks) == len(tr.looks)
        assert t1.kept_indices[0].tolist() == tr.kept_indices[0].tolist()
        assert t1.encoded_cells[0].tolist() == tr.encoded_cells[0].tolist()
        assert t1.looks[-1].uncertainty == pytest.approx(tr.looks[-1].uncertainty, abs=1e-4)


def _looks_at(vlm, inputs):
    from arr_coc.pipeline import Pruning

    return vlm.answer(inputs, Pruning.of("arr_coc", 0.25, None, _looks(2, OPEN)), max_new_tokens=2)


def test_saccades_refuse_what_they_cannot_do(tiny_vlm):
    vlm = _vlm(tiny_vlm)
    with pytest.raises(ValueError, match="relevance map"):
        vlm.generate(*ITEMS, budget=0.1, method="grid", encode=_looks(2, OPEN), max_new_tokens=2)
    with pytest.raises(ValueError, match="greedy"):
        vlm.generate(*ITEMS, budget=0.1, encode=_looks(2, OPEN), max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="before"):
        EncodeConfig("after", saccade={"passes": 2})
    from test_video import video_inputs                        # a clip: refused before any work, with the reason

    model, processor = tiny_vlm("qwen2_vl", "sdpa")
    with pytest.raises(ValueError, match="images only.*passes=1"):
        _looks_at(vlm, video_inputs(model, processor))
    for bad in ({"passes": 0}, {"target": "left"}, {"signal": "vibes"}, {"sharpness": 0.0}, {"budget": 1.5}):
        with pytest.raises(ValueError):
            SaccadeConfig(**bad)


def test_eval_counts_every_look_and_the_training_rows_predict_it_exactly(tmp_path):
    """The evaluation's cost of two looks is one look's plus the second look's tower and prefill; the rows
    `train-saccade` collects give, at any threshold, exactly the accuracy and cost `eval` measures there."""
    from arr_coc.cli import main
    from arr_coc.data import read_jsonl
    from arr_coc.evaluation.loop import load_vlm
    from arr_coc.qwen.tiny import build_tiny_qwen
    from arr_coc_shapes import write_split
    from arr_coc.training.saccade import collect, frontier

    model, processor = build_tiny_qwen("qwen2_vl", seed=0)
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(str(tmp_path / "m"))
    split = write_split(tmp_path / "d", split="test", n=6, seed=0)
    vlm = load_vlm(str(tmp_path / "m"))
    rows = collect(vlm, read_jsonl(split), 0.05, SaccadeConfig(passes=2, budget=0.05), batch_size=4,
                   progress=False)
    assert all(r["cost_2"] > r["cost_1"] > 0 and r["full"] > r["cost_2"] for r in rows)
    u = sorted(r["u_margin"] for r in rows)
    for threshold in (SHUT, OPEN, (u[2] + u[3]) / 2):
        out = tmp_path / f"e{threshold}.json"
        assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(split), "--methods", "arr_coc",
                     "--budgets", "0.05", "--encode", "before", "--passes", "2", "--saccade-budget", "0.05",
                     "--saccade-threshold", str(threshold), "--batch-size", "4", "--out", str(out), "--quiet"]) == 0
        (row,) = json.loads(out.read_text())["results"]
        (want,) = frontier(rows, "margin", [threshold])
        assert row["accuracy"] == pytest.approx(want["accuracy"])
        assert row["saccade_share"] == pytest.approx(want["saccade_share"])
        assert row["passes_mean"] == pytest.approx(1 + want["saccade_share"])
        assert row["e2e_flops_mean"] == pytest.approx(sum(r["cost_2"] if r["u_margin"] > threshold else r["cost_1"]
                                                          for r in rows) / len(rows))
    assert rows[0]["cost_2"] > rows[0]["cost_1"]                # the open gate's second look is counted
    image = read_jsonl(split)[0]
    for passes, looks in (("1", None), ("2", 2)):              # ask --json says what each look did
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["ask", "--model", str(tmp_path / "m"), "--image", str(image.image), "--question",
                         image.question, "--encode", "before", "--passes", passes, "--saccade-threshold", str(OPEN),
                         "--json"]) == 0
        got = json.loads(out.getvalue().strip().splitlines()[-1])
        assert (len(got["looks"]) if "looks" in got else None) == looks


def test_fit_moves_the_threshold_to_where_a_second_look_helps():
    from arr_coc.training.saccade import fit

    rng = np.random.default_rng(0)
    rows = []
    for _ in range(200):
        u = float(rng.random())
        helps = u > 0.6                                         # only unsure items gain from a second look
        rows.append({"u_margin": u, "nll_1": 2.0 if helps else 0.1, "nll_2": 0.1, "cost_1": 1.0, "cost_2": 3.0,
                     "full": 10.0})                             # a second look costs 20% of the full prefill
    gate, log = fit(rows, "margin", steps=600, rate_weight=0.0, cost_weight=1.0)
    assert 0.5 < gate.threshold.item() < 0.65 and log[-1]["loss"] < log[0]["loss"]
    control = [dict(r, nll_1=0.1) for r in rows]                # negative control: a second look never helps
    gate2, _ = fit(control, "margin", steps=600, rate_weight=0.0, cost_weight=1.0)
    assert gate2.threshold.item() > 1.0                         # above every uncertainty: it never looks again


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_tower_memory_with_one_block_equals_encoding_the_union_at_once(family):
    """With one vision block, the earlier look's keys depend on its own patches only, so a later look that attends
    to them gives its cells exactly the tokens the stock encoding of both looks' cells at once gives them."""
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.qwen.encoding import encode_packed
    from arr_coc.qwen.tiny import build_tiny_qwen
    from arr_coc.qwen.tower_memory import TowerMemory, attending, remembering

    extra = {"deepstack_visual_indexes": [0]} if family == "qwen3_vl" else {}
    model, processor = build_tiny_qwen(family, seed=0, vision_config={"depth": 1, **extra})
    vlm = ARRCOCQwen(model, processor)
    inputs = vlm.build_inputs([[_noise(224, 224, 0)]], [Q])
    pv, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    first, later = np.array([0, 5, 9, 20, 33]), np.array([3, 30, 41, 47])
    memory = TowerMemory()
    with remembering(model, memory, [0]):
        encode_packed(model, pv, grid, [first])
    with attending(model, memory, [0]):
        got, _ = encode_packed(model, pv, grid, [later])
    union = np.union1d(first, later)
    at_once, _ = encode_packed(model, pv, grid, [union])
    want = at_once[np.searchsorted(union, later)]
    assert torch.allclose(got, want, atol=1e-5)
    alone, _ = encode_packed(model, pv, grid, [later])         # negative control: no memory, another encoding
    assert (alone - want).abs().max() > 20 * (got - want).abs().max().clamp_min(1e-7)
    assert memory.kv[0][0][0].shape[0] == 4 * (len(first) + len(later))   # both looks' patch rows remembered
