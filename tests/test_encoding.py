"""Selecting before encoding: the vision tower on the chosen cells only, at their true positions.

Exactness where the maths says so (every cell chosen; whole Qwen2.5-VL windows), negative controls
that make those tests fail (positions from the packed order, windows computed on the packed sequence,
Qwen3-VL position embeddings interpolated for the packed size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from arr_coc.encode import EncodeConfig
from arr_coc.qwen.encoding import dilate, encode_cells

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
Q = "What color is the star?"


def _sharp(model):
    """A copy whose vision attention is peaked: tiny random weights attend almost uniformly, so the
    tokens would barely depend on positions and a wrong position could pass unnoticed."""
    import copy

    model = copy.deepcopy(model)
    with torch.no_grad():
        for blk in model.model.visual.blocks:
            blk.attn.qkv.weight.mul_(40.0)
    return model


def _inputs(tiny_vlm, make_image, family, attn="sdpa", sizes=((120, 150), (90, 200))):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm(family, attn)
    vlm = ARRCOCQwen(_sharp(model), processor)
    # noise, not flat shapes: identical flat patches would make every attention pattern look the same
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for h, w in sizes]
    inputs = vlm.build_inputs([[im] for im in images], [Q] * len(images))
    return vlm, inputs


def _stock(vlm, inputs):
    enc = vlm.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    deep = getattr(enc, "deepstack_features", None)
    return list(enc.pooler_output), deep


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_cell_chosen_reproduces_the_stock_encoding(tiny_vlm, make_image, family, attn):
    vlm, inputs = _inputs(tiny_vlm, make_image, family, attn)
    stock, stock_deep = _stock(vlm, inputs)
    cells = [torch.arange(f.shape[0]) for f in stock]
    feats, deep = encode_cells(vlm.model, inputs["pixel_values"], inputs["image_grid_thw"], cells)
    for a, b in zip(feats, stock):
        assert torch.equal(a, b)                    # max |diff| 0.0: the same kernels on the same rows
    if family == "qwen3_vl":
        for i, per_layer in enumerate(deep):
            for layer, ref in zip(per_layer, stock_deep):   # stock: per layer, a tuple over images
                assert torch.equal(layer, ref[i])
    else:
        assert deep is None


def test_whole_windows_are_exact_after_a_window_layer_on_qwen2_5_vl(tiny_vlm, make_image):
    """Keep whole full-grid windows: every window-attention layer sees exactly its stock inputs, so the
    hidden states after the first (window) layer equal the stock encoding's on those patches."""
    vlm, inputs = _inputs(tiny_vlm, make_image, "qwen2_5_vl", sizes=((224, 224),))
    visual = vlm.model.model.visual
    assert 0 not in visual.fullatt_block_indexes, "the test needs a window-attention first block"
    grid = inputs["image_grid_thw"]
    from transformers.vision_utils import get_vision_window_index

    window_index, cu = get_vision_window_index(grid, visual.spatial_merge_size, visual.window_size, visual.patch_size)
    bounds = (cu.long() // 4).tolist()
    first_window = window_index[bounds[0]:bounds[1]].sort().values       # the cells of window 0

    captured = {}

    def grab(module, args, kwargs, output):
        captured.setdefault("h", []).append(output[0] if isinstance(output, tuple) else output)

    handle = visual.blocks[0].register_forward_hook(grab, with_kwargs=True)
    try:
        visual(inputs["pixel_values"], grid_thw=grid)                    # stock, window order
        encode_cells(vlm.model, inputs["pixel_values"], grid, [first_window])
    finally:
        handle.remove()
    stock_h, packed_h = captured["h"]
    n = first_window.numel() * 4
    # in window order the first window's patches come first in both runs
    assert torch.allclose(stock_h[:n], packed_h[:n], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_negative_control_positions_from_the_packed_order_change_the_features(tiny_vlm, make_image, family):
    """If the tower were given the packed sequence as if it were a small image (positions, windows and
    Qwen3-VL's interpolated embeddings computed for the packed size), a subset's features would differ."""
    vlm, inputs = _inputs(tiny_vlm, make_image, family, sizes=((224, 224),))
    n = int(inputs["image_grid_thw"][0, 1] * inputs["image_grid_thw"][0, 2]) // 4
    chosen = torch.tensor([0, 1, 5, 9, 10, n - 1])
    ours, _ = encode_cells(vlm.model, inputs["pixel_values"], inputs["image_grid_thw"], [chosen])
    rows = (4 * chosen[:, None] + torch.arange(4)).reshape(-1)
    naive_grid = torch.tensor([[1, 2, 2 * chosen.numel()]])                 # the packed cells as a 1 x K image
    naive = vlm.model.model.visual(inputs["pixel_values"][rows], grid_thw=naive_grid).pooler_output
    assert (ours[0] - naive).abs().max() > 1e-5   # far above round-off (every-cell runs are bit-equal)
    alone = encode_cells(vlm.model, inputs["pixel_values"], inputs["image_grid_thw"], [chosen[:3]])[0][0]
    assert (alone - ours[0][:3]).abs().max() > 1e-5   # context matters: fewer cells, other tokens


def test_dilate_and_config_checks():
    assert dilate(torch.tensor([5]), (4, 4), 1).tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert dilate(torch.tensor([3, 0]), (4, 4), 0).tolist() == [0, 3]
    with pytest.raises(ValueError, match="encode mode"):
        EncodeConfig(mode="during")
    with pytest.raises(ValueError, match="needs gist"):
        EncodeConfig(mode="before", gist=0.0, periphery=True)
    for extra in ({"gist": 0.25}, {"margin": 1}):         # once silently ignored by ask/eval with --encode after
        with pytest.raises(ValueError, match="mode='before'"):
            EncodeConfig(mode="after", **extra)
    import argparse

    from arr_coc.cli.args import add_encode, encode_config

    parser = argparse.ArgumentParser()
    add_encode(parser)                                               # ask's and eval's --encode options
    assert encode_config(parser.parse_args(["--encode", "before", "--margin", "1"])).margin == 1
    for argv in (["--margin", "1"], ["--gist", "0.25"]):              # exit 2 with one line, as argparse's errors
        with pytest.raises(SystemExit) as info:
            encode_config(parser.parse_args(argv))
        assert info.value.code == 2


# --------------------------------------------------------------- encode="before" through the wrapper
def _noise_vlm(tiny_vlm, family, attn="sdpa"):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm(family, attn)
    return ARRCOCQwen(_sharp(model), processor)


def _noise(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_before_with_every_cell_and_no_gist_gives_todays_logits(tiny_vlm, family, attn):
    from arr_coc.encode import EncodeConfig

    vlm = _noise_vlm(tiny_vlm, family, attn)
    inputs = vlm.build_inputs([[_noise(120, 150, 0)], [_noise(90, 200, 1)]], [Q, "How many stars are there?"])
    after = vlm.backend.prefill(vlm.prepare(inputs, method="none").pruned).logits
    pruned, traces = vlm.prepare(inputs, method="none", encode=EncodeConfig("before", gist=0.0)).outputs
    assert torch.equal(vlm.backend.prefill(pruned).logits, after)            # max |diff| 0.0, deepstack included
    assert traces[0].encode == "before" and traces[0].gist_grid == []
    assert [c.numel() for c in traces[0].encoded_cells] == traces[0].total_per_image


@pytest.mark.parametrize("family", FAMILIES)
def test_before_encodes_only_the_chosen_cells_and_the_margin(tiny_vlm, family):
    from arr_coc.encode import EncodeConfig

    vlm = _noise_vlm(tiny_vlm, family)
    inputs = vlm.build_inputs([[_noise(224, 224, 0)]], [Q])
    for margin in (0, 1):
        pruned, (tr,) = vlm.prepare(inputs, budget=0.25, encode=EncodeConfig("before", gist=0.25, margin=margin)).outputs
        kept, encoded = tr.kept_indices[0], tr.encoded_cells[0]
        assert tr.kept_tokens == kept.numel() < tr.total_tokens and tr.gist_grid == [(4, 4)]   # 8 x 8 -> a quarter
        assert set(kept.tolist()) <= set(encoded.tolist())
        assert (encoded.numel() == kept.numel()) == (margin == 0)
        assert pruned.image_features[0].shape[0] == kept.numel()    # the margin never reaches the LM


def test_before_batch_of_two_sizes_and_budgets_equals_each_alone(tiny_vlm):
    vlm = _noise_vlm(tiny_vlm, "qwen2_vl")
    a, b = _noise(120, 150, 0), _noise(224, 168, 1)
    answers, traces = vlm.generate([a, b], [Q, "How many stars are there?"], budget=[0.25, 3], encode="before",
                                   max_new_tokens=3)
    for img, q, budget, ans, tr in zip((a, b), (Q, "How many stars are there?"), (0.25, 3), answers, traces):
        alone, tr1 = vlm.generate(img, q, budget=budget, encode="before", max_new_tokens=3)
        assert alone == ans and torch.equal(tr1.kept_indices[0], tr.kept_indices[0])
        assert torch.equal(tr1.encoded_cells[0], tr.encoded_cells[0])


def test_periphery_adds_gist_tokens_for_the_regions_not_encoded(tiny_vlm):
    from arr_coc.encode import EncodeConfig

    vlm = _noise_vlm(tiny_vlm, "qwen2_vl")
    inputs = vlm.build_inputs([[_noise(336, 336, 2)]], [Q])
    _, (plain,) = vlm.prepare(inputs, budget=3, method="grid", encode=EncodeConfig("before", gist=0.25)).outputs
    pruned, (tr,) = vlm.prepare(inputs, budget=3, method="grid", encode=EncodeConfig("before", gist=0.25,
                                                                                      periphery=True)).outputs
    periphery = tr.periphery_cells[0]
    assert periphery.numel() > 0 and not set(periphery.tolist()) & set(plain.kept_indices[0].tolist())
    assert tr.kept_tokens == plain.kept_tokens + periphery.numel() == pruned.image_features[0].shape[0]


def test_methods_that_read_encoded_tokens_refuse_to_choose_before_the_tower(tiny_vlm):
    vlm = _noise_vlm(tiny_vlm, "qwen2_vl")
    inputs = vlm.build_inputs([[_noise(120, 150, 0)]], [Q])
    for method in ("fastv", "divprune", "visionzip", "cdpruner"):
        with pytest.raises(ValueError, match="encode='after'"):
            vlm.prepare(inputs, budget=0.25, method=method, encode="before")


def test_a_failing_gist_falls_back_for_that_image_only(tiny_vlm, monkeypatch):
    from arr_coc.pipeline import fovea

    vlm = _noise_vlm(tiny_vlm, "qwen2_vl")
    a, b = _noise(120, 150, 0), _noise(224, 168, 1)
    real = fovea.encode_gist
    bad_size = tuple(vlm.build_inputs([[b]], [Q])["image_grid_thw"][0].tolist())

    def flaky(backend, prompt, share, units=None):
        units = range(len(prompt.grid_hw)) if units is None else units
        if any(tuple(prompt.grid_hw[i]) == (bad_size[1] // 2, bad_size[2] // 2) for i in units):
            raise RuntimeError("gist exploded")
        return real(backend, prompt, share, units)

    monkeypatch.setattr(fovea, "encode_gist", flaky)
    _, traces = vlm.generate([a, b], [Q, Q], budget=0.25, encode=EncodeConfig("before", gist=0.25), max_new_tokens=1)
    assert traces[0].fallback[0] != "keep_all" and traces[0].kept_tokens < traces[0].total_tokens
    assert traces[1].fallback == ["keep_all"] and "gist exploded" in traces[1].error
    assert traces[1].kept_tokens == traces[1].total_tokens


# --------------------------------------------------------------- cost, counted with the tower's attention
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_flop_counter_counts_the_vision_towers_attention(tiny_vlm, attn):
    """FLOPs(n patches) = a*n + b*n^2 exactly; b must be the attention's 2 * 2 * d per layer (QK^T and AV),
    which a counter blind to the CPU flash kernel would report as 0."""
    from arr_coc.evaluation.flops import count_flops

    vlm = _noise_vlm(tiny_vlm, "qwen2_vl", attn)
    visual = vlm.model.model.visual
    flops = {}
    for side in (112, 224):
        inputs = vlm.build_inputs([[_noise(side, side, 0)]], [Q])
        n = int(inputs["image_grid_thw"].prod())
        flops[n] = count_flops(visual, inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])[1]
    (n1, f1), (n2, f2) = sorted(flops.items())
    quadratic = (f2 * n1 - f1 * n2) / (n1 * n2 * (n2 - n1))
    cfg = visual.config
    assert quadratic == 2 * 2 * cfg.embed_dim * cfg.depth


def test_eval_reports_vision_and_end_to_end_flops_per_mode(tmp_path):
    """On a tiny model: `eval --encode before` spends less of the vision tower on the methods that choose
    before encoding; FastV (it reads the encoded tokens) runs after and says so."""
    import json

    from arr_coc.cli import main
    from arr_coc.qwen.tiny import build_tiny_qwen
    from arr_coc_shapes import write_split

    model, processor = build_tiny_qwen("qwen2_vl", seed=0)
    model.save_pretrained(tmp_path / "m")
    processor.save_pretrained(str(tmp_path / "m"))
    split = write_split(tmp_path / "d", split="test", n=6, seed=0)
    rows = {}
    for mode in ("after", "before"):
        out = tmp_path / f"{mode}.json"
        assert main(["eval", "--model", str(tmp_path / "m"), "--data", str(split), "--methods", "none,arr_coc,fastv",
                     "--budgets", "0.1", "--encode", mode, "--out", str(out), "--quiet"]) == 0
        rows[mode] = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    after, before = rows["after"], rows["before"]
    assert before["arr_coc"]["encode"] == "before" and before["fastv"]["encode"] == "after"
    assert before["arr_coc"]["vision_flops_mean"] < 0.5 * after["arr_coc"]["vision_flops_mean"]
    assert after["arr_coc"]["vision_flops_mean"] == after["none"]["vision_flops_mean"] > 0
    for r in (after["arr_coc"], before["arr_coc"], before["fastv"]):
        assert r["e2e_flops_mean"] == pytest.approx(r["vision_flops_mean"] + r["prefill_flops_mean"])
