"""encode="before" with whole Qwen2.5-VL windows (`EncodeConfig.windows`, `--whole-windows`).

Every attention window of the tower that holds a chosen cell is encoded whole; the window's other cells are
context (encoded, not read by the language model), like the margin. What a user would notice: a chosen cell's
window layer not exact (its window was cut), windows taken from the packed sequence instead of the full grid
(the padded partial windows at the bottom / right edges are where that goes wrong), context cells the cost
counters miss, a model without windows accepting the option, or the option missing from a command.
"""

from __future__ import annotations

import re

import copy
import json

import numpy as np
import pytest
import torch
from PIL import Image

from arr_coc.__main__ import main
from arr_coc.encode import EncodeConfig
from arr_coc.qwen.encoding import cells_to_encode, dilate, encode_cells

Q = "What color is the star?"
REFUSAL = "Qwen2.5-VL only"


@pytest.fixture(scope="module")
def windowed():
    """`windowed(window_size) -> ARRCOCQwen`: tiny Qwen2.5-VL (first block windowed) with peaked vision attention
    (tiny random weights attend almost uniformly, so a cut window could pass unnoticed). window_size 56 px is
    2 x 2 merged cells (the tiny default), 112 px is 4 x 4 (the real Qwen2.5-VL towers')."""
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.qwen.tiny import build_tiny_qwen

    cache = {}

    def get(window_size: int = 56):
        if window_size not in cache:
            model, processor = build_tiny_qwen("qwen2_5_vl", seed=0, vision_config={"window_size": window_size})
            model = copy.deepcopy(model)
            with torch.no_grad():
                for blk in model.model.visual.blocks:
                    blk.attn.qkv.weight.mul_(40.0)
            cache[window_size] = ARRCOCQwen(model, processor)
        return cache[window_size]

    return get


def _noise(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def brute_windows(chosen: torch.Tensor, grid_hw: tuple[int, int], side: int) -> set[int]:
    """The cells sharing a window with any chosen cell, from the config alone: windows are `side` x `side` merged
    cells tiled from the top-left corner, the last row / column of windows cut by the image's edge."""
    h, w = grid_hw
    wanted = {(int(c) // w // side, int(c) % w // side) for c in chosen}
    return {r * w + c for r in range(h) for c in range(w) if (r // side, c // side) in wanted}


def brute_margin(chosen: torch.Tensor, grid_hw: tuple[int, int], rings: int) -> set[int]:
    h, w = grid_hw
    pts = [(int(c) // w, int(c) % w) for c in chosen]
    return {r * w + c for r in range(h) for c in range(w)
            if any(max(abs(r - a), abs(c - b)) <= rings for a, b in pts)}


def _side(vlm) -> int:
    cfg = vlm.model.config.vision_config
    return cfg.window_size // cfg.patch_size // cfg.spatial_merge_size


# ------------------------------------------------------------------------------- exactness of the window layer
@pytest.mark.parametrize("window_size", [56, 112])
def test_whole_windows_make_the_first_window_layer_exact_for_scattered_cells(windowed, window_size):
    """Chosen cells scattered over the grid (none of them a whole window), 10 x 7 cells (not divisible by 2 or 4):
    with windows=True every chosen cell's hidden state after the first (window-attention) block equals the full
    encoding's, max |diff| 0.0 measured on this CPU (float32); the assertion allows 1e-6 of GEMM round-off.
    Cells only (windows=False): the same cells' windows are cut, and the states differ by far more."""
    from transformers.vision_utils import get_vision_window_index

    vlm = windowed(window_size)
    visual = vlm.model.model.visual
    assert 0 not in visual.fullatt_block_indexes, "the test needs a window-attention first block"
    inputs = vlm.build_inputs([[_noise(280, 196)]], [Q])
    grid = inputs["image_grid_thw"]
    h, w = int(grid[0, 1]) // 2, int(grid[0, 2]) // 2
    assert (h, w) == (10, 7)
    chosen = torch.tensor([0, 9, 23, 40, h * w - 1])        # corners, the middle, the cut bottom-right window
    stock_index, _ = get_vision_window_index(grid, 2, visual.window_size, visual.patch_size)
    stock_place = torch.argsort(stock_index)                # cell -> its 4-patch block in the stock window order

    blocks, orders = [], []
    h1 = visual.blocks[0].register_forward_hook(lambda m, a, out: blocks.append(out[0] if isinstance(out, tuple)
                                                                                else out))
    h2 = visual.register_forward_pre_hook(lambda m, a, kw: orders.append(kw.get("window_index")), with_kwargs=True)
    try:
        with torch.no_grad():
            visual(inputs["pixel_values"], grid_thw=grid)   # the stock, full encoding
        diffs = {}
        for windows in (True, False):
            encoded = cells_to_encode(vlm.model, grid, [(h, w)], [chosen], EncodeConfig("before", windows=windows))[0]
            encode_cells(vlm.model, inputs["pixel_values"], grid, [encoded])
            place = torch.argsort(orders[-1])               # packed cell -> its block in the packed window order
            packed = blocks[-1].view(-1, 4, blocks[-1].shape[-1])[place[torch.searchsorted(encoded, chosen)]]
            stock = blocks[0].view(-1, 4, blocks[0].shape[-1])[stock_place[chosen]]
            diffs[windows] = (packed - stock).abs().max().item()
    finally:
        h1.remove()
        h2.remove()
    assert diffs[True] <= 1e-6, diffs
    assert diffs[False] > 1e-2, diffs                      # negative control (measured ~1.8)


# ------------------------------------------------------------------------------- which cells are encoded
@pytest.mark.parametrize("window_size", [56, 112])
def test_the_encoded_set_is_the_union_of_the_chosen_cells_windows(windowed, window_size):
    """Against a brute-force window assignment from the config, edge windows included (10 x 7 and 5 x 9 cells,
    a batch of two images), for random chosen sets; with a margin, the union of both."""
    vlm = windowed(window_size)
    side = _side(vlm)
    assert side == window_size // 28
    inputs = vlm.build_inputs([[_noise(280, 196, 0)], [_noise(140, 252, 1)]], [Q, Q])
    grid = inputs["image_grid_thw"]
    grids = [(int(h) // 2, int(w) // 2) for _, h, w in grid.tolist()]
    assert grids == [(10, 7), (5, 9)]
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        chosen = [torch.randperm(h * w, generator=gen)[: 1 + trial].sort().values for h, w in grids]
        got = cells_to_encode(vlm.model, grid, grids, chosen, EncodeConfig("before", windows=True))
        both = cells_to_encode(vlm.model, grid, grids, chosen, EncodeConfig("before", windows=True, margin=1))
        for c, g, e, u in zip(chosen, grids, got, both):
            assert e.tolist() == sorted(brute_windows(c, g, side))
            assert u.tolist() == sorted(brute_windows(c, g, side) | brute_margin(c, g, 1))
    # the bottom-right cell's window is the cut one: rows and columns past the edge are not cells
    corner = cells_to_encode(vlm.model, grid[:1], grids[:1], [torch.tensor([69])], EncodeConfig("before",
                                                                                                 windows=True))[0]
    rows, cols = 10 - 10 // side * side or side, 7 - 7 // side * side or side
    assert corner.numel() == rows * cols and corner.numel() < side * side
    # cells only (the default) and the margin alone are unchanged
    assert cells_to_encode(vlm.model, grid, grids, chosen, EncodeConfig("before"))[0].tolist() == chosen[0].tolist()
    assert torch.equal(cells_to_encode(vlm.model, grid, grids, chosen, EncodeConfig("before", margin=1))[1],
                       dilate(chosen[1], grids[1], 1))


def test_the_wrapper_encodes_the_windows_and_the_lm_reads_only_the_chosen(windowed):
    vlm = windowed(112)
    inputs = vlm.build_inputs([[_noise(280, 196)]], [Q])
    chosen = torch.tensor([5, 33, 64])
    pruned, (tr,) = vlm.prepare(inputs, kept_indices=[chosen], encode=EncodeConfig("before", windows=True)).outputs
    assert tr.encoded_cells[0].tolist() == sorted(brute_windows(chosen, (10, 7), 4))
    assert tr.kept_tokens == 3 == pruned.image_features[0].shape[0]        # the context never reaches the LM
    d = tr.to_dict()
    assert d["encoded_per_image"] == [tr.encoded_cells[0].numel()] and d["margin_per_image"] == [
        tr.encoded_cells[0].numel() - 3]
    codes = tr.resolution(0)                                                 # 3 = "full resolution, not read"
    assert (codes == 3).sum() == tr.encoded_cells[0].numel() - 3 and (codes == 4).sum() == 3


# ------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_towers_without_windows_refuse_before_any_encoding(tiny_vlm, family):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm(family)
    vlm = ARRCOCQwen(model, processor)
    inputs = vlm.build_inputs([[_noise(112, 112)]], [Q])
    calls = []
    hook = model.model.visual.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=REFUSAL) as err:       # a gist would be the first tower call
            vlm.prepare(inputs, budget=0.25, encode=EncodeConfig("before", gist=0.25, windows=True))
    finally:
        hook.remove()
    assert calls == [] and "--margin 1" in str(err.value) and family in str(err.value)
    with pytest.raises(ValueError, match=REFUSAL):                  # the library path below the wrapper too
        cells_to_encode(model, inputs["image_grid_thw"], [(4, 4)], [torch.tensor([0])],
                        EncodeConfig("before", windows=True))


def test_whole_windows_need_encode_before(tmp_path, capsys):
    import argparse

    from arr_coc.cli.args import add_encode, encode_config

    with pytest.raises(ValueError, match="mode='before'"):
        EncodeConfig("after", windows=True)
    parser = argparse.ArgumentParser()
    add_encode(parser)                                               # ask's and eval's --encode options
    assert encode_config(parser.parse_args(["--encode", "before", "--whole-windows"])).windows
    with pytest.raises(SystemExit) as refused:                      # an input error: exit 2, one line
        encode_config(parser.parse_args(["--whole-windows"]))
    assert refused.value.code == 2 and "--encode before" in capsys.readouterr().err
    # bench: the tiny Qwen2-VL preset has no windows; margin / windows rows need a before mode to add to
    for argv, says in ((["--preset", "tiny", "--encode", "before", "--whole-windows"], REFUSAL),
                       (["--preset", "tiny-qwen2.5", "--encode", "after", "--whole-windows"], "--encode before")):
        assert main(["bench", *argv, "--repeats", "1", "--out", str(tmp_path / "b.json")]) == 2
        assert says in capsys.readouterr().err


def test_the_lmms_eval_model_refuses_windows_on_a_tower_without_them(tmp_path):
    pytest.importorskip("lmms_eval")
    from arr_coc.harness.lmms_eval import ARRCOCLmms
    from arr_coc.qwen.tiny import build_tiny_qwen

    with pytest.raises(ValueError, match="mode='before'"):          # before anything loads
        ARRCOCLmms.create_from_arg_string("pretrained=nowhere,whole_windows=true", {"batch_size": 1})
    for family in ("qwen2_vl", "qwen2_5_vl"):
        model, processor = build_tiny_qwen(family, seed=0)
        model.save_pretrained(tmp_path / family)
        processor.save_pretrained(str(tmp_path / family))
        args = f"pretrained={tmp_path / family},encode=before,whole_windows=true,device=cpu"
        if family == "qwen2_vl":
            with pytest.raises(ValueError, match=REFUSAL):
                ARRCOCLmms.create_from_arg_string(args, {"batch_size": 1})
        else:
            assert ARRCOCLmms.create_from_arg_string(args, {"batch_size": 1}).encode.windows


# ------------------------------------------------------------------------------- the commands, end to end
@pytest.fixture(scope="module")
def qwen25_dir(tmp_path_factory) -> str:
    from _app_server import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl"))


def test_ask_with_whole_windows_encodes_context_the_lm_does_not_read(qwen25_dir, tmp_path, capsys, make_image):
    image = tmp_path / "img.png"
    make_image(196, 280, seed=3).save(image)
    got = {}
    for extra in ([], ["--whole-windows"]):
        assert main(["ask", "--model", qwen25_dir, "--image", str(image), "--question", "What colour is the circle?",
                     "--budget", "0.1", "--encode", "before", *extra, "--max-new-tokens", "2", "--json"]) == 0
        got[bool(extra)] = json.loads(capsys.readouterr().out)
    cells, windows = got[False], got[True]
    assert windows["kept_tokens"] == cells["kept_tokens"] == cells["encoded_tokens"] < windows["encoded_tokens"]


def test_eval_with_whole_windows_counts_the_context_in_the_vision_flops(qwen25_dir, tmp_path):
    from arr_coc_shapes import write_split

    split = write_split(tmp_path / "d", split="test", n=3, seed=0)
    rows = {}
    for extra in ([], ["--whole-windows"]):
        out = tmp_path / f"r{len(extra)}.json"
        assert main(["eval", "--model", qwen25_dir, "--data", str(split), "--methods", "arr_coc", "--budgets", "0.1",
                     "--encode", "before", *extra, "--out", str(out), "--quiet"]) == 0
        report = json.loads(out.read_text())
        assert report["encode"]["windows"] is bool(extra)
        rows[bool(extra)] = report["results"][0]
    cells, windows = rows[False], rows[True]
    assert cells["status"] == windows["status"] == "ok" and cells["kept_tokens_mean"] == windows["kept_tokens_mean"]
    assert windows["prefill_flops_mean"] == cells["prefill_flops_mean"]      # the LM reads the same tokens
    assert windows["vision_flops_mean"] > cells["vision_flops_mean"]         # the tower encodes the windows too


# ------------------------------------------------------------------------------- bench
def test_bench_measures_cells_margin_and_whole_windows_side_by_side(tmp_path):
    from arr_coc.evaluation.bench_presets import PRESETS, build_model
    from arr_coc.evaluation.cost import vision_flops
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.evaluation.scenes import bench_scene
    from arr_coc.runtime import Runtime

    out = tmp_path / "b.json"
    assert main(["bench", "--preset", "tiny-qwen2.5", "--encode", "before", "--budgets", "0.25", "--margin", "1",
                 "--whole-windows", "--repeats", "1", "--out", str(out), "--markdown", str(tmp_path / "b.md")]) == 0
    report = json.loads(out.read_text())
    rows = {(r["encode"], r["budget"], r["margin"], r["windows"]): r for r in report["results"]}
    assert set(rows) == {("after", 1.0, 0, False), ("before", 1.0, 0, False), ("before", 0.25, 0, False),
                         ("before", 0.25, 1, False), ("before", 0.25, 0, True), ("before", 0.25, 1, True)}
    cells, margin, windows, both = (rows[("before", 0.25, m, w)] for m, w in ((0, False), (1, False), (0, True),
                                                                             (1, True)))
    assert cells["visual_tokens"] == margin["visual_tokens"] == windows["visual_tokens"] == both["visual_tokens"]
    assert cells["encoded_tokens"] == cells["visual_tokens"]
    assert max(margin["encoded_tokens"], windows["encoded_tokens"]) <= both["encoded_tokens"] < 144
    assert cells["encoded_tokens"] < min(margin["encoded_tokens"], windows["encoded_tokens"])
    for r in (margin, windows, both):
        assert r["prefill_flops"] == cells["prefill_flops"] and r["vision_flops"] > cells["vision_flops"]
        assert cells["e2e_flops_share"] < r["e2e_flops_share"] < 1
    md = (tmp_path / "b.md").read_text()
    assert "| before, whole windows | 25% |" in md and "before, margin 1, whole windows 25%" in md
    # eval's vision cost counts the same tower calls, context included
    model, processor, _ = build_model(PRESETS["tiny-qwen2.5"], 2, 2, Runtime.resolve("cpu", "float32"))
    vlm = ARRCOCQwen(model, processor)
    image, question = bench_scene(0, 0, 336)           # the bench's own picture
    inputs = vlm.build_inputs([[image]], [question])
    _, traces = vlm.prepare(inputs, budget=0.25, encode=EncodeConfig("before", windows=True)).outputs
    assert traces[0].encoded_cells[0].numel() == windows["encoded_tokens"]
    assert vision_flops(vlm.backend, _prompt(vlm, inputs), traces, 0.0, {}) == [windows["vision_flops"]]


def test_ask_and_eval_refuse_whole_windows_on_a_tower_without_windows(tmp_path, capsys, make_image):
    from _app_server import save_tiny_model
    from arr_coc_shapes import write_split

    save_tiny_model(tmp_path / "m")
    image = tmp_path / "img.png"
    make_image(112, 112, seed=1).save(image)
    assert main(["ask", "--model", str(tmp_path / "m"), "--image", str(image), "--question", "What colour is it?",
                 "--encode", "before", "--whole-windows"]) == 2
    assert re.search("Qwen2.5-VL only.*--margin 1", capsys.readouterr().err)
    split = write_split(tmp_path / "d", split="test", n=2, seed=0)
    assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(split), "--methods", "arr_coc",
                 "--encode", "before", "--whole-windows", "--out", str(tmp_path / "r.json"), "--quiet"]) == 2
    assert "Qwen2.5-VL only" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def _prompt(vlm, inputs):
    """The prompt of `inputs` as the pipeline reads it (no tower): what the evaluation's cost counts against."""
    return vlm.backend.read_prompt(inputs, encode_all=False)
