"""Anchor methods (arr_coc/methods) on small inputs and tiny random Qwen-VL models (CPU, offline).

What a user comparing methods would notice if one were wrong: a method that keeps more
(or fewer) tokens than the budget, DivPrune keeping near-duplicates, FastV or VisionZip
keeping tokens the attention does not favour, CDPruner ignoring the question, an oracle
missing the answer's cells, or a downscaled image far from the budgeted token count.
Attention references are computed independently: FastV against the model's own
`output_attentions`, VisionZip against the vision tower's own eager attention weights.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from arr_coc.core.attending import topk_indices
from arr_coc.budget import resolve_count
from arr_coc.geometry import box_cells
from arr_coc.methods import cdpruner, divprune, downscale, fastv, oracle, random_sampling, visionzip
from arr_coc.qwen import ARRCOCQwen
from arr_coc.pipeline.selection import SELECTORS, get_selector

from conftest import FAMILIES

Q = "What colour is the circle?"
Q2 = "Is there a red square on the left?"


def _context(w: ARRCOCQwen, inputs: dict, budget):
    """The SelectionContext the wrapper builds for `inputs` (captured through a spy selector)."""
    seen = []
    w.prepare(inputs, budget=budget, method=lambda ctx: seen.append(ctx) or get_selector("grid")(ctx))
    return seen[0]


def _two_rows(w: ARRCOCQwen, make_image) -> dict:
    """Row 0: one image; row 1: two images (multi-image prompt), different questions."""
    return w.build_inputs([[make_image(120, 150, 0)], [make_image(90, 200, 1), make_image(100, 100, 2)]], [Q, Q2])


def _selectors_under_test(ctx) -> dict:
    boxes = [[(10, 10, 60, 50)], [(0, 0, 40, 40)]]
    return {
        "random": random_sampling.select, "grid": get_selector("grid"), "fastv": fastv.select,
        "visionzip": visionzip.select, "divprune": divprune.select, "cdpruner": cdpruner.select,
        "oracle": oracle.make_selector(boxes, [(150, 120), (200, 90)]), "arr_coc": get_selector("arr_coc"),
    }


# ----------------------------------------------------------------------------- the common contract


@pytest.mark.parametrize("budget", [0.1, 0.5, 3])
def test_every_selector_returns_exactly_the_budget_ascending_unique(tiny_vlm, make_image, budget):
    w = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    ctx = _context(w, _two_rows(w, make_image), budget)
    for name, select in _selectors_under_test(ctx).items():
        sel = select(ctx)
        kept = sel.kept if hasattr(sel, "kept") else sel
        assert len(kept) == len(ctx), name
        for k, (h, w_), count in zip(kept, ctx.grid_hw, ctx.counts):
            k = torch.as_tensor(k)
            assert count == resolve_count(budget, h * w_)
            assert k.numel() == count, f"{name} kept {k.numel()} tokens for a budget of {count}"
            assert torch.equal(k, k.sort().values), f"{name} indices are not ascending"
            assert k.unique().numel() == k.numel(), f"{name} repeats an index"
            assert int(k.min()) >= 0 and int(k.max()) < h * w_


def test_method_list_and_registry():
    from arr_coc.pipeline.selection import METHODS, methods_where

    assert list(METHODS)[0] == "none" and "arr_coc_trained" in METHODS
    for name in ("fastv", "visionzip", "divprune", "cdpruner", "random", "grid", "arr_coc", "none"):
        assert callable(get_selector(name)) and name in SELECTORS   # loaded lazily, then registered
    for name in ("downscale", "oracle", "arr_coc_trained"):  # need more than a context: built per use
        with pytest.raises(ValueError, match="needs more than a selection context"):
            get_selector(name)
    with pytest.raises(ValueError, match="unknown method"):
        get_selector("no_such_method")
    # video support is a property of the method, read by every caller (eval's `all` on a clip split included)
    assert {"grid", "divprune", "cdpruner", "evs", "arr_coc"} <= set(methods_where(video=True))
    assert not {"fastv", "visionzip", "downscale"} & set(methods_where(video=True))
    for name in methods_where(video=True, runnable=True):
        assert getattr(get_selector(name), "handles_video") is True, name


@pytest.mark.parametrize("method", ["fastv", "visionzip", "divprune", "cdpruner"])
def test_methods_prune_through_generate_on_every_family(tiny_vlm, make_image, method):
    for family in FAMILIES:
        w = ARRCOCQwen(*tiny_vlm(family))
        answers, traces = w.generate([make_image(120, 150, 0), make_image(90, 200, 1)], [Q, Q2], budget=0.25,
                                     method=method, max_new_tokens=2)
        for tr in traces:
            assert tr.error is None and tr.fallback == [None], (family, tr.error)
            assert tr.kept_tokens == resolve_count(0.25, tr.total_tokens) < tr.total_tokens


# ----------------------------------------------------------------------------- DivPrune


def _min_pairwise_distance(tokens: torch.Tensor, idx: torch.Tensor) -> float:
    d = divprune.cosine_distances(tokens[idx])
    return float(d.masked_fill(torch.eye(idx.numel(), dtype=torch.bool), float("inf")).min())


def test_divprune_keeps_a_more_diverse_set_than_random():
    g = torch.Generator().manual_seed(0)
    # 6 tight clusters of 20 near-duplicates: a diverse set of 6 takes one from each.
    centres = F.normalize(torch.randn(6, 16, generator=g), dim=-1)
    tokens = (centres.repeat_interleave(20, 0) + 0.01 * torch.randn(120, 16, generator=g))
    kept = divprune.divprune_indices(tokens, 6)
    assert sorted(set((kept // 20).tolist())) == list(range(6)), "one token per cluster"
    ours = _min_pairwise_distance(tokens, kept)
    randoms = [_min_pairwise_distance(tokens, torch.randperm(120, generator=g)[:6]) for _ in range(200)]
    # Greedy max-min is a 2-approximation: a lucky random draw (one per cluster, ~2% of draws) may edge it out.
    assert ours > sorted(randoms)[190] + 0.1 and ours >= 0.9 * max(randoms)


def test_divprune_is_more_diverse_than_random_on_real_visual_tokens(tiny_vlm, make_image):
    w = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    ctx = _context(w, w.build_inputs([[make_image(224, 224, 3)]], [Q]), 0.2)
    v, k = ctx.visual_tokens[0], ctx.counts[0]
    ours = _min_pairwise_distance(v, divprune.divprune_indices(v, k))
    g = torch.Generator().manual_seed(1)
    randoms = [_min_pairwise_distance(v, torch.randperm(v.shape[0], generator=g)[:k]) for _ in range(50)]
    assert ours > max(randoms)


# ----------------------------------------------------------------------------- FastV


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
@pytest.mark.parametrize("layer", [1, 2])
def test_fastv_keeps_the_tokens_the_last_prompt_token_attends_to_most(tiny_vlm, make_image, family, layer):
    w = ARRCOCQwen(*tiny_vlm(family, "sdpa"))
    inputs = _two_rows(w, make_image)
    pruned, traces = w.prepare(inputs, budget=0.3, method=fastv.make_selector(layer)).outputs
    # Independent reference: the stock eager model's own attention maps over the unpruned prompt.
    eager, _ = tiny_vlm(family, "eager")
    with torch.no_grad():
        attn = eager(**inputs, output_attentions=True).attentions[layer - 1]      # [B, H, S, S]
    score = attn[:, :, -1, :].float().mean(dim=1)                                  # last prompt token, mean heads
    spans = [(b, s, e) for b, s, e in _spans(w, inputs)]
    kept = [k for tr in traces for k in tr.kept_indices]
    for (b, s, e), k in zip(spans, kept):
        expected = topk_indices(score[b, s:e], k.numel())
        assert torch.equal(k, expected)
    assert w.model.config.text_config._attn_implementation == "sdpa", "eager switch not undone"


def _spans(w, inputs):
    from arr_coc.qwen.rewrite import image_spans as _image_spans

    return _image_spans(inputs["input_ids"] == w.image_token_id, inputs["attention_mask"])


def test_fastv_rejects_a_layer_the_model_does_not_have(tiny_vlm, make_image):
    w = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    ctx = _context(w, w.build_inputs([[make_image(120, 150, 0)]], [Q]), 0.3)
    with pytest.raises(ValueError, match="outside this LM"):
        fastv.make_selector(layer=9)(ctx)


# ----------------------------------------------------------------------------- VisionZip


def test_visionzip_keeps_the_tokens_that_receive_the_most_vision_attention(tiny_vlm, make_image, monkeypatch):
    model, processor = tiny_vlm("qwen2_vl", "eager")
    w = ARRCOCQwen(model, processor)
    inputs = _two_rows(w, make_image)
    last = model.model.visual.blocks[-1].attn
    module = importlib.import_module(type(last).__module__)
    weights = []
    original = module.eager_attention_forward

    def spy(mod, *args, **kwargs):
        out = original(mod, *args, **kwargs)
        if mod is last:
            weights.append(out[1])                                               # [1, H, L, L] per image
        return out

    monkeypatch.setattr(module, "eager_attention_forward", spy)
    budget = 0.5
    pruned, traces = w.prepare(inputs, budget=budget, method=visionzip.select).outputs
    assert len(weights) >= 3
    # Independent reference: mean attention each patch receives, over heads and queries; 2x2 patches per token.
    kept = [k for tr in traces for k in tr.kept_indices]
    for wts, k in zip(weights[-3:], kept):
        received = wts[0].float().mean(0).mean(0).reshape(-1, 4).mean(1)
        n_dominant = k.numel() - visionzip.contextual_count(k.numel())
        dominant = topk_indices(received, n_dominant)
        assert set(dominant.tolist()) <= set(k.tolist())


def test_visionzip_merges_context_into_target_tokens(tiny_vlm, make_image):
    w = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    inputs = w.build_inputs([[make_image(224, 224, 4)]], [Q])
    ctx = _context(w, inputs, 0.5)
    v = ctx.visual_tokens[0]
    pruned, _ = w.prepare(inputs, budget=0.5, method="visionzip").outputs   # the pipeline's own vision pass, recorded
    assert ctx.prompt.native.tower_record is None
    standalone = visionzip.select(ctx)                         # no record: re-runs the vision tower itself
    assert torch.equal(pruned.kept_indices[0], standalone.kept[0])
    kept, out = standalone.kept[0], standalone.visual_tokens[0]
    changed = (out != v).any(dim=1).nonzero().squeeze(1)
    # only contextual targets change (a target no other token joined keeps its own value)
    assert 1 <= changed.numel() <= visionzip.contextual_count(kept.numel())
    assert set(changed.tolist()) <= set(kept.tolist())
    # The LM sees the merged values at the targets' positions, the merger output elsewhere.
    shown = pruned.image_features[0]
    for j, idx in enumerate(kept.tolist()):
        assert torch.allclose(shown[j], out[idx])
    # Each merged token is the mean of its group: the norm of a mean is at most the members' largest.
    assert (out[changed].norm(dim=1) <= v.norm(dim=1).max() + 1e-5).all()


def test_visionzip_select_pure_function_groups_by_key_similarity():
    # 8 tokens: 2 dominant by attention; the rest form two key clusters -> 2 contextual tokens.
    received = torch.tensor([0.9, 0.8, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])
    keys = torch.tensor([[1.0, 0], [1, 0], [1, 0], [1, 0], [1, 0], [0, 1], [0, 1], [0, 1]])
    tokens = torch.arange(8, dtype=torch.float32)[:, None].repeat(1, 3)
    kept, out = visionzip.visionzip_select(received, keys, tokens, k=4, n_contextual=2)
    assert kept.tolist()[:2] == [0, 1] and kept.numel() == 4
    targets = [i for i in kept.tolist() if i not in (0, 1)]
    # targets are spread over the remaining tokens (stride 3 over [2..7] -> 2 and 5)
    assert targets == [2, 5]
    assert torch.allclose(out[2], torch.full((3,), (2 + 3 + 4) / 3))            # cluster [1, 0]: 2, 3, 4
    assert torch.allclose(out[5], torch.full((3,), (5 + 6 + 7) / 3))            # cluster [0, 1]: 5, 6, 7


# ----------------------------------------------------------------------------- CDPruner


def test_cdpruner_kept_set_follows_the_question():
    g = torch.Generator().manual_seed(0)
    a, b = F.normalize(torch.randn(2, 32, generator=g), dim=-1)
    tokens = torch.cat([a + 0.3 * torch.randn(30, 32, generator=g), b + 0.3 * torch.randn(30, 32, generator=g)])
    about_a = (a + 0.05 * torch.randn(4, 32, generator=g))
    about_b = (b + 0.05 * torch.randn(4, 32, generator=g))
    kept_a = cdpruner.cdpruner_indices(tokens, about_a, 8)
    kept_b = cdpruner.cdpruner_indices(tokens, about_b, 8)
    assert not torch.equal(kept_a, kept_b)
    assert (kept_a < 30).sum() > 4 and (kept_b >= 30).sum() > 4    # mostly the tokens the question is about


def test_cdpruner_kept_set_changes_with_the_question_on_a_vlm(tiny_vlm, make_image):
    w = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    img = make_image(224, 224, 5)
    _, t1 = w.generate(img, "What colour is the circle?", budget=0.2, method="cdpruner", max_new_tokens=1)
    _, t2 = w.generate(img, "How many squares are there?", budget=0.2, method="cdpruner", max_new_tokens=1)
    assert not torch.equal(t1.kept_indices[0], t2.kept_indices[0])
    _, d1 = w.generate(img, "What colour is the circle?", budget=0.2, method="divprune", max_new_tokens=1)
    _, d2 = w.generate(img, "How many squares are there?", budget=0.2, method="divprune", max_new_tokens=1)
    assert torch.equal(d1.kept_indices[0], d2.kept_indices[0]), "control: DivPrune ignores the question"


def test_dpp_greedy_fills_the_budget_past_the_kernel_rank():
    tokens = torch.randn(20, 3)                                  # rank 3: the DPP has no volume past 3 tokens
    kept = cdpruner.cdpruner_indices(tokens, torch.randn(2, 3), 10)
    assert kept.numel() == 10 and kept.unique().numel() == 10


# ----------------------------------------------------------------------------- oracle


def test_oracle_covers_every_box_cell_when_the_budget_allows():
    h = w = 16
    boxes = [(30, 30, 90, 70), (300, 200, 340, 260)]            # pixels of a 448 x 448 image, 28 px cells
    cells = box_cells(boxes, (h, w), (448, 448))
    all_cells = {c for box in cells for c in box}
    assert all_cells == {r * w + c for r in range(1, 3) for c in range(1, 4)} | \
        {r * w + c for r in range(7, 10) for c in range(10, 13)}
    kept = oracle.oracle_indices(cells, h, w, 26)
    assert all_cells <= set(kept.tolist()) and kept.numel() == 26
    small = oracle.oracle_indices(cells, h, w, 2)                # budget < cells: one centre per box
    assert set(small.tolist()) == {cells[0][0], cells[1][0]}


def test_oracle_scales_boxes_from_the_original_image():
    # An 896 x 896 original shown to the VLM at 448 x 448: a box at (560, 560)-(616, 616) lands on cells (10, 10)-(10, 10).
    cells = box_cells([(560, 560, 616, 616)], (16, 16), (448, 448), original_size=(896, 896))
    assert cells == [[10 * 16 + 10]]


# ----------------------------------------------------------------------------- downscale


@pytest.mark.parametrize("grid", [(16, 16), (12, 20), (32, 32)])
@pytest.mark.parametrize("budget", [0.05, 0.1, 0.25, 0.5])
def test_downscale_yields_about_the_budgeted_token_count(grid, budget):
    from PIL import Image

    from arr_coc.qwen.visuals import image_scale
    from arr_coc_shapes.embedded import build_image_processor

    ip = build_image_processor()                                 # the embedded model's processor (28 px, min 4 tokens)
    scale = image_scale(ip)
    assert (scale.cell_px, scale.min_cells) == (28, 4)
    h, w = grid
    image = Image.new("RGB", (w * 28, h * 28), (40, 120, 200))
    small, (hh, ww) = downscale.downscale_image(image, grid, budget, scale)
    _, gh, gw = ip(images=[small], return_tensors="pt")["image_grid_thw"][0].tolist()
    got = (gh // 2) * (gw // 2)
    k = resolve_count(budget, h * w)
    assert got == hh * ww, "the processor must not resize the downscaled image again"
    assert abs(got - k) <= max(2, 0.15 * k), f"{got} tokens for a budget of {k}"
    assert abs((hh / ww) / (h / w) - 1) < 0.35, "aspect ratio kept"


def test_downscale_never_goes_below_the_processors_minimum():
    assert downscale.downscale_grid(16, 16, 1, min_count=4) == (2, 2)
