"""The extent head: how many cells a question needs, which a question-following budget scales by."""

from __future__ import annotations

import math

import pytest
import torch

from arr_coc import ARRCOCConfig, ARRCOCLayer
from arr_coc.core.attending import TokenAllocator
from arr_coc.core.extent import N_MAP_FEATURES, ExtentHead, fit_extent_head, map_features

QUERY_DIM = 8


def _planted(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [n, QUERY_DIM + N_MAP_FEATURES] and answer cells that are exactly log-linear in them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, QUERY_DIM + N_MAP_FEATURES, generator=g) * 3 + 1
    w = torch.rand(x.shape[1], generator=g) * 0.1  # log(1 + cells) > 0: no count below zero to clamp
    return x, torch.expm1(x @ w + 0.5)


def test_the_fit_recovers_a_planted_relation_and_fails_on_shuffled_answers():
    x, cells = _planted(400, seed=0)
    head = ExtentHead(QUERY_DIM)
    assert fit_extent_head(head, x, cells, ridge=1e-6) > 0.99999
    keep = cells >= 1  # predictions are clamped to at least one cell
    assert torch.allclose(head.predict(x)[keep], cells[keep], rtol=1e-3)
    shuffled = cells[torch.randperm(len(cells), generator=torch.Generator().manual_seed(1))]
    assert fit_extent_head(ExtentHead(QUERY_DIM), x, shuffled) < 0.2  # negative control: nothing to learn


def test_the_fit_says_what_it_needs():
    with pytest.raises(ValueError, match="at least two items"):
        fit_extent_head(ExtentHead(QUERY_DIM), torch.zeros(1, QUERY_DIM + N_MAP_FEATURES), torch.ones(1))


def test_map_features_read_each_image_on_its_own_grid():
    rel = torch.zeros(2, 6, 6)
    rel[0, :4, :4] = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    rel[1] = torch.rand(6, 6, generator=torch.Generator().manual_seed(1))
    valid = torch.zeros(2, 6, 6, dtype=torch.bool)
    valid[0, :4, :4] = True
    valid[1] = True
    both = map_features(rel, valid)
    alone = map_features(rel[:1, :4, :4], valid[:1, :4, :4])
    assert torch.equal(both[:1], alone)  # the padding is not read
    assert both[0, len((0.01, 0.02, 0.05, 0.1))] == pytest.approx(math.log(16))
    # A peaked map reads fewer cells than a flat one at every temperature.
    peaked, flat = torch.zeros(1, 6, 6), torch.full((1, 6, 6), 0.5)
    peaked[0, 2, 3] = 1.0
    ones = torch.ones(1, 6, 6, dtype=torch.bool)
    assert (map_features(peaked, ones)[0, :4] < map_features(flat, ones)[0, :4]).all()


def test_mean_budgets_follow_the_given_cells_and_keep_the_budget_on_average():
    rel = torch.rand(4, 16, 16, generator=torch.Generator().manual_seed(0))  # the same kind of map for all
    cfg = ARRCOCConfig().replace(attending={"spread_tau": 0.02, "spread_reference": 6.0, "spread_per_cell": 1e9})
    alloc = TokenAllocator(cfg.attending)
    by_extent = alloc(rel, [(16, 16)] * 4, 20, budget_mode="mean", cells=torch.tensor([2.0, 4.0, 8.0, 10.0]))
    assert by_extent.budgets.tolist() == [12, 13, 27, 33]  # x0.6 (clipped), x2/3, x4/3, x5/3 of 20
    by_map = alloc(rel, [(16, 16)] * 4, 20, budget_mode="mean")  # negative control: the maps' perplexity
    assert by_map.budgets.tolist() != by_extent.budgets.tolist()


def test_a_layer_with_an_extent_head_saves_loads_and_allocates_by_it(tmp_path, make_image):
    cfg = ARRCOCConfig().replace(attending={"spread_tau": 0.02, "spread_reference": 20.0, "spread_source": "extent"})
    layer = ARRCOCLayer(cfg).eval()
    assert ARRCOCLayer(ARRCOCConfig()).extent is None  # layers that count by perplexity carry no head
    with torch.no_grad():  # a head that reads only the grid's size: log(1 + cells) = 0.5 * log(cells of the grid)
        layer.extent.weight[cfg.knowing.query_dim + 4] = 0.5
    images = [make_image(224, 224, seed=0), make_image(448, 448, seed=1)]
    grids = [(8, 8), (16, 16)]
    out = layer(images, grids, budget=0.25, budget_mode="mean")
    # 8 x 8: sqrt(64) - 1 = 7 cells -> x0.6 (7 / 20, clipped) of 16; 16 x 16: 15 cells -> x0.75 of 64
    assert out.budgets.tolist() == [10, 48]
    layer.save_pretrained(tmp_path)
    again = ARRCOCLayer.from_pretrained(tmp_path).eval()
    assert again.config.attending.spread_source == "extent"
    same = again(images, grids, budget=0.25, budget_mode="mean")
    assert [k.tolist() for k in same.kept_indices] == [k.tolist() for k in out.kept_indices]
