"""ARR-COC runs where the VLM runs: one batched pass, nothing read back before its result, the same decisions.

- the layer's forward (`decide`) issues no host-synchronising op and no stray host tensor, and its number of
  aten ops does not grow with the batch; negative controls: a `.item()` in a stage, a loop over images;
- the same forward runs on the meta device, where any read of a value on the host raises (so `.tolist()`
  and `.numpy()`, which a dispatch mode cannot see on the CPU, are ruled out too);
- on a bfloat16 VLM nothing of the VLM's is moved or cast, and the layer runs on the VLM's device in float32;
- the shipped layers keep, on a fixed set of generated items in both encode modes, exactly the cells the
  per-image CPU layer kept (tests/fixtures/kept_cells.json, written by make_kept_cells.py with that code).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from arr_coc.evaluation.opcount import OpCounter

ROOT = Path(__file__).resolve().parent.parent
EMBEDDED = str(ROOT / "checkpoints" / "shapes-qwen2vl")
BEFORE_LAYER = str(ROOT / "checkpoints" / "arr-coc-shapes-before")
FIXTURE = Path(__file__).parent / "fixtures" / "kept_cells.json"


@pytest.fixture(scope="module")
def before_vlm():
    from arr_coc.qwen import ARRCOCQwen

    return ARRCOCQwen.from_pretrained(EMBEDDED, arr_coc=BEFORE_LAYER)


def _layer_batch(vlm, n: int, canvas: str = "336x336"):
    """The shipped before-mode layer's padded batch for n generated scenes, built as the wrapper builds it."""
    from arr_coc.methods.arrcoc import layer_batch_of
    from arr_coc.pipeline import Pruning
    from arr_coc.pipeline.choose import context
    from arr_coc_shapes import make_item

    items = [make_item(5, "device", i, canvas=canvas) for i in range(n)]
    inputs = vlm.build_inputs([[it.image] for it in items], [it.record["question"] for it in items])
    prompt = vlm.backend.read_prompt(inputs, encode_all=False)
    ctx = context(vlm.request(Pruning.of()), prompt, None, [0.1] * n, None)
    return layer_batch_of(ctx, vlm.arr_coc_layer)


def _count(layer, batch, device_path: bool = True) -> OpCounter:
    """The ops of one `decide`. device_path: as a GPU runs it (`as_on_a_gpu`: the object group's components over
    every mask pixel, fixed shapes; the Sobel one convolution; k-means every step); False: as the CPU runs it (over
    the mask's pixels alone, reading their count back; the Sobel as shifted adds; k-means stopping at a fixed
    point, reading back whether it is one)."""
    import contextlib

    from arr_coc.core.grid import as_on_a_gpu

    with as_on_a_gpu() if device_path else contextlib.nullcontext():
        layer.decide(batch, 0.1)                   # warm: constants are built and uploaded once per device
        with OpCounter() as ops:
            layer.decide(batch, 0.1)
    return ops


def test_one_forward_is_batched_and_reads_nothing_back(before_vlm):
    layer = before_vlm.arr_coc_layer
    one, eight = _count(layer, _layer_batch(before_vlm, 1)), _count(layer, _layer_batch(before_vlm, 8))
    for ops in (one, eight):
        assert ops.syncs == 0, ops.sync_sites            # nothing waits for the device before the result
        assert ops.host_tensors == 0                     # host data only through arr_coc.core.grid.upload
    assert eight.uploads <= 4                            # one per kind of host fact, not per image
    assert eight.total <= 1.25 * one.total, (one.summary(), eight.summary())   # batched, not looped
    assert eight.kernels <= 1.25 * one.kernels
    on_cpu = _count(layer, _layer_batch(before_vlm, 8), device_path=False)
    # On the CPU the components read the mask's size back and whether their labels settled, and k-means whether a
    # step repeated the one before (free there: no device to wait for), and nothing else reads anything.
    sites = Counter((name, site.split(":")[0]) for name, site in on_cpu.sync_sites)
    allowed = {("aten.nonzero", "components.py"), ("aten._local_scalar_dense", "components.py"), ("aten.equal", "kmeans.py")}
    assert set(sites) <= allowed, sites
    assert sites[("aten.nonzero", "components.py")] == 1
    # the labels' flag once a step until they settle (these scenes: within STEPS), and the components' count once
    from arr_coc.core.components import STEPS

    assert 2 <= sites[("aten._local_scalar_dense", "components.py")] <= STEPS + 1
    assert 1 <= sites[("aten.equal", "kmeans.py")] < layer.config.texture.kmeans_iters


def test_the_counter_catches_a_host_read_and_a_loop_over_images(before_vlm, monkeypatch):
    """Negative controls: the same checks fail when a stage reads a value back or loops over the images."""
    import arr_coc.core.layer as layer_module

    layer = before_vlm.arr_coc_layer
    batch1, batch8 = _layer_batch(before_vlm, 1), _layer_batch(before_vlm, 8)
    real = layer_module.texture_array

    def reads_back(work, config, converge=False, clock=None):
        tex, converged = real(work, config, converge)
        float(tex.sum())                                  # a host read: what .item() does
        return tex, converged

    monkeypatch.setattr(layer_module, "texture_array", reads_back)
    assert _count(layer, batch1).syncs == 1

    def per_image(work, config, converge=False, clock=None):   # one texture pass per frame, then stacked
        from arr_coc.core.texture import WorkImages

        parts = []
        for f in range(work.pixels.shape[0]):
            grid = type(work.grid)((work.grid.thw[f],), work.grid.device)
            parts.append(real(WorkImages(work.pixels[f:f + 1], grid, work.px), config, converge)[0])
        return torch.cat(parts), None

    monkeypatch.setattr(layer_module, "texture_array", per_image)
    one, eight = _count(layer, batch1), _count(layer, batch8)
    assert eight.total > 1.25 * one.total


def test_the_forward_runs_on_the_meta_device_where_any_host_read_raises(before_vlm):
    from arr_coc.core.batch import LayerBatch
    from arr_coc.core.layer import ARRCOCLayer

    batch = _layer_batch(before_vlm, 3)
    layer = ARRCOCLayer.from_pretrained(BEFORE_LAYER).eval()
    layer.decide(batch.to("cpu"), 0.1)                  # what the scorers know of their weights, read on the CPU
    layer.to("meta")
    meta = batch.to("meta")
    decision = layer.decide(meta, 0.1)
    assert decision.allocation.keep.device.type == "meta" and decision.allocation.keep.shape == (3, 144)
    with pytest.raises((RuntimeError, NotImplementedError)):   # negative control: reading it back cannot work
        layer.read(decision, meta)
    assert isinstance(meta, LayerBatch)


def test_a_bfloat16_vlm_keeps_its_tensors_and_the_layer_runs_beside_it_in_float32(tiny_vlm, make_image):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm("qwen2_vl")
    vlm = ARRCOCQwen(model.to(torch.bfloat16), processor)
    try:
        inputs = vlm.build_inputs([[make_image(120, 150, 0)], [make_image(90, 200, 1)]], ["What is red?", "Where?"])
        before = {k: v.clone() for k, v in inputs.items()}
        for encode in ("after", "before"):
            pruned, traces = vlm.prepare(inputs, budget=0.25, encode=encode).outputs
            assert all(f.dtype == torch.bfloat16 for f in pruned.image_features)   # what the LM reads: its dtype
            assert all(t.fallback == [None] for t in traces)
        layer = vlm.arr_coc_layer
        assert {p.dtype for p in layer.parameters()} == {torch.float32}
        assert {p.device for p in layer.parameters()} == {vlm.device}
        assert {p.dtype for p in vlm.model.parameters()} == {torch.bfloat16}
        for k, v in before.items():                       # the processor's tensors: not moved, cast or changed
            assert inputs[k].device == v.device and inputs[k].dtype == v.dtype and torch.equal(inputs[k], v)
    finally:
        model.to(torch.float32)                           # the tiny model is shared by the session


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["arr_coc", "arr_coc_adaptive", "random", "grid", "fastv", "visionzip", "divprune",
                                    "cdpruner"])
def test_every_selector_runs_with_the_vlm_on_the_device_the_caller_chose(tiny_vlm, make_image, method, device):
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm("qwen2_vl")
    vlm = ARRCOCQwen(model.to(device), processor)
    try:
        inputs = vlm.build_inputs([[make_image(120, 150, 0)], [make_image(90, 200, 1)]], ["What is red?", "Where?"])
        pruned, traces = vlm.prepare(inputs, budget=0.3, method=method).outputs
        assert pruned.input_ids.device.type == device and all(f.device.type == device for f in pruned.image_features)
        assert all(t.error is None for t in traces), [t.error for t in traces]
        if method.startswith("arr_coc"):
            assert vlm.arr_coc_layer.device.type == device
    finally:
        model.to("cpu")


def test_the_shipped_layers_keep_the_cells_the_per_image_cpu_layer_kept():
    """Both encode modes, the README's budgets, exact / mean / adaptive budgets, batches of one size and of four
    sizes: every item keeps exactly the recorded cells (tests/fixtures/make_kept_cells.py, re-recorded when each
    image came to be chosen alone)."""
    import sys

    sys.path.insert(0, str(FIXTURE.parent))
    from make_kept_cells import kept_cells

    recorded = json.loads(FIXTURE.read_text())["kept"]
    now = kept_cells()
    assert now.keys() == recorded.keys()
    differing = {k: [i for i in recorded[k] if recorded[k][i] != now[k][i]] for k in recorded}
    assert {k: v for k, v in differing.items() if v} == {}
    # negative control: the comparison sees a one-cell change
    changed = dict(now)
    first = next(iter(changed))
    item = next(iter(changed[first]))
    changed[first] = {**changed[first], item: changed[first][item][1:]}
    assert changed[first] != recorded[first]
