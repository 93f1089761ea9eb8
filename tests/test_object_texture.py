"""The texture array's `object` group: every cell of an object knows the shape of the whole object.

Built on 4-connected components of the foreground (arr_coc/core/components.py); a layer that reads no visual
token (encode="before") can only tell "the triangle" from "the square" through channels like these.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from PIL import Image, ImageDraw

from arr_coc.core.components import OBJECT_CHANNELS, label_components
from arr_coc.core.config import TextureConfig
from arr_coc.core.texture import channel_names, generate_texture_array

OBJECT_CFG = TextureConfig(groups=("object",))
BACKGROUND = (70, 70, 80)


def _draw(shape: str, d: ImageDraw.ImageDraw, x0: int, y0: int, side: int, fill) -> None:
    x1, y1, mid = x0 + side - 1, y0 + side - 1, side / 2
    if shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=fill)
    elif shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=fill)
    elif shape == "triangle":
        d.polygon([(x0 + mid, y0), (x0, y1), (x1, y1)], fill=fill)
    elif shape == "diamond":
        d.polygon([(x0 + mid, y0), (x1, y0 + mid), (x0 + mid, y1), (x0, y0 + mid)], fill=fill)
    elif shape == "cross":
        t = side / 3
        d.rectangle([x0 + t, y0, x0 + 2 * t - 1, y1], fill=fill)
        d.rectangle([x0, y0 + t, x1, y0 + 2 * t - 1], fill=fill)


def _object_cells(shape: str, x0: int, y0: int, side: int, fill=(220, 40, 40), canvas=(336, 336)):
    """The object channels of every cell the object touches: [cells, C]."""
    image = Image.new("RGB", canvas, BACKGROUND)
    _draw(shape, ImageDraw.Draw(image), x0, y0, side, fill)
    tex = generate_texture_array(image, (canvas[1] // 28, canvas[0] // 28), OBJECT_CFG)[0]  # [C, h, w]
    cells = tex.flatten(1).T  # [N, C]
    return cells[cells[:, 0] > 0], tex


SHAPES = ("square", "circle", "triangle", "diamond", "cross")


def test_every_cell_of_an_object_reads_the_same_description_whatever_its_place_and_size():
    for shape in SHAPES:
        cells, _ = _object_cells(shape, 100, 90, 60)
        assert len(cells) >= 4, shape  # a 60 px object spans 3 x 3 or more cells
        torch.testing.assert_close(cells, cells[:1].expand_as(cells), msg=shape)  # one object, one description
        moved, _ = _object_cells(shape, 213, 30, 42)  # elsewhere and smaller: about the same description
        assert (moved[0, 3:] - cells[0, 3:]).abs().mean() < 0.12, shape
        assert abs(float(moved[0, 0] - cells[0, 0])) < 0.08, shape  # fill ratio
        assert float(moved[0, 2]) < float(cells[0, 2])  # obj_size grows with the object


def test_the_descriptions_tell_the_shapes_apart():
    # Nearest reference: every shape drawn at another place, size and colour is recognised as itself (at 8 mask
    # pixels per 28 px cell a circle under about 44 px reads close to a square by this plain L1 distance).
    # Negative control: with the thumbnail and fill blanked, the remaining channels (aspect, size) cannot.
    refs = torch.stack([_object_cells(s, 40, 40, 64)[0][0] for s in SHAPES])  # [S, C]
    for blank in (False, True):
        hits = 0
        for i, shape in enumerate(SHAPES):
            probe = _object_cells(shape, 150, 170, 52, fill=(40, 200, 210))[0][0]
            ref, x = refs.clone(), probe.clone()
            if blank:
                ref[:, [0, *range(3, len(OBJECT_CHANNELS))]] = 0
                x[[0, *range(3, len(OBJECT_CHANNELS))]] = 0
            hits += int((ref - x).abs().sum(1).argmin()) == i
        if blank:
            assert hits < len(SHAPES)
        else:
            assert hits == len(SHAPES)


def test_shapes_have_the_fill_ratios_of_their_geometry():
    fill = {s: float(_object_cells(s, 100, 100, 64)[0][0, 0]) for s in SHAPES}
    assert fill["square"] == pytest.approx(1.0, abs=0.02)
    assert fill["circle"] == pytest.approx(torch.pi / 4, abs=0.05)
    assert fill["triangle"] == pytest.approx(0.5, abs=0.07) and fill["diamond"] == pytest.approx(0.5, abs=0.07)
    assert fill["cross"] == pytest.approx(5 / 9, abs=0.07)
    # An upright triangle: the apex's row of the thumbnail is empty at its corners and fullest in the middle,
    # the base row (nearly) full.
    cells, _ = _object_cells("triangle", 100, 100, 64)
    thumb = cells[0, 3:].reshape(5, 5)
    assert float(thumb[0, 0]) == 0.0 and float(thumb[0, 4]) == 0.0 and int(thumb[0].argmax()) == 2
    assert float(thumb[4].mean()) > 0.85


def test_background_cells_and_specks_read_zero_and_a_batch_equals_each_image():
    cells, tex = _object_cells("square", 100, 100, 50)
    assert float(tex[:, 0, 0].abs().max()) == 0.0 and float(tex[:, -1, -1].abs().max()) == 0.0
    speck = Image.new("RGB", (112, 112), BACKGROUND)
    ImageDraw.Draw(speck).rectangle([50, 50, 52, 52], fill=(250, 250, 250))  # 3 x 3 px: under MIN_AREA
    assert float(generate_texture_array(speck, (4, 4), OBJECT_CFG).abs().max()) == 0.0
    # A flat image has no object at all (the allocator's void fallback relies on near-zero structure).
    assert float(generate_texture_array(Image.new("RGB", (112, 112), BACKGROUND), (4, 4), OBJECT_CFG).abs().max()) == 0.0
    a, b = Image.new("RGB", (168, 112), BACKGROUND), Image.new("RGB", (168, 112), BACKGROUND)
    _draw("triangle", ImageDraw.Draw(a), 10, 10, 60, (40, 80, 220))
    _draw("cross", ImageDraw.Draw(b), 90, 30, 60, (245, 140, 30))
    both = generate_texture_array([a, b], (4, 6), OBJECT_CFG)
    torch.testing.assert_close(both[1:], generate_texture_array(b, (4, 6), OBJECT_CFG))
    torch.testing.assert_close(both[:1], generate_texture_array(a, (4, 6), OBJECT_CFG))
    assert channel_names(OBJECT_CFG) == list(OBJECT_CHANNELS)


def _bfs_components(mask: torch.Tensor) -> torch.Tensor:
    """Reference: breadth-first 4-connected labelling, smallest flat index per component, -1 outside."""
    h, w = mask.shape
    out = torch.full((h * w,), -1, dtype=torch.long)
    for start in range(h * w):
        if not mask.flatten()[start] or out[start] >= 0:
            continue
        out[start] = start
        queue = deque([start])
        while queue:
            p = queue.popleft()
            y, x = divmod(p, w)
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                q = ny * w + nx
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and out[q] < 0:
                    out[q] = start
                    queue.append(q)
    return out


def test_components_match_a_breadth_first_search():
    g = torch.Generator().manual_seed(0)
    masks = torch.rand(3, 24, 31, generator=g) < torch.tensor([0.45, 0.55, 0.6])[:, None, None]  # near percolation
    spiral = torch.zeros(24, 31, dtype=torch.bool)  # one long winding component: many steps of spreading
    for i in range(0, 12, 2):
        spiral[i, i:31 - i] = spiral[i:24 - i, 30 - i] = spiral[23 - i, i:31 - i] = True
        spiral[i + 2:24 - i, i] = True
    masks = torch.cat([masks, spiral[None]])
    labels, converged = label_components(masks, steps=None)      # until nothing changes
    assert converged.all()
    for m, got in zip(masks, labels):
        assert torch.equal(got, _bfs_components(m))
    # The fixed-step path (what the layer runs, reading nothing back): a flag that says converged means exact labels.
    # The near-percolation masks need more than STEPS steps, and say so (the layer then redoes them to convergence);
    # the spiral's long straight arms take two.
    fixed, flag = label_components(masks)
    assert flag.tolist() == [True, False, False, True]
    assert not torch.equal(fixed[1], labels[1]) and not torch.equal(fixed[2], labels[2])
    for got, exact, ok in zip(fixed, labels, flag):
        assert not ok or torch.equal(got, exact)
    # Negative control: diagonal neighbours are not connected (4-connectivity), so a checkerboard is all singletons.
    board = (torch.arange(6)[:, None] + torch.arange(6)[None]) % 2 == 0
    got = label_components(board[None])[0][0]
    assert torch.equal(got[board.flatten()], torch.arange(36)[board.flatten()])
