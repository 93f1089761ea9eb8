"""Video in the pruning path: a clip's temporal groups as units, exact with every token kept, one budget
over space and time (arr_coc/qwen/units.py, arr_coc/core/temporal.py, arr_coc/methods/over_time.py).

The inputs here are built by hand the way each family's stock processor lays them out (pads per video for
Qwen2-VL / Qwen2.5-VL, per temporal group after a timestamp for Qwen3-VL), so these tests do not depend on
the project's own video processor (tests/test_video_input.py checks that one).
"""

from __future__ import annotations

from _pruned import forward_pruned, prepare_state  # noqa: F401
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from arr_coc.core.config import TemporalConfig
from arr_coc.qwen.prompt import visual_units
from arr_coc.qwen.wrapper import ARRCOCQwen
from arr_coc.core.temporal import allocate, carry, carry_matrix, clip_signals, scene_cuts, spread_clip, time_weights

from conftest import FAMILIES


def video_inputs(model, processor, t: int = 2, grid=(4, 6), image: bool = False, question: str = "What moves?",
                 seed: int = 0, pixels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One prompt with a video of t temporal groups (and an image first, if asked), as the stock processor of
    the model's family lays it out. pixels: the video's patch rows [t * gh * gw, C * T * p * p], else random."""
    family = model.config.model_type
    ip, tok = processor.image_processor, processor.tokenizer
    p, tp, m = ip.patch_size, ip.temporal_patch_size, ip.merge_size
    gh, gw = grid
    g = torch.Generator().manual_seed(seed)
    per_group = gh * gw // m ** 2
    if family == "qwen3_vl":
        video = "".join(f"<{k + 0.25:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_group + "<|vision_end|>"
                        for k in range(t))
    else:
        video = "<|vision_start|>" + "<|video_pad|>" * (per_group * t) + "<|vision_end|>"
    out: dict[str, torch.Tensor] = {}
    text = "<|im_start|>user\n"
    if image:
        out["pixel_values"] = torch.randn(16, 3 * tp * p * p, generator=g)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]])
        text += "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"
    text += video + question + "<|im_end|>\n<|im_start|>assistant\n"
    enc = tok([text], return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"]
    out.update(input_ids=ids, attention_mask=enc["attention_mask"],
               mm_token_type_ids=(ids == model.config.image_token_id).long() + 2 * (ids == model.config.video_token_id).long(),
               pixel_values_videos=torch.randn(t * gh * gw, 3 * tp * p * p, generator=g) if pixels is None else pixels,
               video_grid_thw=torch.tensor([[t, gh, gw]]))
    if family == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([1.0])
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("image", [False, True])
def test_keep_all_on_video_equals_stock_logits(tiny_vlm, family, image):
    """Every token kept, after and before the tower: the stock model's logits, bit for bit (the tower encodes
    a video group by group, so its groups encoded as pictures are the same arithmetic)."""
    model, processor = tiny_vlm(family)
    wrapper = ARRCOCQwen(model, processor)
    inputs = video_inputs(model, processor, t=3, image=image)
    with torch.no_grad():
        stock = model(**inputs).logits
    for encode in ("after", "before"):
        out = forward_pruned(wrapper, method="none", encode=encode, **inputs)
        assert torch.equal(out.logits, stock), (family, encode)
    # Negative control: the same tokens with two groups' features swapped is another video.
    feats = list(out.pruned.image_features)
    v = [i for i, k in enumerate(out.pruned.unit_kind) if k == 2]
    feats[v[0]], feats[v[1]] = feats[v[1]], feats[v[0]]
    swapped = model(**out.pruned.with_features(image_features=feats).model_kwargs()).logits
    assert not torch.allclose(swapped, stock, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_video_tokens_keep_their_time_positions(tiny_vlm, family):
    """A pruned video's tokens keep their stock (t, h, w) M-RoPE positions (Qwen2.5-VL's scaled by
    second_per_grid_ts), and equal the stock model's logits with the dropped tokens masked out."""
    model, processor = tiny_vlm(family)
    wrapper = ARRCOCQwen(model, processor)
    inputs = video_inputs(model, processor, t=4)
    if family == "qwen2_5_vl":
        inputs["second_per_grid_ts"] = torch.tensor([0.5])
    out = forward_pruned(wrapper, method="random", budget=0.4, **inputs)
    mm = inputs["mm_token_type_ids"]
    rope = {k: inputs[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in inputs}
    pos, _ = model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=mm, attention_mask=inputs["attention_mask"],
                                        **rope)
    orig = out.pruned.orig_index[0]
    real = orig >= 0
    assert torch.equal(out.pruned.position_ids[1:, 0][:, real], pos[:, 0, orig[real]])
    times = pos[0, 0][mm[0] == 2].unique()
    assert len(times) == 4 and (len(set(np.diff(times.numpy()))) == 1)


@pytest.mark.parametrize("method", ["arr_coc", "evs", "uniform_frames"])
def test_batch_of_a_video_and_an_image_equals_each_alone(tiny_vlm, make_image, method):
    model, processor = tiny_vlm("qwen2_vl")
    wrapper = ARRCOCQwen(model, processor)
    video = video_inputs(model, processor, t=4, question="What happens at the end?")
    image = wrapper.build_inputs([[make_image(56, 84, seed=3)]], ["What colour is the square?"])
    alone = [forward_pruned(wrapper, method=method, budget=0.3, **x) for x in (video, image)]
    both = _stack(video, image, pad=wrapper.pad_token_id)
    out = forward_pruned(wrapper, method=method, budget=0.3, **both)
    kept = [k.tolist() for k in out.pruned.kept_indices]
    assert kept == [k.tolist() for a in alone for k in a.pruned.kept_indices]
    for row, a in enumerate(alone):
        n = a.logits.shape[1]
        torch.testing.assert_close(out.logits[row, -n:], a.logits[0], atol=1e-4, rtol=1e-4)


def _stack(a: dict, b: dict, pad: int) -> dict:
    """Two one-row processor outputs as one left-padded batch (video rows first, then image rows)."""
    n = max(a["input_ids"].shape[1], b["input_ids"].shape[1])

    def left(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (n - x.shape[1], 0), value=value)

    out = {k: torch.cat([left(a[k], pad if k == "input_ids" else 0), left(b[k], pad if k == "input_ids" else 0)])
           for k in ("input_ids", "attention_mask", "mm_token_type_ids")}
    for k in ("pixel_values", "image_grid_thw"):
        out[k] = b[k]
    for k in ("pixel_values_videos", "video_grid_thw"):
        out[k] = a[k]
    return out


def test_units_split_a_video_into_groups_in_prompt_order(tiny_vlm):
    model, processor = tiny_vlm("qwen2_vl")
    inputs = video_inputs(model, processor, t=3, image=True)
    units = visual_units(inputs["mm_token_type_ids"], inputs["attention_mask"], inputs["image_grid_thw"],
                         inputs["video_grid_thw"], 2)
    assert units.kind == [1, 2, 2, 2] and units.clip == [-1, 0, 0, 0] and units.group == [0, 0, 1, 2]
    assert [e - s for _, s, e in units.spans] == [4, 6, 6, 6]
    assert units.spans[1][2] == units.spans[2][1]                     # Qwen2-VL: one run, cut per group
    assert units.rows.tolist()[:16] == list(range(16)) and units.rows[16] == 16
    bad = inputs["video_grid_thw"].clone()
    bad[0, 0] = 4
    with pytest.raises(ValueError, match="do not match its grid|pads for"):
        visual_units(inputs["mm_token_type_ids"], inputs["attention_mask"], inputs["image_grid_thw"], bad, 2)


def test_question_about_the_end_spends_the_budget_at_the_end(tiny_vlm):
    """The same clip, two questions: about its end, most kept tokens are in the last half; about its start, in
    the first half."""
    model, processor = tiny_vlm("qwen2_vl")
    wrapper = ARRCOCQwen(model, processor)
    late = early = None
    for question in ("What colour is the square at the end?", "What colour is the square at the start?"):
        inputs = video_inputs(model, processor, t=8, grid=(6, 6), question=question, seed=1)
        kept = forward_pruned(wrapper, method="arr_coc", budget=0.25, **inputs).traces[0].kept_per_image
        share_late = sum(kept[4:]) / sum(kept)
        late, early = (share_late, early) if "end" in question else (late, share_late)
    assert late > 0.75 and early < 0.25


def test_methods_that_cannot_do_video_say_so(tiny_vlm):
    model, processor = tiny_vlm("qwen2_vl")
    wrapper = ARRCOCQwen(model, processor)
    inputs = video_inputs(model, processor)
    for method in ("fastv", "visionzip"):
        with pytest.raises(ValueError, match=f"Method '{method}' cannot prune a video.*arr_coc"):
            forward_pruned(wrapper, method=method, budget=0.3, **inputs)
    with pytest.raises(ValueError, match="'evs' reads the encoded visual tokens.*encode='after'"):
        forward_pruned(wrapper, method="evs", encode="before", budget=0.3, **inputs)


# -- the temporal core, on synthetic signals --------------------------------------------------------------

def test_carried_relevance_resets_at_a_scene_cut():
    cut = torch.tensor([True, False, False, True, False])
    w = carry_matrix(cut, 0.5)
    torch.testing.assert_close(w.sum(1), torch.ones(5))                 # a weighted mean of the scene's groups
    assert torch.all(w[3:, :3] == 0) and torch.all(w[:3, 3:] == 0)     # nothing crosses the cut
    no_reset = carry_matrix(torch.tensor([True, False, False, False, False]), 0.5)
    assert no_reset[3, :3].sum() > 0.4                                 # negative control: without it, it would
    relevance = torch.zeros(5, 2, 2)
    relevance[:3, 0, 0] = 1.0                                           # relevant in the first scene only
    for mode in ("max", "motion", "mean"):
        assert float(carry(relevance, cut, 0.8, mode)[3, 0, 0]) == 0.0, mode          # nothing crosses the cut
        one_scene = torch.tensor([True, False, False, False, False])
        assert float(carry(relevance, one_scene, 0.8, mode)[3, 0, 0]) > 0.1, mode     # negative control


def test_scene_cut_is_a_new_histogram_not_a_pan():
    g = torch.Generator().manual_seed(0)
    scene = torch.rand(3, 8, 12, generator=g)
    other = torch.rand(3, 8, 12, generator=g) * 0.3 + 0.7               # other colours
    frames = torch.stack([scene, torch.roll(scene, 1, dims=2), torch.roll(scene, 2, dims=2), other, other])
    assert scene_cuts(frames, 0.6).tolist() == [True, False, False, True, False]


def test_allocate_keeps_k_with_a_floor_per_group():
    score = torch.zeros(4, 3, 3)
    score[3] = 1.0                                                      # everything relevant is at the end
    keep = allocate(score, 10, min_per_group=1)
    assert int(keep.sum()) == 10 and keep.flatten(1).sum(1).tolist() == [1, 1, 1, 7]
    assert allocate(score, 10, min_per_group=2).flatten(1).sum(1).tolist() == [2, 2, 2, 4]   # the floor moves it
    assert allocate(score, 10, min_per_group=0).flatten(1).sum(1).tolist() == [1, 1, 1, 7]   # never below one a group


def test_time_weights_follow_the_question():
    assert time_weights("What appears last?", 4, 2.0, torch.device("cpu")).argmax() == 3
    assert time_weights("What is there at the start?", 4, 2.0, torch.device("cpu")).argmax() == 0
    assert torch.all(time_weights("What colour is the star?", 4, 2.0, torch.device("cpu")) == 1)


def test_static_cells_are_paid_once_and_carry_smooths():
    """A cell that did not change since the previous group scores static_weight of a changed one; carried relevance
    is the decayed maximum (never below the group's own), or with carry="mean" a smoothing that changes less from
    group to group than the raw relevance."""
    t, h, w = 6, 4, 4
    g = torch.Generator().manual_seed(0)
    relevance = torch.rand(t, h, w, generator=g)
    colours = torch.zeros(t, 3, h, w)
    colours[:, :, 0, 0] = torch.arange(t).float()[:, None] / t          # only cell (0, 0) changes
    sig = clip_signals(relevance, colours, None, TemporalConfig(decay=0.5, static_weight=0.25, carry="motion"))
    assert torch.allclose(sig.score[1:, 1:, 1:], 0.25 * sig.carried[1:, 1:, 1:])
    assert torch.allclose(sig.score[1:, 0, 0], sig.carried[1:, 0, 0])
    assert torch.all(sig.carried[:, 0, 0] >= relevance[:, 0, 0])         # a changed cell is never lowered ("max")
    assert torch.all(sig.carried[1:, 0, 0] >= 0.5 * sig.carried[:-1, 0, 0] - 1e-6)  # what was relevant fades
    torch.testing.assert_close(sig.carried[1:, 1:, 1:], 0.5 * sig.carried[:-1, 1:, 1:] + 0.5 * relevance[1:, 1:, 1:])
    smooth = clip_signals(relevance, colours, None, TemporalConfig(decay=0.5, carry="mean")).carried
    raw = (relevance[1:] - relevance[:-1]).abs().mean()
    assert (smooth[1:] - smooth[:-1]).abs().mean() < 0.7 * raw           # "mean": exponential smoothing


def test_carry_over_stops_the_allocation_jumping_between_near_ties():
    """The design's failure mode: two still objects of almost equal relevance whose order flips from group to group
    by noise. Per-group selection jumps between them; relevance smoothed where nothing changed (carry="motion")
    keeps the first choice (negative controls: nothing carried, and the default decayed maximum, both jump)."""
    t, h, w = 8, 4, 4
    relevance = torch.zeros(t, h, w)
    relevance[:, 0, 0] = 0.90 + 0.02 * (torch.arange(t) % 2)           # object A: 0.90, 0.92, 0.90, ...
    relevance[:, 3, 3] = 0.92 - 0.02 * (torch.arange(t) % 2)           # object B: 0.92, 0.90, 0.92, ...
    colours = torch.full((t, 3, h, w), 0.5)                              # the objects stay put: their relevance is noise

    def picks(decay: float, mode: str) -> list[int]:
        keep, _ = spread_clip(relevance, colours, None, t, TemporalConfig(decay=decay, carry=mode, min_per_group=1))
        return [int(k.reshape(-1).nonzero()[0]) for k in keep]

    assert len(set(picks(0.8, "motion"))) == 1 and len(set(picks(0.8, "mean"))) == 1
    assert len(set(picks(0.0, "motion"))) == 2 and len(set(picks(0.8, "max"))) == 2


@pytest.fixture(scope="module")
def shipped():
    """The embedded model's question embeddings and the shipped before-mode layer."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from arr_coc.core.layer import ARRCOCLayer
    from arr_coc.paths import default_layer_path, default_model_path

    path = default_model_path()
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    layer = ARRCOCLayer.from_pretrained(default_layer_path("before")).eval()

    def embed(question: str) -> torch.Tensor:
        with torch.no_grad():
            return model.get_input_embeddings()(torch.tensor(tok(question, add_special_tokens=False)["input_ids"]))
    return layer, embed


def test_kept_cells_follow_the_target_through_a_pan(shipped):
    """ShapesVQA-video clips with a panning camera and a question naming one object (the image set's "Is there a
    <color> <shape>?", no word about time): at 10% of the clip's cells, the kept cells cover most of the object in
    every group (the pan moves it across the grid), and carrying relevance over does not make the kept set change
    more from group to group than per-group selection does."""
    from arr_coc.evaluation.coherence import clip_coherence, named_object, summary, without_carry
    from arr_coc_shapes.video import make_clip_item

    layer, embed = shipped
    config = TemporalConfig()
    runs: dict[str, list] = {"carry": [], "none": []}
    index = 0
    while len(runs["carry"]) < 6 and index < 400:
        frames, rec, track = make_clip_item(seed=0, split="val", index=index)
        index += 1
        picked = named_object(rec, track)
        if picked is None:
            continue
        target, question = picked
        for name, cfg in (("carry", config), ("none", without_carry(config))):
            runs[name].append(clip_coherence(layer, frames, target, question, embed(question), 0.1, cfg))
    assert len(runs["carry"]) == 6
    carry, none = summary(runs["carry"]), summary(runs["none"])
    assert carry["coverage"] >= 0.6, carry
    assert carry["jitter"] <= none["jitter"] + 1e-9, (carry, none)


# -- end to end: a clip through the project's own video processor -----------------------------------------

def _clip(n: int = 8, seed: int = 0):
    from arr_coc.video import load_clip
    rng = np.random.default_rng(seed)
    frames = np.full((n, 84, 112, 3), 200, np.uint8)
    for k in range(n):                                  # a dark square moving right, 8 px per frame
        frames[k, 30:50, 10 + 8 * k: 30 + 8 * k] = (20, 40, 200)
    frames += rng.integers(0, 8, frames.shape, dtype=np.uint8)
    return load_clip(frames)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_answers_a_clip_and_keep_all_is_the_stock_model(tiny_vlm, make_image, family):
    """`generate(clip, question)` reads a video (not a multi-image prompt); with every token kept its prefill is the
    stock model's on the processor's tensors, and a batch of the clip and an image gives each the answer alone."""
    model, processor = tiny_vlm(family)
    wrapper = ARRCOCQwen(model, processor)
    clip = _clip()
    inputs = wrapper.build_inputs([[clip]], ["What moves?"])
    assert "pixel_values_videos" in inputs and int(inputs["video_grid_thw"][0, 0]) == 4
    with torch.no_grad():
        stock = model(**inputs).logits
    assert torch.equal(forward_pruned(wrapper, method="none", **inputs).logits, stock)
    alone, trace = wrapper.generate(clip, "What moves?", budget=0.3, max_new_tokens=3)
    assert trace.clip_per_image == [0] * 4 and len(trace.kept_per_group) == 1
    image = make_image(56, 84, seed=1)
    answers, traces = wrapper.generate([clip, image], ["What moves?", "What colour is it?"], budget=0.3,
                                       max_new_tokens=3)
    assert answers[0] == alone and traces[0].kept_indices[0].tolist() == trace.kept_indices[0].tolist()
    assert answers[1] == wrapper.generate(image, "What colour is it?", budget=0.3, max_new_tokens=3)[0]


def _write_mp4(path, frames, rate: int = 4) -> None:
    import av
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def test_cli_ask_video_and_its_refusals(tiny_vlm, tmp_path, capsys):
    """`ask --video` answers a clip with one budget over its groups; a truncated file, a missing one and a one-frame
    clip are refused with their message and exit 2, no traceback."""
    model, processor = tiny_vlm("qwen2_vl")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(str(folder))
    clip = tmp_path / "clip.mp4"
    _write_mp4(clip, _clip(8).frames)
    from arr_coc.cli import main
    assert main(["ask", "--model", str(folder), "--video", str(clip), "--question", "What moves?", "--budget", "0.3",
                 "--max-new-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["frames"] == 4 and len(out["kept_per_group"]) == 2 and sum(out["kept_per_group"]) == out["kept_tokens"]
    assert out["kept_tokens"] == round(0.3 * out["total_tokens"])
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(clip.read_bytes()[: clip.stat().st_size // 2])
    one = tmp_path / "one.mp4"
    _write_mp4(one, _clip(1).frames)
    for path, words in ((broken, "truncated|damaged|could not|incomplete"), (tmp_path / "nope.mp4", "not|no such"),
                        (one, "one frame|image")):
        run = subprocess.run([sys.executable, "-m", "arr_coc", "ask", "--model", str(folder), "--video", str(path),
                              "--question", "What moves?"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert re.search(words, run.stderr, re.I), run.stderr


def test_a_budget_list_has_one_entry_per_image_or_video(tiny_vlm, make_image):
    """An item with an image and a clip takes [image budget, clip budget]; the clip's budget covers all its groups."""
    model, processor = tiny_vlm("qwen2_vl")
    wrapper = ARRCOCQwen(model, processor)
    clip, image = _clip(8), make_image(56, 112, seed=2)
    _, trace = wrapper.generate([[image, clip]], ["What moves?"], budget=[[0.5, 0.1]], max_new_tokens=1)
    trace = trace[0]
    assert trace.clip_per_image == [-1, 0, 0, 0, 0]
    assert trace.kept_per_image[0] == round(0.5 * trace.total_per_image[0])
    assert sum(trace.kept_per_image[1:]) == round(0.1 * sum(trace.total_per_image[1:]))
    with pytest.raises(ValueError, match="2 images or videos but 3 budgets"):
        wrapper.generate([[image, clip]], ["What moves?"], budget=[[0.5, 0.1, 0.2]], max_new_tokens=1)


def test_eval_on_a_video_split_reports_every_method_with_its_whole_prefill_cost(tiny_vlm, tmp_path, capsys):
    """`eval --data <a gen-data --video split>` runs the video methods and counts the whole prefill: the tower on
    what was encoded + ARR-COC's own work + the LM prefill, as a share of the full model's."""
    from arr_coc.cli import main
    from arr_coc_shapes.cli import main as shapes

    model, processor = tiny_vlm("qwen2_vl")
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    processor.save_pretrained(str(folder))
    assert shapes(["gen-data", "--video", "--out", str(tmp_path / "v"), "--split", "test", "--n", "3", "--frames", "4",
                 "--canvas", "336x336"]) == 0
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(folder), "--data", str(tmp_path / "v" / "test.jsonl"), "--methods",
                 "none,arr_coc@before,evs,oracle", "--budgets", "0.1", "--max-new-tokens", "2", "--quiet",
                 "--arr-coc-weights", "untrained", "--out", str(out)]) == 0
    rows = {(r["method"], r["encode"]): r for r in json.loads(out.read_text())["results"]}
    assert rows[("none", "after")]["cost"] == 1.0 and rows[("none", "after")]["agree"] == 1.0
    assert rows[("arr_coc@before", "before")]["cost"] < 0.5 < rows[("evs", "after")]["cost"] < 1.0
    assert rows[("arr_coc@before", "before")]["kept_share"] == pytest.approx(0.1, abs=0.02)
    assert main(["eval", "--model", str(folder), "--data", str(tmp_path / "v" / "test.jsonl"), "--methods", "fastv",
                 "--quiet", "--out", str(out)]) == 2
    assert "cannot run on a video split" in capsys.readouterr().err


def test_the_time_stage_reads_nothing_back(tiny_vlm):
    """Spreading the budget over time queues its work on the device: no host sync before the one read of all the
    clips' decisions, host data only through `grid.upload` (negative control: a one-hot histogram, which checks
    its indices on the host, is caught)."""
    import torch.nn.functional as F

    import arr_coc.core.temporal as temporal
    from arr_coc.evaluation.opcount import OpCounter
    from arr_coc.methods.arrcoc import decide_over_time, layer_batch_of
    from arr_coc.pipeline import Pruning
    from arr_coc.pipeline.choose import context

    model, processor = tiny_vlm("qwen2_vl")
    wrapper = ARRCOCQwen(model, processor)
    inputs = wrapper.build_inputs([[_clip(8)], [_clip(6, seed=1)]], ["What moves at the end?", "What moves?"])
    prompt = wrapper.backend.read_prompt(inputs, encode_all=False)
    ctx = context(wrapper.request(Pruning.of()), prompt, None, [0.2] * len(prompt.n_tokens), None)
    layer = wrapper.arr_coc_layer
    lb = layer_batch_of(ctx, layer)
    out = layer.run(lb, ctx.budgets)
    decide_over_time(ctx, layer, lb, out)                                     # warm
    with OpCounter() as ops:
        decide_over_time(ctx, layer, lb, out)
    assert ops.syncs == 0 and ops.host_tensors == 0, ops.sync_sites
    assert ops.uploads == 2                                                   # one per clip: its groups' rows

    def one_hot_cuts(colours, threshold, levels=4):
        q = (colours.clamp(0, 1) * (levels - 1e-6)).long()
        bins = (q[:, 0] * levels + q[:, 1]) * levels + q[:, 2]
        hist = F.one_hot(bins.reshape(len(colours), -1), levels ** 3).float().mean(1)
        return torch.cat([torch.ones(1, dtype=torch.bool), (hist[1:] - hist[:-1]).abs().sum(-1) > threshold])

    original = temporal.scene_cuts
    temporal.scene_cuts = one_hot_cuts
    try:
        with OpCounter() as caught:
            decide_over_time(ctx, layer, lb, out)
    finally:
        temporal.scene_cuts = original
    assert caught.syncs > 0
