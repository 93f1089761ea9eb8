"""The ARR-COC layer without a VLM: texture, scorers, balancer, allocator, persistence."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from arr_coc import ARRCOCConfig, ARRCOCLayer, ARRCOCOutput, channel_names, generate_texture_array
from arr_coc.core.attending import (TokenAllocator, adaptive_budget, calibrate_spread, grid_indices, relevant_cells,
                               spread_count, spread_scale, topk_indices)
from arr_coc.budget import resolve_count

CELL = 28


def scene(size=(448, 448), bg=(70, 70, 70), boxes=(), seed=0, noise=0.0) -> Image.Image:
    """A flat (optionally noisy) background with filled rectangles: boxes = [((x0, y0, x1, y1), rgb)]."""
    w, h = size
    arr = np.full((h, w, 3), bg, dtype=np.float32)
    if noise:
        arr += np.random.default_rng(seed).normal(0, noise, arr.shape)
    im = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for box, rgb in boxes:
        draw.rectangle(box, fill=rgb)
    return im


def cells_of(box, grid_w, dilate=0, grid_h=None) -> set[int]:
    """Raster indices of the cells a pixel box touches, optionally dilated by `dilate` cells."""
    x0, y0, x1, y1 = box
    grid_h = grid_h or grid_w
    r0, r1 = max(0, y0 // CELL - dilate), min(grid_h - 1, y1 // CELL + dilate)
    c0, c1 = max(0, x0 // CELL - dilate), min(grid_w - 1, x1 // CELL + dilate)
    return {r * grid_w + c for r in range(r0, r1 + 1) for c in range(c0, c1 + 1)}


@pytest.fixture()
def layer() -> ARRCOCLayer:
    torch.manual_seed(0)
    return ARRCOCLayer(ARRCOCConfig())


# ---------------------------------------------------------------- texture
def test_texture_shape_range_names_and_determinism():
    im = scene(size=(560, 336), boxes=[((100, 100, 150, 140), (240, 40, 40))])
    tex = generate_texture_array(im, (12, 20))
    names = channel_names()
    assert tex.shape == (1, len(names), 12, 20) and len(names) == 14
    assert tex.dtype == torch.float32 and tex.min() >= 0 and tex.max() <= 1
    assert torch.equal(tex, generate_texture_array(im, (12, 20)))
    # A batch of equal-sized images equals the images one by one.
    im2 = scene(size=(560, 336), bg=(30, 60, 40), noise=8, seed=3)
    batch = generate_texture_array([im, im2], (12, 20))
    assert torch.allclose(batch[1], generate_texture_array(im2, (12, 20))[0], atol=1e-6)


def test_texture_channels_see_the_object_and_stay_flat_on_a_flat_image():
    box = (196, 196, 251, 251)  # cells 7..8 x 7..8 of a 16 x 16 grid
    tex = generate_texture_array(scene(boxes=[(box, (240, 200, 40))]), (16, 16))[0]
    flat = generate_texture_array(scene(), (16, 16))[0]
    names = channel_names()
    near = cells_of(box, 16, dilate=1)
    for name in ("sobel_mag", "sal_spectral", "sal_contrast", "sal_color", "cluster_rarity", "cluster_edge", "highpass"):
        c = names.index(name)
        assert int(tex[c].flatten().argmax()) in near, name
        assert flat[c].max() < 0.05, f"{name} responds to a flat image"
    # The saliency channels are different signals, not one map copied.
    sal = tex[[names.index(n) for n in ("sal_spectral", "sal_contrast", "sal_color")]].flatten(1)
    assert torch.corrcoef(sal).fill_diagonal_(0).abs().max() < 0.999


# ---------------------------------------------------------------- scorers + allocation
def test_bright_square_wins_information_perspectival_and_a_5_percent_budget(layer):
    box = (196, 196, 251, 251)
    out = layer([scene(boxes=[(box, (250, 250, 250))])], [(16, 16)], budget=0.05)
    near = cells_of(box, 16, dilate=1)
    assert int(out.perspectival[0].flatten().argmax()) in cells_of(box, 16)
    assert int(out.information[0].flatten().argmax()) in near
    kept = set(out.kept_indices[0].tolist())
    assert len(kept) == resolve_count(0.05, 256) == 13
    assert kept <= near and out.fallback == [None]


def _toy_vocab(dim=32, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {w: torch.randn(dim, generator=g) for w in ("what", "is", "the", "red", "blue", "object", "background")}


def test_the_question_changes_the_participatory_map_and_the_kept_set():
    """Toy VLM: visual tokens of a red object resemble the word 'red', of a blue one 'blue'."""
    vocab = _toy_vocab()
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(32))
    red, blue = (56, 56, 111, 111), (308, 308, 363, 363)
    im = scene(boxes=[(red, (220, 40, 40)), (blue, (40, 80, 220))])
    tokens = vocab["background"].repeat(256, 1).clone()
    g = torch.Generator().manual_seed(1)
    tokens += 0.3 * torch.randn(tokens.shape, generator=g)
    for box, word in ((red, "red"), (blue, "blue")):
        for i in cells_of(box, 16):
            tokens[i] += 2.0 * vocab[word]

    def ask(*words):
        q = torch.stack([vocab[w] for w in words])
        return layer([im], [(16, 16)], query_embeds=[q], visual_tokens=[tokens], budget=4)

    out_red, out_blue = ask("what", "is", "the", "red", "object"), ask("what", "is", "the", "blue", "object")
    assert not torch.allclose(out_red.participatory, out_blue.participatory)
    assert set(out_red.kept_indices[0].tolist()) == cells_of(red, 16)
    assert set(out_blue.kept_indices[0].tolist()) == cells_of(blue, 16)


def test_learned_participatory_path_depends_on_the_question(layer):
    im = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    g = torch.Generator().manual_seed(0)
    q1, q2 = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    a = layer([im], [(16, 16)], query_embeds=[q1]).participatory
    b = layer([im], [(16, 16)], query_embeds=[q2]).participatory
    assert (a - b).abs().max() > 1e-4


def test_near_uniform_image_falls_back_to_grid_coverage(layer):
    im = scene(bg=(90, 95, 100), noise=1.5, seed=2)
    out = layer([im], [(16, 16)], budget=0.1)
    assert out.fallback == ["grid"]
    kept = out.kept_indices[0]
    rows, cols = kept // 16, kept % 16
    quadrants = {(int(r) >= 8, int(c) >= 8) for r, c in zip(rows, cols)}
    assert quadrants == {(False, False), (False, True), (True, False), (True, True)}
    assert len(kept) == 26


# ---------------------------------------------------------------- budgets
@pytest.mark.parametrize("budget,n,expected", [(0.25, 256, 64), (0.05, 256, 13), (1.0, 256, 256), (1e-6, 256, 1),
                                               (10, 256, 10), (1000, 256, 256), (1, 1, 1)])
def test_resolve_budget_exact_counts(budget, n, expected):
    assert resolve_count(budget, n) == expected


@pytest.mark.parametrize("bad", [0.0, 1.5, -3, 0, True, "0.1", float("nan"), float("inf")])
def test_bad_budgets_say_what_is_allowed(bad):
    with pytest.raises((ValueError, TypeError), match="budget"):
        resolve_count(bad, 10)


def test_no_budget_means_the_one_default():
    from arr_coc.budget import DEFAULT_BUDGET

    assert resolve_count(None, 256) == resolve_count(DEFAULT_BUDGET, 256) == 64


def test_topk_breaks_ties_by_raster_order_and_returns_ascending():
    scores = torch.tensor([0.5, 0.9, 0.5, 0.9, 0.1, 0.5])
    assert topk_indices(scores, 3).tolist() == [0, 1, 3]
    assert topk_indices(torch.zeros(10), 4).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("h,w,k", [(16, 16, 13), (12, 20, 7), (1, 16, 5), (16, 1, 3), (5, 7, 35), (32, 32, 100), (3, 3, 8)])
def test_grid_indices_exact_unique_and_spread(h, w, k):
    idx = grid_indices(h, w, k)
    assert idx.numel() == k == idx.unique().numel()
    assert torch.equal(idx, idx.sort().values) and idx.min() >= 0 and idx.max() < h * w
    if k >= 4 and h >= 4 and w >= 4:  # covers both halves in each direction
        assert (idx // w).min() < h / 2 <= (idx // w).max() and (idx % w).min() < w / 2 <= (idx % w).max()


def test_adaptive_budget_stays_in_bounds_and_grows_with_spread():
    n = 256
    peaked = torch.zeros(n)
    peaked[:3] = 1.0
    spread = torch.ones(n)
    lo, hi = adaptive_budget(peaked, 0.05, 0.5), adaptive_budget(spread, 0.05, 0.5)
    assert resolve_count(0.05, n) <= lo < hi <= resolve_count(0.5, n)
    assert lo == 13 and hi == 128


def _blobs(n_objects: int, h: int = 16, w: int = 16) -> torch.Tensor:
    """A relevance map with n_objects 2 x 2 bright blobs on a dim background: [h, w]."""
    rel = torch.full((h, w), 0.1)
    for j in range(n_objects):
        y, x = 1 + 4 * (j // 4), 1 + 4 * (j % 4)
        rel[y : y + 2, x : x + 2] = 0.9
    return rel


def test_relevant_cells_counts_what_the_map_points_at():
    assert relevant_cells(_blobs(1).flatten(), 0.02) == pytest.approx(4, rel=0.01)   # one object, four cells
    assert relevant_cells(_blobs(8).flatten(), 0.02) == pytest.approx(32, rel=0.01)  # eight objects
    assert relevant_cells(torch.zeros(256), 0.02) == pytest.approx(256)               # nothing stands out


def test_spread_budgets_follow_the_map_and_keep_the_budget_on_average():
    maps = [_blobs(n) for n in (1, 1, 2, 8)]
    cells = [relevant_cells(m.flatten(), 0.02) for m in maps]
    ref = calibrate_spread(cells, 0.6, 2.0)
    assert sum(spread_scale(c, ref, 0.6, 2.0) for c in cells) / len(cells) == pytest.approx(1.0, abs=1e-6)

    def kept(cfg):
        out = TokenAllocator(ARRCOCConfig().replace(attending=cfg).attending)(torch.stack(maps), [(16, 16)] * 4, 20)
        return out.budgets.tolist()

    exact = kept({})
    spread = kept({"spread_tau": 0.02, "spread_reference": ref})
    assert exact == [20, 20, 20, 20]                      # off by default: every image keeps its budget
    assert spread[0] == spread[1] < 20 < spread[3] <= 40  # one object: fewer; eight: more, at most twice
    assert abs(sum(spread) / 4 - 20) <= 0.5               # the same tokens in all (up to rounding)


def test_a_budget_is_raised_no_further_than_the_relevant_cells_need():
    cfg = ARRCOCConfig().replace(attending={"spread_tau": 0.02, "spread_reference": 5.0}).attending
    assert spread_count(20, 15.0, cfg) == 30  # x2 would be 40: two tokens per relevant cell are enough
    assert spread_count(20, 4.0, cfg) == 16   # x0.8: fewer cells than the reference, fewer tokens
    assert spread_count(20, 1.0, cfg) == 12   # x0.6 at least
    assert spread_count(20, 9.0, cfg) == 20   # the cap never takes a budget below itself (x1.8 -> 36, cap 18)


def test_calibrate_spread_says_what_it_needs():
    with pytest.raises(ValueError, match="at least one image"):
        calibrate_spread([], 0.6, 2.0)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        calibrate_spread([3.0, 5.0], 1.2, 2.0)
    with pytest.raises(ValueError, match="spread_min"):
        ARRCOCConfig().replace(attending={"spread_min": 1.5})


def test_adaptive_mode_in_the_layer_respects_bounds():
    cfg = ARRCOCConfig().replace(attending={"mode": "adaptive", "min_ratio": 0.1, "max_ratio": 0.3})
    layer = ARRCOCLayer(cfg)
    ims = [scene(boxes=[((56, 56, 111, 111), (220, 40, 40))]), scene(size=(336, 336), noise=30, seed=1)]
    out = layer(ims, [(16, 16), (12, 12)])
    for k, (h, w) in zip(out.budgets.tolist(), out.grid_hw):
        assert resolve_count(0.1, h * w) <= k <= resolve_count(0.3, h * w)


@pytest.mark.parametrize("trained", [False, True], ids=["untrained", "trained-participatory"])
def test_batch_of_two_sizes_with_their_own_budgets_equals_each_alone(layer, trained):
    a = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    b = scene(size=(560, 336), bg=(40, 50, 60), boxes=[((300, 150, 340, 190), (40, 200, 210))])
    g = torch.Generator().manual_seed(0)
    qa, qb = torch.randn(5, 64, generator=g), torch.randn(9, 64, generator=g)
    va, vb = torch.randn(256, 64, generator=g), torch.randn(240, 64, generator=g)
    if trained:  # the zero-initialised participatory weights (incl. the 3x3 context conv) as after training
        with torch.no_grad():
            for module in (layer.participatory.token_proj, layer.participatory.context, layer.participatory.pair_out):
                module.weight.normal_(0.0, 0.3, generator=g)
    both = layer([a, b], [(16, 16), (12, 20)], query_embeds=[qa, qb], visual_tokens=[va, vb], budget=[0.1, 9])
    assert both.budgets.tolist() == [26, 9]
    if trained:  # a budget that follows the question: each image's own relevance decides, whatever its batch
        layer.config.attending.spread_tau = 0.02
        layer.config.attending.spread_reference = 3.0
        both = layer([a, b], [(16, 16), (12, 20)], query_embeds=[qa, qb], visual_tokens=[va, vb], budget=[0.1, 9])
        assert both.budgets.tolist() != [26, 9]
    assert both.keep_mask.shape == (2, 16, 20) and both.keep_mask[1, 12:].sum() == 0
    for i, (im, q, v, hw, bud) in enumerate([(a, qa, va, (16, 16), 0.1), (b, qb, vb, (12, 20), 9)]):
        alone = layer([im], [hw], query_embeds=[q], visual_tokens=[v], budget=bud)
        h, w = hw
        assert torch.equal(both.kept_indices[i], alone.kept_indices[0])
        assert torch.allclose(both.relevance[i, :h, :w], alone.relevance[0], atol=1e-6)
        assert int(both.keep_mask[i].sum()) == both.budgets[i]


def test_output_positions_and_kept_relevance_match_the_kept_indices(layer):
    out = layer([scene(size=(560, 336), boxes=[((56, 56, 111, 111), (220, 40, 40))])], [(12, 20)], budget=0.2)
    idx, pos = out.kept_indices[0], out.positions[0]
    assert torch.equal(pos[:, 0], torch.zeros_like(idx))
    assert torch.equal(pos[:, 1] * 20 + pos[:, 2], idx)
    assert torch.equal(out.kept_relevance[0], out.relevance[0].flatten()[idx])
    # Top-k: every kept cell scores at least as high as every dropped one.
    dropped = out.relevance[0][~out.keep_mask[0]]
    assert out.kept_relevance[0].min() >= dropped.max()


# ---------------------------------------------------------------- learning
def test_gradients_reach_every_learnable_parameter_from_the_relevance_map():
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(16))
    ims = [scene(boxes=[((56, 56, 111, 111), (220, 40, 40))]), scene(bg=(30, 40, 90), noise=5)]
    grids = [(16, 16)] * 2
    tex = torch.cat([generate_texture_array(im, (16, 16)) for im in ims])
    valid = torch.ones(2, 16, 16, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    query, qmask = torch.randn(2, 6, 16, generator=g), torch.ones(2, 6, dtype=torch.bool)
    vis = torch.randn(2, 256, 16, generator=g)
    target = torch.zeros(2, 16, 16)
    target[:, 2:4, 2:4] = 1.0
    params = dict(layer.named_parameters())
    assert len(params) > 10
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    reached = set()
    # Two steps: a zero-initialised output layer (the pair MLP's) passes no gradient to the layer
    # before it until its own weights have moved once; everything else is reached on the first.
    for step in range(2):
        opt.zero_grad()
        rel = layer.score(tex, valid, query, qmask, vis)["relevance"]
        loss = torch.nn.functional.binary_cross_entropy(rel.clamp(1e-4, 1 - 1e-4), target)
        loss.backward()
        now = {n for n, p in params.items() if p.grad is not None and p.grad.abs().sum() > 0}
        if step == 0:
            assert now >= set(params) - {"participatory.pair_query.weight", "participatory.pair_query.bias"}
        reached |= now
        opt.step()
    assert reached == set(params), f"no gradient reaches {sorted(set(params) - reached)}"
    assert grids  # same grids as the forward path uses


# ---------------------------------------------------------------- robustness
@pytest.mark.parametrize(
    "image,grid,fallback",
    [
        (torch.zeros(3, 448, 448), (16, 16), "grid"),  # black
        (torch.ones(3, 448, 448), (16, 16), "grid"),  # white
        (torch.full((3, 448, 448), 0.4), (16, 16), "grid"),  # constant
        (torch.rand(3, 1, 448, generator=torch.Generator().manual_seed(0)), (1, 16), None),  # one pixel tall
        (torch.rand(3, 448, 1, generator=torch.Generator().manual_seed(0)), (16, 1), None),  # one pixel wide
        (torch.rand(3, 1, 1), (1, 1), None),  # one pixel, one cell
    ],
)
def test_degenerate_images_never_crash(layer, image, grid, fallback):
    out = layer([image], [grid], query_embeds=[torch.randn(3, 64)], budget=0.25)
    h, w = grid
    k = out.kept_indices[0]
    assert 1 <= k.numel() <= h * w and k.max() < h * w
    assert torch.isfinite(out.relevance).all()
    if fallback is not None:
        assert out.fallback == [fallback]


def test_nan_pixels_are_sanitised_and_nan_embeddings_keep_all_tokens(layer):
    img = torch.rand(3, 448, 448, generator=torch.Generator().manual_seed(0))
    img[:, :50, :50] = float("nan")
    out = layer([img], [(16, 16)], query_embeds=[torch.randn(3, 64)], budget=0.1)
    assert torch.isfinite(out.texture).all() and out.fallback[0] != "keep_all"
    bad_q = torch.randn(3, 64)
    bad_q[1, 5] = float("nan")
    good = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    out = layer([good, good], [(16, 16)] * 2, query_embeds=[torch.randn(3, 64), bad_q], budget=0.1)
    assert out.fallback == [None, "keep_all"] and "NaN" in out.errors[1]
    assert out.budgets.tolist() == [26, 256]


def test_a_failing_stage_keeps_all_tokens_for_that_image_only(layer):
    good = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    out = layer([good, good], [(16, 16), (16, 16)], query_embeds=[torch.randn(3, 64), torch.randn(3, 32)], budget=0.1)
    assert out.fallback == [None, "keep_all"]
    assert "query_dim" in out.errors[1] and out.errors[0] is None
    assert out.budgets.tolist() == [26, 256]
    strict = ARRCOCLayer(ARRCOCConfig(strict=True))
    with pytest.raises(ValueError, match="with_query_dim"):
        strict([good], [(16, 16)], query_embeds=[torch.randn(3, 32)])


def test_mismatched_inputs_are_rejected_with_a_clear_message(layer):
    with pytest.raises(ValueError, match="one .h, w. per image"):
        layer([torch.rand(3, 448, 448)], [(16, 16), (16, 16)])
    with pytest.raises(ValueError, match="budgets for 1 images"):
        layer([torch.rand(3, 448, 448)], [(16, 16)], budget=[0.1, 0.2])


# ---------------------------------------------------------------- persistence
def test_config_json_round_trip_and_validation():
    cfg = ARRCOCConfig().replace(attending={"budget": 0.1, "mode": "adaptive"}, knowing={"query_dim": 1536})
    again = ARRCOCConfig.from_json(cfg.to_json())
    assert again == cfg and json.loads(again.to_json()) == json.loads(cfg.to_json())
    with pytest.raises(ValueError, match="unknown fields"):
        ARRCOCConfig.from_dict({"attending": {"budgett": 0.1}})
    with pytest.raises(ValueError, match="mode"):
        ARRCOCConfig().replace(attending={"mode": "greedy"})
    with pytest.raises(ValueError, match="texture groups"):
        ARRCOCConfig().replace(texture={"groups": ["rgb", "depth"]})


def test_weights_survive_save_and_load_bit_exactly(tmp_path):
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().replace(attending={"budget": 0.1}))
    with torch.no_grad():  # move away from the initialisation so a silent re-init would show
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    layer.save_pretrained(tmp_path)
    again = ARRCOCLayer.from_pretrained(tmp_path)
    assert again.config == layer.config
    sd1, sd2 = layer.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    im = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    q = [torch.randn(4, 64)]
    assert torch.equal(layer([im], [(16, 16)], query_embeds=q).relevance, again([im], [(16, 16)], query_embeds=q).relevance)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        ARRCOCLayer.from_pretrained(tmp_path / "nowhere")


def test_layers_saved_before_the_later_participatory_weights_load_and_score_as_before(tmp_path):
    from safetensors.torch import load_file, save_file

    from arr_coc.core.persistence import OPTIONAL_PREFIXES

    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(16)).eval()
    im = scene(boxes=[((56, 56, 111, 111), (220, 40, 40))])
    q, vis = [torch.randn(4, 16)], [torch.randn(256, 16)]
    before = layer([im], [(16, 16)], query_embeds=q, visual_tokens=vis, budget=0.1)
    layer.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    old = {k: v for k, v in load_file(weights).items() if not k.startswith(OPTIONAL_PREFIXES)}
    assert len(old) < len(load_file(weights)) - 6  # token_proj, context, pair_query, pair_out: 2 tensors each
    save_file(old, weights)
    again = ARRCOCLayer.from_pretrained(tmp_path)
    after = again([im], [(16, 16)], query_embeds=q, visual_tokens=vis, budget=0.1)
    assert torch.equal(before.relevance, after.relevance) and torch.equal(before.kept_indices[0], after.kept_indices[0])
    # Each of them, once trained, changes the scores; a file missing anything else is refused with the names.
    for name in ("token_proj", "context", "pair_out"):
        fresh = ARRCOCLayer.from_pretrained(tmp_path)
        with torch.no_grad():
            getattr(fresh.participatory, name).weight.normal_()
        assert not torch.equal(fresh([im], [(16, 16)], query_embeds=q, visual_tokens=vis).relevance, after.relevance)
    save_file({k: v for k, v in old.items() if not k.startswith("balancer.")}, weights)
    with pytest.raises(RuntimeError, match="missing.*balancer"):
        ARRCOCLayer.from_pretrained(tmp_path)


def test_output_item_crops_one_image(layer):
    out = layer([torch.rand(3, 448, 448), torch.rand(3, 336, 560)], [(16, 16), (12, 20)], budget=0.1)
    one = out.item(1)
    assert isinstance(one, ARRCOCOutput) and one.relevance.shape == (1, 12, 20) and one.texture.shape[-2:] == (12, 20)
