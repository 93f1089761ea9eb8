"""Issue 64's exact speed-ups: each rewritten piece of the layer's pass equals the maths it replaced, bit for bit, on
seeded random inputs (the reference is that maths, written as it was). A difference here would move kept cells at
ties, which the fixture tests/fixtures/kept_cells.json would then catch on real scenes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from arr_coc.core.knowing import box_sum, local_information


def _box_sum_padded(x: torch.Tensor, window: int) -> torch.Tensor:
    """The window sums as they were: shifted slices of a zero-padded copy, Python's sum from 0."""
    pad = window // 2
    p = F.pad(x, (pad, pad, pad, pad))
    h, w = x.shape[-2:]
    rows = sum(p[..., i: i + h, :] for i in range(window))
    return sum(rows[..., j: j + w] for j in range(window))


def _local_information_before(texture, valid, weights, bins, window):
    centres = (torch.arange(bins, dtype=texture.dtype) + 0.5) / bins
    sigma = 1.0 / bins
    z = -((texture[:, :, None] - centres[:, None, None]) ** 2) / (2 * sigma**2)
    member = torch.softmax(z, dim=2)
    mask = valid[:, None].to(texture.dtype)
    count = _box_sum_padded(mask, window).clamp_min(1.0)
    mixture = _box_sum_padded(member * mask[:, :, None], window) / count[:, :, None]
    mixture_entropy = -(mixture * torch.log(mixture.clamp_min(1e-12))).sum(2)
    member_entropy = -(member * torch.log(member.clamp_min(1e-12))).sum(2)
    mean_member = _box_sum_padded(member_entropy * mask, window) / count
    info = (mixture_entropy - mean_member).clamp_min(0) / math.log(bins)
    info = (weights[None, :, None, None] * info).sum(1) / weights.sum().clamp_min(1e-12)
    return info * valid


@pytest.mark.parametrize("window", [3, 5, 7])
def test_box_sum_is_the_padded_sum_bit_for_bit(window):
    g = torch.Generator().manual_seed(window)
    x = torch.randn(2, 3, 4, 9, 13, generator=g)
    x[0, 0, 0, :3] = -0.0                                  # signed zeros: a sum from 0 never gives -0, either way
    assert torch.equal(box_sum(x, window), _box_sum_padded(x, window))
    tiny = torch.rand(1, 1, 2, 1, generator=g)             # a grid narrower than the window
    assert torch.equal(box_sum(tiny, window), _box_sum_padded(tiny, window))


@pytest.mark.parametrize("batch,size,window", [(1, 32, 3), (3, 11, 3), (2, 7, 5)])
def test_local_information_equals_the_maths_before(batch, size, window):
    g = torch.Generator().manual_seed(batch * 100 + size)
    texture = torch.rand(batch, 20, size, size, generator=g)
    texture[:, :4] = (texture[:, :4] > 0.5).float()          # flat and two-valued channels, as the texture has
    valid = torch.rand(batch, size, size, generator=g) > 0.2
    weights = torch.rand(20, generator=g)
    assert torch.equal(local_information(texture, valid, weights, 8, window),
                       _local_information_before(texture, valid, weights, 8, window))


def test_local_information_refuses_a_texture_with_gradients():
    texture = torch.rand(1, 2, 4, 4, requires_grad=True)
    with pytest.raises(ValueError, match="detach"):
        local_information(texture, torch.ones(1, 4, 4, dtype=torch.bool), torch.ones(2), 8, 3)
    weights = torch.rand(2, requires_grad=True)                # gradients to the weights still flow
    local_information(texture.detach(), torch.ones(1, 4, 4, dtype=torch.bool), weights, 8, 3).sum().backward()
    assert weights.grad is not None


def test_pixel_maps_pool_once_to_the_cell_means_before():
    """One buffer, one pooling: each group's cell means are the old per-map pools of the same maps, bit for bit."""
    from arr_coc.core.pixel_maps import PixelSources, pixel_cell_means
    from arr_coc.core.texture import pool_to

    g = torch.Generator().manual_seed(64)
    luma = torch.rand(3, 1, 48, 64, generator=g)
    gradients = (torch.rand(3, 4, 48, 64, generator=g) - 0.5) * torch.rand(1, generator=g)
    blurred = torch.rand(3, 1, 48, 64, generator=g)
    pool = lambda x: pool_to(x, (3, 4))                                          # noqa: E731  16 px cells
    groups = ("rgb", "sobel", "saliency", "highpass", "orientation")
    got = pixel_cell_means(groups, PixelSources(luma, gradients, blurred), pool)
    lg, fg = gradients[:, 0:2], gradients[:, 2:4]
    gx, gy = fg[:, :1], fg[:, 1:]
    want = {
        "saliency": torch.cat([pool(luma), pool(luma**2)], 1),
        "sobel": pool(torch.cat([lg.abs(), lg.pow(2).sum(1, keepdim=True).sqrt()], dim=1)),
        "highpass": pool((luma - blurred) ** 2),
        "orientation": pool(torch.cat([gx**2, gy**2, (gx + gy) ** 2 / 2, (gx - gy) ** 2 / 2], dim=1)),
    }
    assert list(got) == ["sobel", "saliency", "highpass", "orientation"]          # config order, rgb reads none
    for group, means in want.items():
        assert torch.equal(got[group], means), group
    assert pixel_cell_means(("rgb", "position"), PixelSources(luma, None, None), pool) == {}


def _masks():
    """Seeded masks [B, H, W] and their cell grids: blobs and speckle from empty to full, batches of 1-3 images."""
    g = torch.Generator().manual_seed(64)
    for b, h, w in [(1, 64, 64), (3, 48, 80), (2, 96, 56)]:
        for share in (0.0, 0.05, 0.3, 0.5, 0.7, 1.0):
            noise = torch.rand(b, 1, h // 4, w // 4, generator=g)
            blobs = F.interpolate(noise, size=(h, w), mode="bilinear")[:, 0] < share
            yield blobs, (h // 8, w // 8)
            yield torch.rand(b, h, w, generator=g) < share, (h // 8, w // 8)


@pytest.mark.parametrize("full", [False, True], ids=["cpu_pixels", "every_pixel"])
def test_object_components_over_the_mask_s_pixels_equal_the_grid_before(full, monkeypatch):
    """The components run over the mask's pixels alone on the CPU (every pixel elsewhere): labels, convergence
    flags, the channels and the `ok` flag are the grid version's, bit for bit, on either path, at the fixed steps,
    to convergence, and with too few steps and too small a cap (the flags then say so)."""
    from arr_coc.core import components

    import _components_before as before

    if full:  # the path a GPU or the compiler takes, run here on the CPU
        monkeypatch.setattr(components, "_pixels", lambda mask: torch.arange(mask.numel()))
    flags = set()
    for mask, grid in _masks():
        for steps, cap in [(components.STEPS, components.CAP), (None, None), (1, 3)]:
            want, got = before.object_channels(mask, grid, steps, cap), components.object_channels(mask, grid, steps, cap)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mask.shape, steps, cap)
            want, got = before.label_components(mask, steps), components.label_components(mask, steps)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (mask.shape, steps)
            flags.update(got[1].tolist())
    assert flags == {True, False}  # both outcomes of the convergence flag were compared


def test_settled_object_channels_are_the_fixed_steps_or_the_layer_s_redo_bit_for_bit():
    """On the CPU the object group steps to convergence in its one pass (`settle`) instead of STEPS steps and a redo
    of the whole pass: its channels are the fixed steps' where their `ok` held for the batch, else the redo's
    (steps None, cap None), bit for bit, and `ok` says nothing is left to redo."""
    from arr_coc.core import components

    import _components_before as before

    outcomes = set()
    winding = torch.rand(1, 48, 64, generator=torch.Generator().manual_seed(0)) < 0.55   # near percolation
    masks = list(_masks()) + [(winding, (6, 8))]
    for mask, grid in masks:
        for steps, cap in [(components.STEPS, components.CAP), (1, 3)]:
            fixed = before.object_channels(mask, grid, steps, cap)
            redone = bool(not fixed[1].all())
            want = before.object_channels(mask, grid, None, None) if redone else fixed
            got = components.object_channels(mask, grid, steps, cap, settle=True)
            assert torch.equal(got[0], want[0]), (mask.shape, steps, cap, redone)
            assert got[1].all()
            outcomes.add(redone)
    assert outcomes == {True, False}  # both the fixed steps' channels and the redo's were compared
    # Negative control: a batch whose fixed steps did not converge is not what they gave.
    fixed = before.object_channels(winding, (6, 8))
    assert not fixed[1].all()
    assert not torch.equal(components.object_channels(winding, (6, 8), settle=True)[0], fixed[0])


def test_object_components_run_over_the_foreground_pixels_only_on_the_cpu():
    from arr_coc.core.components import _pixels

    mask = torch.zeros(2, 16, 16, dtype=torch.bool)
    mask[0, 3:5, 3:6] = mask[1, 0, 0] = True
    assert _pixels(mask).tolist() == [51, 52, 53, 67, 68, 69, 256]


def _points():
    """Seeded k-means inputs: uniform, five tight clusters, coarse levels with ties; with and without padding."""
    g = torch.Generator().manual_seed(64)
    for trial in range(60):
        b, n = 1 + trial % 3, 3 + (37 * trial) % 290
        kind = trial % 3
        if kind == 0:
            x = torch.rand(b, n, 3, generator=g)
        elif kind == 1:
            centres = torch.rand(b, 5, 3, generator=g)
            x = centres[:, torch.randint(0, 5, (n,), generator=g)] + 0.01 * torch.randn(b, n, 3, generator=g)
        else:
            x = torch.randint(0, 4, (b, n, 3), generator=g).float() / 3
        if trial % 2:
            n_valid = torch.randint(1, n + 1, (b,), generator=g)
            yield x, torch.arange(n)[None] < n_valid[:, None], n_valid
        else:
            yield x, None, None


def test_kmeans_stopping_at_a_fixed_point_returns_every_step_s_result():
    """On the CPU k-means stops when a step assigns every point as the step before did; the labels and centroids are
    those of all `iters` steps (as a GPU runs them), bit for bit. It does stop early (fewer ops), and the comparison
    can fail: one step instead of eight gives other clusters."""
    from arr_coc.core.grid import as_on_a_gpu
    from arr_coc.core.kmeans import kmeans
    from arr_coc.evaluation.opcount import OpCounter

    saved, differ = [], 0
    for x, valid, n_valid in _points():
        for iters in (1, 3, 8):
            with OpCounter(record_stacks=False) as here:
                labels, centroids = kmeans(x, 6, iters, valid, n_valid)
            with as_on_a_gpu(), OpCounter(record_stacks=False) as gpu:
                want_labels, want_centroids = kmeans(x, 6, iters, valid, n_valid)
            assert torch.equal(labels, want_labels) and torch.equal(centroids, want_centroids), (x.shape, iters)
            if iters == 8:
                saved.append(gpu.total - here.total)
                differ += not torch.equal(kmeans(x, 6, 1, valid, n_valid)[1], centroids)
    assert sum(s > 0 for s in saved) > len(saved) // 2     # most stop before the eighth step
    assert differ > len(saved) // 2                         # negative control: the steps matter


def test_kmeans_distances_are_cdist_bit_for_bit_with_the_points_half_built_once():
    """k-means' distances (`_distances_to`) build the points' half of cdist's matrix-product route once per call and
    only the centroids' half at each step: torch.cdist's numbers bit for bit, on both of cdist's routes (at most 25
    points and centroids: the direct one; above: the product), on transposed (non-contiguous) points as the texture
    passes them, batched. Negative control: the distance written directly, sqrt(sum((x - c)^2)), differs."""
    from arr_coc.core.kmeans import MM_ABOVE, _distances_to

    g = torch.Generator().manual_seed(65)
    direct_differs = 0
    for b, n, k in ((1, 4, 6), (2, 25, 6), (1, 26, 6), (3, 256, 6), (1, 1000, 6), (2, 20, 30), (1, 300, 2)):
        x = torch.rand(b, 3, n, generator=g).transpose(1, 2)          # [B, N, 3], strided as the cells' colours
        distances = _distances_to(x, k)
        for _ in range(3):
            c = torch.rand(b, k, 3, generator=g)
            got = distances(c)
            assert torch.equal(got, torch.cdist(x, c)), (b, n, k)
            if n > MM_ABOVE:
                direct_differs += not torch.equal(got, ((x[:, :, None] - c[:, None]) ** 2).sum(-1).sqrt())
    assert direct_differs > 0


def test_kmeans_gives_the_same_clusters_as_before():
    """The whole k-means (its distances built once, its sums as one bmm, constants made once, no clamp before the
    division whose 0 / 0 `where` never takes) against k-means as it was (`tests/_kmeans_before.py`: cdist at every
    step, `@`, the counts clamped), on the seeded inputs: labels and centroids bit for bit, at 1 and 8 steps, as
    the CPU runs it and as a GPU does. The inputs do empty clusters (the kept-centroid branch)."""
    from _kmeans_before import kmeans as kmeans_before

    from arr_coc.core.grid import as_on_a_gpu
    from arr_coc.core.kmeans import kmeans

    emptied = 0
    for x, valid, n_valid in _points():
        for iters in (1, 8):
            for gpu in (False, True):
                with as_on_a_gpu() if gpu else _nothing():
                    got = kmeans(x, 6, iters, valid, n_valid)
                    want = kmeans_before(x, 6, iters, valid, n_valid)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (x.shape, iters, gpu)
            members = torch.stack([(got[0] == s) & (True if valid is None else valid) for s in range(got[1].shape[1])])
            emptied += int((members.sum(-1) == 0).any())
    assert emptied > 0


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_two_by_two_pooling_on_the_cpu_is_avg_pool_bit_for_bit():
    """`pool_to` halves a map on the CPU with three strided adds (the object group's mask share): avg_pool2d's sums
    in its order, bit for bit, on odd-sized batches; a GPU keeps avg_pool2d. Negative control: the adds paired
    otherwise ((a + b) + (c + d)) differ somewhere."""
    import torch.nn.functional as F

    from arr_coc.core.grid import as_on_a_gpu
    from arr_coc.core.texture import pool_to
    from arr_coc.evaluation.opcount import OpCounter

    g = torch.Generator().manual_seed(22)
    for shape in [(1, 1, 512, 512), (3, 1, 96, 224), (2, 4, 34, 18)]:
        x = torch.rand(shape, generator=g)
        half = (shape[-2] // 2, shape[-1] // 2)
        with OpCounter() as ops:
            here = pool_to(x, half)
        assert "aten.avg_pool2d" not in ops.ops
        assert torch.equal(here, F.avg_pool2d(x, 2)), shape
        with as_on_a_gpu(), OpCounter() as ops:
            assert torch.equal(pool_to(x, half), here)
        assert ops.ops["aten.avg_pool2d"] == 1
    paired = (x[..., 0::2, 0::2] + x[..., 0::2, 1::2]) + (x[..., 1::2, 0::2] + x[..., 1::2, 1::2])
    assert not torch.equal(paired / 4, here)


def test_a_photo_whose_labels_need_more_steps_costs_one_pass_on_the_cpu(monkeypatch):
    """A photo's foreground often needs more label steps than STEPS (the rocket's: 7). On the CPU the object group
    steps to convergence inside the layer's one pass: the texture is built once, where the fixed steps and the
    layer's redo built it twice, and the kept cells and the relevance are theirs, bit for bit. Negative control:
    with the settling off (what a GPU runs) the same request builds the texture twice."""
    from PIL import Image

    from arr_coc import ARRCOCQwen
    from arr_coc.core import layer as layer_module
    from arr_coc.core import texture

    vlm = ARRCOCQwen.from_pretrained("checkpoints/shapes-qwen2vl", arr_coc="checkpoints/arr-coc-shapes-before")
    photo = Image.open("assets/examples/photo_rocket.jpg").convert("RGB")
    built = []
    real = layer_module.texture_array
    monkeypatch.setattr(layer_module, "texture_array", lambda *a, **k: built.append(a[2:3] or k) or real(*a, **k))

    def choose():
        built.clear()
        return vlm.choose(photo, "What is in the picture?", 0.1, encode="before")

    once = choose()
    assert len(built) == 1
    monkeypatch.setattr(texture, "settles_at_once", lambda device: False)
    twice = choose()
    assert len(built) == 2 and built[-1] == (True,)        # the fixed steps had not converged: the pass was redone
    assert torch.equal(once.kept[0], twice.kept[0])
    assert torch.equal(once.output.relevance, twice.output.relevance)
