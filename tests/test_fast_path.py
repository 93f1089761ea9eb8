"""The fast path (arr_coc.execution): fixed-shape buckets and the three compiled stages.

Graphs are captured with dynamo's counting backend over eager execution (`CompileCounter`): the same capture as
inductor or CUDA graphs without code generation, so `fullgraph=True` proves there is no graph break while the
suite stays fast. Equality is asserted against eager execution with the SAME buckets (what compiling changes);
what the buckets change (more cells, a longer left padding) is tested on its own.
"""

from __future__ import annotations

from _pruned import forward_pruned, prepare_state  # noqa: F401
import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

from arr_coc import ARRCOC
from arr_coc.buckets import Buckets, fill
from arr_coc.execution import Execution, read_fast_flag
from arr_coc.core.layer import ARRCOCLayer
from arr_coc.pipeline.request import Pruning
from arr_coc.qwen.wrapper import ARRCOCQwen
from arr_coc.video import load_clip

from conftest import FAMILIES


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def same_cells(a, b) -> bool:
    return [k.tolist() for k in a.kept_indices] == [k.tolist() for k in b.kept_indices]


def pair(model, processor, **kw):
    """(fast wrapper with a compile counter, eager wrapper with the same buckets, the counter)."""
    counter = CompileCounter()
    fast = ARRCOCQwen(model, processor, execution=Execution.fast("cpu", compiler=counter, fallback=False), **kw)
    eager = ARRCOCQwen(model, processor, execution=Execution(buckets=Buckets()), **kw)
    return fast, eager, counter


# -- buckets -------------------------------------------------------------------------------------------------


def test_bucket_sizes_round_up_and_never_exceed_the_image():
    b = Buckets()
    assert b.cells[:8] == (4, 6, 8, 11, 16, 23, 32, 45)       # steps of sqrt(2)
    assert [b.cells_for(k, 1024) for k in (1, 16, 17, 100, 1000, 1024)] == [4, 16, 23, 128, 1024, 1024]
    assert b.cells_for(20, 21) == 21                           # at most the unit's own cells
    assert [b.prompt_for(n) for n in (10, 64, 65, 40000)] == [32, 64, 91, 40000]
    with pytest.raises(ValueError, match="increasing"):
        Buckets(cells=(32, 16))


def test_filling_keeps_the_chosen_cells_and_adds_the_next_most_relevant():
    rel = np.linspace(0.0, 1.0, 64)[::-1].copy()              # cell 0 most relevant, cell 63 least
    chosen = torch.arange(40, 52)                             # 12 cells: the method's choice, whatever the map says
    [out] = fill([chosen], [(8, 8)], Buckets(), [rel])
    assert out.tolist() == [0, 1, 2, 3] + list(range(40, 52))      # bucket 16: the chosen + the 4 most relevant
    [out_grid] = fill([chosen], [(8, 8)], Buckets(), [None])        # no map: spread over the grid instead
    assert len(out_grid) == 16 and set(chosen.tolist()) <= set(out_grid.tolist())
    assert out_grid.tolist() != out.tolist()                        # negative control: the map decided
    [exact] = fill([torch.arange(16)], [(8, 8)], Buckets(), [rel])  # a bucket already: unchanged
    assert exact.tolist() == list(range(16))


# -- graphs --------------------------------------------------------------------------------------------------


def test_a_graph_break_is_caught():
    def breaks(x):
        return x * 2 if float(x.sum()) > 0 else x        # reads a value on the host: a graph break
    with pytest.raises(Exception, match="(?i)graph|unsupported|data-dependent"):
        Execution.fast("cpu", compiler="eager", fallback=False).compile(breaks)(torch.ones(3))
    served = Execution.fast("cpu", compiler="eager").compile(breaks)        # serving: eager, said once, not failed
    assert torch.equal(served(torch.ones(3)), torch.full((3,), 2.0))


def test_the_layers_device_pass_is_one_graph_per_shape():
    layer = ARRCOCLayer.from_pretrained("checkpoints/arr-coc-shapes-before").eval()
    reference = ARRCOCLayer.from_pretrained("checkpoints/arr-coc-shapes-before").eval()
    counter = CompileCounter()
    layer.compile_device_pass(Execution.fast("cpu", compiler=counter, fallback=False).compile, Buckets().question_for)
    g = torch.Generator().manual_seed(0)
    d = layer.config.knowing.query_dim

    def batch(sizes, n_words):
        return layer.batch([torch.rand(3, h * 28, w * 28, generator=g) for h, w in sizes], sizes,
                           [torch.randn(n_words, d, generator=g) for _ in sizes])

    for sizes, words, budget, graphs in (([(8, 8)], 5, 0.1, 1), ([(8, 8)], 9, 0.3, 1),    # same bucket: replayed
                                         ([(8, 8), (6, 10)], 7, 12, 2), ([(8, 8), (6, 10)], 3, 0.5, 2)):
        b = batch(sizes, words)
        got = layer.run(b, budget)
        want = reference.run(b, budget)
        assert counter.frame_count == graphs, (sizes, words, budget)
        assert [k.tolist() for k in got.kept_indices] == [k.tolist() for k in want.kept_indices]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encode", ["before", "after"])
def test_fast_equals_eager_on_images(tiny_vlm, make_image, family, encode):
    model, processor = tiny_vlm(family)
    fast, eager, counter = pair(model, processor)
    image = make_image(112, 112)
    graphs = []
    for question in ("Where is the red circle?", "Where is the blue square?"):   # two questions, one bucket
        pruning = Pruning.of("arr_coc", 0.1, encode=encode)
        got = fast.respond([image], [question], pruning, max_new_tokens=4)
        want = eager.respond([image], [question], pruning, max_new_tokens=4)
        assert got.answers == want.answers
        assert same_cells(got.traces[0], want.traces[0])
        assert got.traces[0].bucket == want.traces[0].bucket
        assert got.traces[0].execution == "fast" and want.traces[0].execution == "eager"
        inputs = fast.build_inputs([[image]], [question])
        a, b = prepare_state(fast, inputs, 0.1, encode=encode), prepare_state(eager, inputs, 0.1, encode=encode)
        torch.testing.assert_close(fast.backend.prefill(a.pruned).logits, eager.backend.prefill(b.pruned).logits,
                                   rtol=1e-5, atol=1e-5)
        graphs.append(counter.frame_count)
    # the layer, the tower, the LM's prefill and decoding step, the logits-only prefill: captured once each for
    # the first question, replayed for the second
    assert graphs == [5, 5]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_fast_equals_eager_on_a_clip(tiny_vlm, family):
    model, processor = tiny_vlm(family)
    fast, eager, counter = pair(model, processor)
    rng = np.random.default_rng(0)
    clip = load_clip([rng.integers(0, 255, (56, 56, 3), dtype=np.uint8) for _ in range(4)], frame_rate=2, fps=None)
    pruning = Pruning.of("arr_coc", 0.25, encode="after")
    got = fast.respond([clip], ["What moves?"], pruning, max_new_tokens=4)
    want = eager.respond([clip], ["What moves?"], pruning, max_new_tokens=4)
    assert got.answers == want.answers
    assert same_cells(got.traces[0], want.traces[0])
    assert counter.frame_count > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_all_on_the_fast_path_answers_as_the_stock_model(tiny_vlm, make_image, family):
    model, processor = tiny_vlm(family)
    fast, _, counter = pair(model, processor)
    image = make_image(112, 84)
    got = fast.respond([image], ["What colour is the square?"], Pruning.of("none"), max_new_tokens=5)
    inputs = fast.build_inputs([[image]], ["What colour is the square?"])
    stock = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=fast.pad_token_id)
    want = fast.tokenizer.batch_decode(stock[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert got.answers == [w.strip() for w in want] or got.answers == want
    assert got.traces[0].bucket["prompt"] >= inputs["input_ids"].shape[1]     # ran padded, on its bucket
    assert counter.frame_count >= 3


def test_the_fast_flag_reads_on_off_auto():
    assert read_fast_flag("auto", "cpu").compiled is False              # measured slower on the CPU: eager
    assert read_fast_flag("on", "cpu").compiled and read_fast_flag(True, "cpu").buckets is not None
    assert read_fast_flag("off", "cpu") == Execution.eager()
    with pytest.raises(ValueError, match="on, off or auto"):
        read_fast_flag("sometimes", "cpu")


# Two kernel paths are compared at float32's rounding, not bit for bit: oneDNN picks its convolution kernels (and
# their order of accumulation) by instruction set, so an AVX2 CPU and an AVX-512 one round the same sums differently
# (issue 55: up to 6e-8 in 38% of the Sobel elements under AVX2). The values here lie in [-1, 1]; float32's spacing
# at 1 is 2**-23 = 1.2e-7, and a sum of n products in another order differs by at most n half-ulps: 9 taps for a
# Sobel (4.5 ulps, 5.4e-7), 2 x 11 taps for the separable blur (11 ulps, 1.3e-6). What must not move is a
# decision: the cells a layer keeps are compared exactly (`test_the_texture_s_two_kernel_paths_keep_the_same_cells`).
SOBEL_ATOL = 9 * 2.0 ** -24          # 9 taps, half an ulp at 1.0 each
BLUR_ATOL = 2 * 11 * 2.0 ** -24      # two 11-tap passes


def _sobel_per_map(x):
    """The two separate convolutions the grouped one replaced (one map at a time)."""
    import torch.nn.functional as F

    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 8.0
    return torch.cat([F.conv2d(F.pad(x[:, i: i + 1], (1, 1, 1, 1), mode="replicate"),
                               torch.stack([kx, kx.T]).unsqueeze(1)) for i in range(x.shape[1])], dim=1)


def test_both_maps_gradients_are_shifted_adds_on_the_cpu_and_one_grouped_convolution_elsewhere(monkeypatch):
    from arr_coc.core import texture
    from arr_coc.evaluation.opcount import OpCounter

    x = torch.rand(2, 2, 40, 56, generator=torch.Generator().manual_seed(0))
    alone = _sobel_per_map(x)                                               # each map alone, as before
    with OpCounter() as ops:
        out = texture.sobel_bank(x)                                         # [2, 4, 40, 56]: the CPU's shifted adds
    assert ops.ops.get("aten.convolution", 0) == 0
    torch.testing.assert_close(out, alone, atol=SOBEL_ATOL, rtol=0)         # other kernels: float32 rounding only
    assert (out[:, 0:2] - out[:, 2:4]).abs().max() > 100 * SOBEL_ATOL       # negative control: per map
    monkeypatch.setattr(texture, "shifted_sobel", lambda device: False)    # as a GPU or the compiler runs it
    with OpCounter() as ops:
        grouped = texture.sobel_bank(x)
    assert ops.ops.get("aten.convolution", 0) == 1
    torch.testing.assert_close(grouped, out, atol=SOBEL_ATOL, rtol=0)


def test_the_luminance_blur_on_the_cpu_is_the_convolutions_sums():
    """The texture's full-resolution blur (shifted fused multiply-adds on the CPU) equals the two convolutions it
    replaced within float32 rounding, on images as the texture sees them (widths of 16 px cells); negative
    control: one tap moved by 1e-5 is outside that tolerance."""
    from arr_coc.core.spectral import gaussian_blur
    from arr_coc.core.texture import BLUR_SIGMA, BLUR_TAPS

    g = torch.Generator().manual_seed(3)
    for h, w in ((256, 256), (512, 496), (112, 1024)):
        x = torch.rand(3, 1, h, w, generator=g)
        conv = gaussian_blur(x, BLUR_SIGMA)
        torch.testing.assert_close(gaussian_blur(x, BLUR_SIGMA, cpu_taps=BLUR_TAPS), conv, atol=BLUR_ATOL, rtol=0)
    moved = tuple(t + 1e-5 * (i == 5) for i, t in enumerate(BLUR_TAPS))
    assert (gaussian_blur(x, BLUR_SIGMA, cpu_taps=moved) - conv).abs().max() > 2 * BLUR_ATOL


def test_the_spectral_residual_s_phase_is_one_real_exp_within_rounding_of_two_complex_ones():
    """exp(residual + i * phase) as `torch.polar(exp(residual), phase)` (what `spectral_residual` computes) equals
    exp(residual + 0i) * exp(i * phase) (what it computed) within 2 ulps, on the spectra of texture thumbnails; a
    phase moved by 1e-4 is not."""
    from conftest import shapes_image

    for seed in range(3):
        luma = torch.from_numpy(np.asarray(shapes_image(224, 280, seed), dtype=np.float32) / 255).mean(-1)
        thumb = torch.nn.functional.interpolate(luma[None, None], size=(51, 64), mode="area")   # [1, 1, 51, 64]
        spectrum = torch.fft.fft2(thumb[:, 0])
        residual = torch.randn(spectrum.shape, generator=torch.Generator().manual_seed(seed))
        before = torch.exp(torch.complex(residual, torch.zeros_like(residual))) * torch.exp(1j * spectrum.angle())
        now = torch.polar(torch.exp(residual), spectrum.angle())
        torch.testing.assert_close(torch.view_as_real(now), torch.view_as_real(before), atol=0,
                                   rtol=2 * 2.0 ** -23)
    moved = torch.polar(torch.exp(residual), spectrum.angle() + 1e-4)     # negative control: a phase moved by 1e-4
    assert not torch.allclose(torch.view_as_real(moved), torch.view_as_real(before), atol=0, rtol=2 * 2.0 ** -23)


def test_the_texture_s_two_kernel_paths_keep_the_same_cells(monkeypatch):
    """The decisions are exact: a layer keeps the same cells with the texture's CPU kernels (the grouped Sobel,
    the blur's shifted multiply-adds, k-means stopping at a fixed point) and with the paths a GPU runs and the
    convolutions they replaced, at several budgets; relevance within float32 rounding."""
    import arr_coc.core.texture as texture
    from arr_coc.core.config import ARRCOCConfig
    from arr_coc.core.grid import as_on_a_gpu
    from arr_coc.core.layer import ARRCOCLayer
    from conftest import shapes_image

    torch.manual_seed(0)
    layer = ARRCOCLayer(ARRCOCConfig().with_query_dim(32)).eval()
    with torch.no_grad():   # trained-looking: the texture's channels move the relevance
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    images = [shapes_image(224, 280, seed) for seed in range(4)]
    grids = [(14, 17)] * 4
    query = [torch.randn(5, 32, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def run():
        with torch.no_grad():
            return [layer(images, grids, query_embeds=query, budget=b, budget_mode="exact") for b in (0.05, 0.1, 0.25)]

    fast = run()
    monkeypatch.setattr(texture, "BLUR_TAPS", None)           # the blur as two convolutions
    monkeypatch.setattr(texture, "sobel_bank", _sobel_per_map)  # the gradients as one convolution per map
    with as_on_a_gpu():
        plain = run()
    for a, b in zip(fast, plain):
        assert [k.tolist() for k in a.kept_indices] == [k.tolist() for k in b.kept_indices]
        torch.testing.assert_close(a.relevance, b.relevance, atol=1e-6, rtol=0)
    monkeypatch.setattr(texture, "sobel_bank", lambda x: 2 * _sobel_per_map(x))   # negative control: the patch runs
    assert (run()[0].relevance - fast[0].relevance).abs().max() > 1e-3


def test_the_fast_path_runs_an_adapter_only_where_tokens_were_pruned(make_image):
    from arr_coc.qwen.adapter import attach_adapter
    from arr_coc.qwen.tiny import build_tiny_qwen

    model, processor = build_tiny_qwen("qwen2_vl", seed=0)              # its own model: peft changes it
    adapter = attach_adapter(model, rank=4, alpha=8.0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    fast, eager, counter = pair(model, processor, adapter=adapter)
    image = make_image(112, 112)
    for pruning in (Pruning.of("arr_coc", 0.25, encode="before"), Pruning.of("none")):
        got = fast.respond([image], ["Where is the circle?"], pruning, max_new_tokens=4)
        want = eager.respond([image], ["Where is the circle?"], pruning, max_new_tokens=4)
        assert got.answers == want.answers and got.traces[0].adapter == want.traces[0].adapter
    assert [fast.respond([image], ["Where?"], p, max_new_tokens=2).traces[0].adapter
            for p in (Pruning.of("arr_coc", 0.25), Pruning.of("none"))] == ["adapter", ""]


def test_a_second_look_runs_the_stock_tower_with_its_memory_and_answers_as_eagerly(tiny_vlm, make_image):
    from arr_coc.encode import EncodeConfig
    from arr_coc.saccade import SaccadeConfig

    model, processor = tiny_vlm("qwen2_vl")
    fast, eager, _ = pair(model, processor)
    looks = EncodeConfig("before", saccade=SaccadeConfig(passes=2, threshold=0.0, budget=0.1))   # always looks again
    pruning = Pruning.of("arr_coc", 0.1, encode=looks)
    got = fast.respond([make_image(112, 112)], ["Where is the circle?"], pruning, max_new_tokens=3)
    want = eager.respond([make_image(112, 112)], ["Where is the circle?"], pruning, max_new_tokens=3)
    assert len(got.traces[0].looks) == 2 and got.answers == want.answers
    assert same_cells(got.traces[0], want.traces[0])


def test_packed_attention_over_unequal_images_is_each_images_own_attention():
    """The tower's packed attention (segments of unequal length: a batch of images in different buckets, or
    Qwen2.5-VL's windows) equals sdpa run on each segment alone, and compiles as one graph; a patch never attends
    to another segment (negative control: the same call told the segments are one gives another answer)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from arr_coc.qwen.packed_attention import packed_attention

    g = torch.Generator().manual_seed(0)
    lengths = [5, 12, 1, 7]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    q, k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(3))       # [1, H, S, D]
    module = torch.nn.Module()
    module.is_causal, module.training = False, False
    got, _ = packed_attention(module, q, k, v, cu_seq_lens_q=cu, max_length_q=max(lengths))
    want = torch.cat([sdpa(*(x[:, :, a:b] for x in (q, k, v))).transpose(1, 2)
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)        # [1, S, H, D]
    assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    one = torch.tensor([0, sum(lengths)], dtype=torch.int32)
    mixed, _ = packed_attention(module, q, k, v, cu_seq_lens_q=one, max_length_q=sum(lengths))
    assert not torch.allclose(mixed, want, atol=1e-3)
    counter = CompileCounter()
    compiled = torch.compile(lambda a, b, c, s: packed_attention(module, a, b, c, cu_seq_lens_q=s,
                                                                 max_length_q=max(lengths))[0],
                             backend=counter, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(q, k, v, cu), got) and counter.frame_count == 1


# -- what the fast path says (issue 55) ----------------------------------------------------------------------


def test_each_new_bucket_is_announced_once_per_stage_before_it_compiles(tiny_vlm, make_image, caplog):
    """`--fast on` compiled for minutes on the CPU with no word: now a line per stage and new shape, naming the
    stage and saying it happens once per shape; a second request of the same bucket says nothing."""
    import logging

    model, processor = tiny_vlm("qwen2_vl")
    fast, _, counter = pair(model, processor)
    image = make_image(112, 112)
    pruning = Pruning.of("arr_coc", 0.1, encode="before")
    with caplog.at_level(logging.WARNING, logger="arr_coc.execution"):
        fast.respond([image], ["Where is the red circle?"], pruning, max_new_tokens=2)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        fast.respond([image], ["Where is the blue square?"], pruning, max_new_tokens=2)   # the same bucket
        assert [r.getMessage() for r in caplog.records] == []
    stages = " ".join(first)
    for stage in ("the ARR-COC layer's device pass", "the vision tower", "the language model"):
        assert f"compiling {stage} for a new bucket" in stages, first
    assert all("once per shape" in m for m in first) and len(first) == counter.frame_count


def test_fast_on_the_cpu_warns_that_it_is_slower_there(caplog):
    import logging

    from arr_coc.execution import CPU_NOTE

    with caplog.at_level(logging.WARNING, logger="arr_coc.execution"):
        read_fast_flag("on", "cpu")
        read_fast_flag("auto", "cpu")
        read_fast_flag("on", "cuda")
    assert [r.getMessage() for r in caplog.records] == [CPU_NOTE] and "slower than eager" in CPU_NOTE


def test_the_trace_and_ask_say_the_cells_chosen_and_the_cells_after_filling(tiny_vlm, make_image, capsys,
                                                                            monkeypatch, tmp_path):
    """Filling to a bucket keeps more cells than the method chose (by design): the trace's bucket and `ask --json`
    say both, and the chosen count is what eager execution without buckets keeps."""
    import json

    from arr_coc.cli import main

    model, processor = tiny_vlm("qwen2_vl")
    bucketed = ARRCOCQwen(model, processor, execution=Execution(buckets=Buckets()))
    plain = ARRCOCQwen(model, processor)
    image = make_image(140, 168)
    pruning = Pruning.of("arr_coc", 0.1, encode="before")
    got = bucketed.respond([image], ["Where is the red circle?"], pruning, max_new_tokens=1).traces[0]
    want = plain.respond([image], ["Where is the red circle?"], pruning, max_new_tokens=1).traces[0]
    assert got.bucket["chosen"] == [want.kept_tokens] and got.bucket["filled"] == [got.kept_tokens]
    assert got.bucket["chosen"][0] < got.bucket["filled"][0]                 # this budget's bucket adds cells
    assert want.bucket is None
    image.save(tmp_path / "p.png")
    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(lambda cls, *a, **k: bucketed))
    assert main(["ask", "--image", str(tmp_path / "p.png"), "--question", "Where is the red circle?", "--budget",
                 "0.1", "--encode", "before", "--max-new-tokens", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bucket"]["chosen"] == want.kept_tokens and out["bucket"]["filled"] == out["kept_tokens"] > \
        want.kept_tokens
