"""Shape cues in the texture array (silhouette, orientation) and widening a trained layer to read them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image, ImageDraw

from arr_coc.core.config import SHAPE_GROUPS, TEXTURE_GROUPS, ARRCOCConfig, TextureConfig
from arr_coc.core.layer import ARRCOCLayer
from arr_coc.core.texture import channel_names, generate_texture_array
from arr_coc.training.losses import ranking_loss
from arr_coc.training.widen import CHANNEL_INPUTS, widen_texture

SHAPE_CFG = TextureConfig(groups=SHAPE_GROUPS)
GRID = (4, 4)  # 112 px, 28 px cells


def _texture(draw) -> dict[str, torch.Tensor]:
    image = Image.new("RGB", (112, 112), (235, 235, 235))
    draw(ImageDraw.Draw(image))
    tex = generate_texture_array(image, GRID, SHAPE_CFG)[0]  # [C, 4, 4]
    return dict(zip(channel_names(SHAPE_CFG), tex))


def test_orientation_tells_slanted_sides_from_upright_ones():
    # A triangle's left side rises ("/") through cell (0, 1), its right side falls ("\") through (0, 2);
    # a square's sides are vertical and horizontal.
    tri = _texture(lambda d: d.polygon([(56, 2), (2, 110), (110, 110)], fill=(200, 30, 30)))
    square = _texture(lambda d: d.rectangle([14, 14, 60, 60], fill=(200, 30, 30)))  # the background dominates
    assert tri["edge_rise"][0, 1] > 2 * tri["edge_fall"][0, 1]
    assert tri["edge_fall"][0, 2] > 2 * tri["edge_rise"][0, 2]
    # The square's left side (cell (1, 0)): vertical, with its energy split evenly between the diagonals.
    assert square["edge_vert"][1, 0] > 4 * square["edge_horiz"][1, 0]
    assert square["edge_rise"][1, 0] == pytest.approx(float(square["edge_fall"][1, 0]), abs=0.02)
    # A flat image has no edges (the allocator's void fallback relies on near-zero structure); what is left
    # is the resampling's float round-off (about 1e-5 after the squash).
    flat = _texture(lambda d: None)
    assert all(float(flat[n].abs().max()) < 1e-4 for n in ("edge_vert", "edge_horiz", "edge_rise", "edge_fall"))
    assert float(tri["edge_rise"][0, 1]) > 0.3


def test_silhouette_is_a_thumbnail_of_the_cell():
    # Cell (1, 1) spans x, y in [28, 56): fill its left half only.
    half = _texture(lambda d: d.rectangle([28, 28, 41, 55], fill=(20, 20, 200)))
    left = [half[f"sil_{y}{x}"][1, 1] for y in range(4) for x in (0, 1)]
    right = [half[f"sil_{y}{x}"][1, 1] for y in range(4) for x in (2, 3)]
    assert min(left) > 0.5 > 0.05 > max(right)
    assert float(half["sil_00"][0, 0]) < 0.05  # an empty cell
    tex = generate_texture_array(Image.new("RGB", (112, 112)), GRID, SHAPE_CFG)
    assert tex.shape == (1, 20, 4, 4) and len(channel_names(SHAPE_CFG)) == 20


def test_the_default_array_is_unchanged_and_groups_are_checked():
    assert ARRCOCConfig().texture.groups == TEXTURE_GROUPS and len(channel_names(TextureConfig())) == 14
    with pytest.raises(ValueError, match="unknown texture groups"):
        TextureConfig(groups=("rgb", "glyphs"))
    with pytest.raises(ValueError, match="twice"):
        TextureConfig(groups=("rgb", "rgb"))


def _layer() -> ARRCOCLayer:
    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(16))
    with torch.no_grad():  # trained-looking: every weight moved, including the zero-initialised branches
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return layer.eval()


def _scene() -> Image.Image:
    image = Image.new("RGB", (224, 168), (240, 240, 240))
    d = ImageDraw.Draw(image)
    d.polygon([(50, 10), (10, 80), (90, 80)], fill=(200, 20, 20))
    d.rectangle([120, 90, 180, 150], fill=(20, 160, 40))
    return image


def _scores(layer: ARRCOCLayer, query: torch.Tensor) -> dict[str, torch.Tensor]:
    padded = layer.pad_inputs([_scene()], [(6, 8)], [query], None)  # texture, valid, query, mask, tokens
    return {**layer.score(*padded), "valid": padded[1]}


def test_a_widened_layer_scores_as_before_and_learns_from_the_new_channels():
    layer = _layer()
    wide = widen_texture(layer, SHAPE_GROUPS)
    assert wide.config.texture.groups == TEXTURE_GROUPS + SHAPE_GROUPS
    query = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, after = _scores(layer, query), _scores(wide, query)
    for name in ("information", "perspectival", "participatory", "relevance", "weights"):
        # float round-off only: the information scorer's weighted sum runs over 34 channels instead of 14
        torch.testing.assert_close(after[name], before[name], atol=1e-6, rtol=0, msg=name)
    # Negative control: the same widening with non-zero weights on the new channels changes the scores.
    moved = widen_texture(layer, SHAPE_GROUPS)
    with torch.no_grad():
        moved.participatory.cell_proj[0].weight[:, 14:].fill_(0.5)
        assert (_scores(moved, query)["relevance"] - before["relevance"]).abs().max() > 1e-3
    # The new channels' weights get gradient: training can learn what they add.
    wide.train()
    maps = _scores(wide, query)
    target = torch.zeros_like(maps["relevance"])
    target[0, 0, 1] = 1.0
    ranking_loss(maps["relevance"], maps["valid"], target, tau=0.05).backward()
    for name, dim in CHANNEL_INPUTS.items():
        grad = dict(wide.named_parameters())[name].grad
        assert grad.narrow(dim, 14, 20).abs().sum() > 0, name


def test_widening_refuses_a_group_the_layer_has(tmp_path):
    with pytest.raises(ValueError, match="already has"):
        widen_texture(_layer(), ("sobel",))
    wide = widen_texture(_layer(), SHAPE_GROUPS)
    wide.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["texture"]["groups"][-2:] == list(SHAPE_GROUPS)
    assert ARRCOCLayer.from_pretrained(tmp_path).channel_names[-1] == "edge_fall"


def test_train_cli_names_the_groups_it_knows():
    out = subprocess.run([sys.executable, "-m", "arr_coc", "train", "--data", "x.jsonl", "--stage", "1",
                          "--add-texture", "glyphs"], capture_output=True, text=True)
    assert out.returncode == 2 and "silhouette" in out.stderr and "glyphs" in out.stderr
