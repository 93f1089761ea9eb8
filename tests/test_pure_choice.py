"""The pure choice (`arr_coc.choose`) keeps, on a real VLM, exactly the cells the pipeline keeps: three Qwen families,
after and before the tower, every method that can run without the VLM, a clip; from the processor's patches (what
a serving engine's model class holds) and from the same pictures on the host. The question changes what is kept;
methods that read the VLM are refused in one line."""

from __future__ import annotations

import pytest
import torch

from arr_coc import ARRCOCQwen, choose
from arr_coc.pipeline import Pruning
from arr_coc.qwen.processing import unpatchify_images

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QUESTION = "What colour is the circle on the left?"


def _pipeline_and_parts(vlm, image, question, pruning):
    """The pipeline's kept cells for one image, and the pure choice's inputs read off the same request."""
    backend = vlm.backend
    inputs = backend.build_inputs([[image]], [question])
    kept = vlm.prepare(inputs, pruning).traces[0].kept_indices[0]
    prompt = backend.read_prompt(inputs, encode_all=not pruning.before)
    ids = backend.question_tokens(prompt)[0]
    return kept, prompt, ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("encode", ["after", "before"])
def test_the_pure_choice_keeps_the_pipelines_cells_on_every_family(tiny_vlm, make_image, family, encode):
    vlm = ARRCOCQwen(*tiny_vlm(family))
    image = make_image(112, 168, seed=3)
    for method in ("arr_coc", "random", "grid") + (("divprune", "cdpruner") if encode == "after" else ()):
        kept, prompt, ids = _pipeline_and_parts(vlm, image, QUESTION, Pruning.of(method, 0.25, encode=encode))
        tokens = None if prompt.feats is None else list(prompt.feats)
        patches = choose(vlm.backend.pixels(prompt), prompt.grid_hw, [ids], vlm.backend.embed_tokens,
                         layer=vlm.layer, method=method, budget=0.25, visual_tokens=tokens)
        assert torch.equal(patches.kept[0], kept), (method, encode)
        assert torch.equal(vlm.choose(image, QUESTION, 0.25, method, encode=encode).kept[0], kept)
        if method == "arr_coc":
            assert patches.output is not None and patches.output.relevance.shape[0] == 1   # the microscope's maps


@pytest.mark.parametrize("family", FAMILIES)
def test_host_pictures_choose_the_same_cells_as_the_patches(tiny_vlm, make_image, family):
    """The texture from the rebuilt picture equals the one read from the patches (`qwen/pixels.py`), so a caller
    holding pictures rather than patches keeps the same cells (decisions compared exactly)."""
    vlm = ARRCOCQwen(*tiny_vlm(family))
    image = make_image(140, 112, seed=5)
    kept, prompt, ids = _pipeline_and_parts(vlm, image, QUESTION, Pruning.of("arr_coc", 0.2, encode="before"))
    native = prompt.native
    pictures = unpatchify_images(native.inputs["pixel_values"], native.grid_thw, vlm.processor.image_processor)
    host = choose(pictures, prompt.grid_hw, [ids], vlm.backend.embed_tokens, layer=vlm.layer, budget=0.2)
    assert torch.equal(host.kept[0], kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_cpu_pools_the_patches_channels_last_within_rounding_of_each_plane_alone(tiny_vlm, make_image, family,
                                                                                    monkeypatch):
    """On the CPU the patches are pooled to the texture's pixels as one channels-last picture (`qwen/pixels.py`):
    other sums than the per-plane pooling an accelerator runs, the same pixels within float32 rounding (values in
    [0, 1], windows of at most 3 x 3) and the same cells kept."""
    from arr_coc.qwen import pixels

    vlm = ARRCOCQwen(*tiny_vlm(family))
    images = [make_image(140, 112, seed=5), make_image(84, 196, seed=6)]
    inputs = vlm.build_inputs([[im] for im in images], [QUESTION] * 2)
    patches = pixels.PatchImages.of(inputs["pixel_values"], inputs["image_grid_thw"], vlm.processor)
    px = vlm.layer.config.texture.work_px

    def run():
        return patches.work(px).pixels, [vlm.choose(im, QUESTION, 0.2, encode="before").kept[0] for im in images]

    last, kept_last = run()
    monkeypatch.setattr(pixels, "pool_planes_last", lambda device: False)       # each plane alone, as a GPU does
    planes, kept_planes = run()
    torch.testing.assert_close(last, planes, atol=9 * 2.0 ** -24, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(kept_last, kept_planes))
    assert (last - patches.subset([1, 0]).work(px).pixels).abs().max() > 0.1    # negative control: other pictures


def test_the_pure_choice_reads_the_patches_without_rebuilding_the_pictures(tiny_vlm, make_image, monkeypatch):
    """A serving engine hands `choose` the processor's patches (`PatchImages`), as vLLM's model does: ARR-COC before
    the tower reads them at the texture's pixels and never rebuilds the host pictures (Python 3.11's protocol check
    used to, for every request: `is_unit_pixels`); each image's rows are chosen alone, as views, the same cells as
    the pipeline's. Negative control: asking for the pictures rebuilds them, once."""
    from arr_coc.qwen import pixels

    vlm = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    images = [make_image(140, 112, seed=5), make_image(84, 196, seed=6)]
    inputs = vlm.build_inputs([[im] for im in images], [QUESTION] * 2)
    rebuilt = []
    monkeypatch.setattr(pixels, "unpatchify_images", lambda *a: rebuilt.append(a) or unpatchify_images(*a))
    patches = pixels.PatchImages.of(inputs["pixel_values"], inputs["image_grid_thw"], vlm.processor)
    ids = vlm.backend.question_tokens(vlm.backend.read_prompt(inputs, encode_all=False))
    grid_hw = [(h // 2, w // 2) for _, h, w in patches.grid_thw]
    chosen = choose(patches, grid_hw, ids, vlm.backend.embed_tokens, layer=vlm.layer, budget=0.2)
    assert rebuilt == []
    assert [k.tolist() for k in chosen.kept] == [vlm.choose(im, QUESTION, 0.2, encode="before").kept[0].tolist()
                                                 for im in images]
    one, rows = patches.subset([1]).pixel_values, patches.pixel_values
    assert one.data_ptr() == rows[len(rows) - len(one):].data_ptr()              # the second image's rows, not a copy
    assert len(patches.images) == 2 and len(rebuilt) == 1


def test_the_question_changes_the_pure_choice_of_the_trained_layer():
    """The shipped before-mode layer reads the question from its embeddings: another question keeps other cells
    (and the same question the same ones: the negative control)."""
    from arr_coc_shapes import make_item

    vlm = ARRCOCQwen.from_pretrained("checkpoints/shapes-qwen2vl", arr_coc="checkpoints/arr-coc-shapes-before")
    item = make_item(0, "pure", 3)
    colour = vlm.choose(item.image, "What color is the star?", 0.05, encode="before").kept[0]
    again = vlm.choose(item.image, "What color is the star?", 0.05, encode="before").kept[0]
    other = vlm.choose(item.image, "How many circles are there?", 0.05, encode="before").kept[0]
    assert torch.equal(colour, again) and not torch.equal(colour, other)


def test_a_clip_is_chosen_over_space_and_time_as_the_pipeline_chooses(tiny_vlm):
    import numpy as np

    from arr_coc.video import load_clip

    frames = np.full((8, 84, 112, 3), 200, np.uint8)
    for k in range(8):                                   # a dark square moving right, 8 px per frame
        frames[k, 30:50, 10 + 8 * k: 30 + 8 * k] = (20, 40, 200)
    clip = load_clip(frames)
    vlm = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    done = vlm.prepare(vlm.backend.build_inputs([[clip]], ["What moves first?"]), Pruning.of("arr_coc", 0.2))
    chosen = vlm.choose(clip, "What moves first?", 0.2)
    assert [k.tolist() for k in chosen.kept] == [k.tolist() for k in done.traces[0].kept_indices]
    assert sum(len(k) for k in chosen.kept) == done.traces[0].kept_tokens


def test_a_budget_of_every_token_keeps_every_token_in_the_pure_choice(tiny_vlm, make_image):
    """As in the pipeline (issue 55): 1.0, "100%" or a count of every cell keeps every cell in every budget mode, and
    a batch mixing it with a smaller budget prunes only the other unit (negative control)."""
    vlm = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    image = make_image(84, 112, seed=2)
    for budget in (1.0, "100%", 10_000):
        for mode in (None, "exact", "mean", "adaptive"):
            chosen = vlm.choose(image, QUESTION, budget, budget_mode=mode)
            assert chosen.kept[0].tolist() == list(range(12)), (budget, mode)
    inputs = vlm.backend.build_inputs([[image, image]], [QUESTION])
    prompt = vlm.backend.read_prompt(inputs, encode_all=True)
    ids = vlm.backend.question_tokens(prompt)[0]
    mixed = choose(vlm.backend.pixels(prompt), prompt.grid_hw, [ids, ids], vlm.backend.embed_tokens,
                   layer=vlm.layer, budget=[1.0, 0.25], visual_tokens=list(prompt.feats))
    assert mixed.kept[0].tolist() == list(range(12)) and len(mixed.kept[1]) == 3


def test_methods_that_read_the_vlm_are_refused(tiny_vlm, make_image):
    vlm = ARRCOCQwen(*tiny_vlm("qwen2_vl"))
    for method, reads in (("fastv", "the language model's attention"), ("visionzip", "the tower's attention")):
        with pytest.raises(ValueError, match=f"method '{method}' reads {reads}, so it needs the VLM"):
            vlm.choose(make_image(56, 56), QUESTION, 0.25, method)
