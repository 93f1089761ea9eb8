"""Video input: decoding with PyAV, Qwen's sampling rules, the torch-only video processor, prompt expansion per
family, and the validator's refusals (arr_coc/video/, arr_coc/qwen/processing.py, arr_coc/validation/).

Where transformers' own code runs without torchvision (Qwen3-VL's sampling, timestamps, smart_resize and
patchify; VideoMetadata.sampled_fps; the PIL image processor) the tests compare with it directly; the
Qwen2-VL sampling rule (its module imports torchvision) is checked against indices computed by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from arr_coc.errors import InputError
from arr_coc.validation.clips import check_clip
from arr_coc.validation.limits import InputLimits
from arr_coc.validation.requests import check_items
from arr_coc.qwen.processing import (IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, encode_prompts,
                                     render_prompt, video_inputs, video_sampling)
from arr_coc.qwen.tiny import build_tiny_image_processor, build_tiny_video_processor
from arr_coc.qwen.video_processor import VideoProcessor
from arr_coc.video import Clip, VideoError, load_clip, sample_indices

from conftest import FAMILIES

av = pytest.importorskip("av")

# Frame sizes already on each family's grid (multiples of patch * merge, inside the tiny pixel limits): no resize.
VALID = {"qwen2_vl": (56, 84), "qwen2_5_vl": (56, 84), "qwen3_vl": (64, 96)}


def frames(n: int, h: int, w: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


def write_video(path, arrays, fps: int = 10, codec: str = "mpeg4", options: dict | None = None) -> None:
    """Encode HxWx3 uint8 frames with PyAV (mpeg4 in mp4: lossy)."""
    h, w = arrays[0].shape[:2]
    with av.open(str(path), "w", options=options or {}) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for a in arrays:
            for packet in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)


def write_gif(path, n: int = 6, fps: int = 5, seed: int = 0) -> list[np.ndarray]:
    """A palette GIF written with PyAV (pal8 with an explicit palette: lossless); returns its RGB frames."""
    rng = np.random.default_rng(seed)
    palette = np.zeros((256, 4), np.uint8)
    palette[:, 0] = 255                                   # ARGB: opaque
    palette[:, 1:] = rng.integers(0, 256, (256, 3))
    index = [(rng.integers(0, 16, (48, 64)) + 16 * i).astype(np.uint8) for i in range(n)]
    with av.open(str(path), "w") as c:
        s = c.add_stream("gif", rate=fps)
        s.width, s.height, s.pix_fmt = 64, 48, "pal8"
        for ix in index:
            for packet in s.encode(av.VideoFrame.from_ndarray((ix, palette), format="pal8")):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return [palette[ix][..., 1:] for ix in index]


def flat_frames(n: int, h: int = 48, w: int = 64) -> list[np.ndarray]:
    """Flat frames of distinct colours (survive mpeg4's loss well enough to tell apart)."""
    return [np.full((h, w, 3), (int(200 * i / max(1, n - 1)), 40, 255 - int(200 * i / max(1, n - 1))), np.uint8)
            for i in range(n)]


# ----------------------------------------------------------------------------- decoding


def test_mp4_decodes_every_frame_with_its_time_and_samples_at_2_fps(tmp_path):
    src = flat_frames(20)
    path = tmp_path / "walk.mp4"
    write_video(path, src, fps=10)
    every = load_clip(path, fps=None)
    assert (every.num_frames, every.fps, every.total_frames, every.source) == (20, 10.0, 20, str(path))
    np.testing.assert_allclose(every.timestamps, np.arange(20) / 10, rtol=0, atol=1e-12)
    err = [np.abs(every.frames[i].astype(int) - src[i]).mean() for i in range(20)]
    assert max(err) < 12                                         # mpeg4 is lossy: close, not equal
    assert np.abs(every.frames[0].astype(int) - src[-1]).mean() > 50   # control: another frame is far
    # 2 frames per second of a 2 s video at 10 fps: n = 20 / 10 * 2 = 4, indices arange(0, 20, 5)
    clip = load_clip(path)
    assert clip.indices.tolist() == [0, 5, 10, 15] and clip.sampled_fps == 2.0
    np.testing.assert_allclose(clip.timestamps, [0.0, 0.5, 1.0, 1.5], atol=1e-12)
    assert np.array_equal(clip.frames, every.frames[[0, 5, 10, 15]])


def test_gif_frames_are_exact(tmp_path):
    path = tmp_path / "anim.gif"
    src = write_gif(path)
    clip = load_clip(path, fps=None)
    assert clip.num_frames == 6 and clip.fps == 5.0
    for got, want in zip(clip.frames, src):
        assert np.array_equal(got, want)
    assert not np.array_equal(clip.frames[0], clip.frames[1])     # control: the frames are not all one picture
    np.testing.assert_allclose(clip.timestamps, np.arange(6) / 5, atol=1e-12)


def test_frames_in_memory_are_used_whole_unless_sampled():
    src = frames(5, 8, 8)
    clip = load_clip(src)                                          # fps 2 of a 2-fps source: every frame
    assert clip.indices.tolist() == [0, 1, 2, 3, 4] and clip.fps == 2.0 and np.array_equal(clip.frames[3], src[3])
    np.testing.assert_allclose(clip.timestamps, [0, 0.5, 1, 1.5, 2])
    tensor = torch.from_numpy(np.stack(src)).permute(0, 3, 1, 2).float() / 255     # [N, 3, H, W] floats in [0, 1]
    assert np.array_equal(load_clip(tensor).frames, clip.frames)
    assert np.array_equal(load_clip([Image.fromarray(a) for a in src]).frames, clip.frames)
    # 30 frames at 10 fps sampled at 2 fps: the Qwen2-VL rule, n = 6, arange(0, 30, 5)
    assert load_clip(frames(30, 8, 8), frame_rate=10).indices.tolist() == [0, 5, 10, 15, 20, 25]
    assert load_clip(src, num_frames=2).indices.tolist() == [0, 2]     # arange(0, 5, 2.5).int()


# ----------------------------------------------------------------------------- sampling


def test_qwen2_sampling_matches_the_hand_computed_stock_rule():
    # fps: n = 100 / 25 * 2 = 8 -> indices arange(0, 100, 12.5).int()
    assert sample_indices(100, 25.0).tolist() == [0, 12, 25, 37, 50, 62, 75, 87]
    # fps below min_frames: 10 frames at 10 fps, 2 fps -> 2, raised to min_frames 4
    assert sample_indices(10, 10.0).tolist() == [0, 2, 5, 7]
    # num_frames is rounded to the temporal patch with Python's round: 5 -> 4, 7 -> 8, 3 -> 4
    assert sample_indices(40, 10.0, num_frames=5).tolist() == [0, 10, 20, 30]
    assert len(sample_indices(40, 10.0, num_frames=7)) == 8 and len(sample_indices(40, 10.0, num_frames=3)) == 4
    # capped by max_frames, floored to the temporal patch: 200 frames, max 9 -> 8
    assert len(sample_indices(200, 10.0, fps=10, max_frames=9)) == 8
    assert sample_indices(1, 30.0).tolist() == [0]                 # one frame: kept (the stock divides by zero)
    assert not np.array_equal(sample_indices(100, 25.0), sample_indices(100, 25.0, family="qwen3_vl"))  # control


@pytest.mark.parametrize("total,fps_src,kw", [(30, 10.0, {"fps": 2}), (300, 30.0, {"fps": 1.5}), (7, 2.0, {"fps": 2}),
                                              (50, 25.0, {"num_frames": 7}), (9, 3.0, {"fps": 0.5})])
def test_qwen3_sampling_is_the_stock_sample_frames(total, fps_src, kw):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    stock = Qwen3VLVideoProcessor.sample_frames(SimpleNamespace(fps=2, min_frames=4, max_frames=768),
                                                VideoMetadata(total_num_frames=total, fps=fps_src), **kw)
    assert sample_indices(total, fps_src, family="qwen3_vl", **kw).tolist() == stock.tolist()


def test_sampled_fps_is_transformers_own():
    from transformers.video_utils import VideoMetadata

    clip = load_clip(frames(30, 8, 8), frame_rate=10, num_frames=8, family="qwen3_vl")
    meta = VideoMetadata(total_num_frames=30, fps=10.0, frames_indices=clip.indices.tolist())
    assert clip.sampled_fps == meta.sampled_fps == 8 / 30 * 10
    assert Clip(**{k: getattr(clip, k) for k in ("frames", "timestamps", "fps", "indices", "total_frames")}
                ).metadata()["frames_indices"] == meta.frames_indices


# ----------------------------------------------------------------------------- the processor


def naive_rows(x: torch.Tensor, p: int, m: int, tp: int) -> torch.Tensor:
    """A plain loop over the stock layout: rows (t, h/m, w/m, m, m), columns (C, T, p, p)."""
    n, c, height, width = x.shape
    x = torch.cat([x, x[-1:].expand(-n % tp, -1, -1, -1)])
    gt, gh, gw = x.shape[0] // tp, height // p, width // p
    rows = []
    for t in range(gt):
        for bh in range(gh // m):
            for bw in range(gw // m):
                for mh in range(m):
                    for mw in range(m):
                        y, xx = (bh * m + mh) * p, (bw * m + mw) * p
                        rows.append(torch.stack([x[t * tp + k, :, y:y + p, xx:xx + p] for k in range(tp)], 1).reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_patch_rows_equal_a_plain_loop_and_the_stock_patchify(family):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    vp = build_tiny_video_processor(family)
    h, w = VALID[family]
    clip = load_clip(frames(3, h, w, seed=1))                   # 3 frames: the last is repeated to fill group 2
    out = vp([clip])
    assert out["video_grid_thw"].tolist() == [[2, h // vp.patch_size, w // vp.patch_size]]
    x = torch.from_numpy(clip.frames).permute(0, 3, 1, 2).to(torch.float32)
    mean = torch.tensor(vp.image_mean) * 255.0                  # the stock's fused rescale + normalise
    std = torch.tensor(vp.image_std) * 255.0
    norm = (x - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    p, m, tp = vp.patch_size, vp.merge_size, vp.temporal_patch_size
    assert torch.equal(out["pixel_values_videos"], naive_rows(norm, p, m, tp))
    stock, *grid = Qwen3VLVideoProcessor.patchify(None, norm[None], p, m, tp)  # same code in Qwen2VLVideoProcessor
    assert torch.equal(out["pixel_values_videos"], stock[0]) and grid == [2, h // p, w // p]
    shuffled = clip.frames[[1, 0, 2]]
    assert not torch.equal(vp([Clip(shuffled, clip.timestamps)])["pixel_values_videos"], out["pixel_values_videos"])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_two_identical_frames_are_the_image_processors_rows(family):
    ip, vp = build_tiny_image_processor(family), build_tiny_video_processor(family)
    a, b = frames(2, *VALID[family], seed=2)
    image = ip(images=[Image.fromarray(a)], return_tensors="pt")
    video = vp([load_clip([a, a])])
    assert torch.equal(video["video_grid_thw"], image["image_grid_thw"])
    # The image processor rescales then normalises; the video processor fuses both: float32 rounding apart.
    torch.testing.assert_close(video["pixel_values_videos"], image["pixel_values"], rtol=0, atol=1e-6)
    ab, ba = vp([load_clip([a, b])])["pixel_values_videos"], vp([load_clip([b, a])])["pixel_values_videos"]
    assert (ab - ba).abs().max() > 0.5 and (ab - image["pixel_values"]).abs().max() > 0.5     # controls


def test_stock_smart_resize_and_timestamps():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as stock2
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as stock3

    v2, v3 = VideoProcessor("qwen2_vl"), VideoProcessor("qwen3_vl")
    for n, h, w in [(4, 480, 640), (9, 1080, 1920), (16, 50, 3000), (2, 20, 30), (64, 720, 1280)]:
        assert v2.target_size(n, h, w) == stock2(h, w, 28, v2.min_pixels, v2.max_pixels)
        assert v3.target_size(n, h, w) == stock3(n, h, w, 2, 32, v3.min_pixels, v3.max_pixels)
    idx = [0, 6, 12, 17, 23]
    out = v3([Clip(np.zeros((5, 64, 64, 3), np.uint8), np.array(idx) / 10.0, fps=10.0, indices=idx, total_frames=30)])
    assert out["video_timestamps"] == [Qwen3VLProcessor._calculate_timestamps(None, idx, 10.0, 2)]


def test_resized_frames_stay_close_to_pil_bicubic():
    """Frames off the grid are resized (torch's uint8 bicubic + antialias kernel, torchvision's on the CPU): within
    two levels of PIL's bicubic (the image processor's) on under 1% of the values; another filter is far."""
    ip, vp = build_tiny_image_processor("qwen2_vl"), build_tiny_video_processor("qwen2_vl")
    a = frames(1, 100, 130, seed=3)[0]
    image = ip(images=[Image.fromarray(a)], return_tensors="pt")["pixel_values"]
    video = vp([load_clip([a, a])])["pixel_values_videos"]
    one_level = 1 / 255 / min(vp.image_std)
    diff = (video - image).abs()
    assert video.shape == image.shape and diff.max() <= 2 * one_level * 1.01 and (diff > 1e-5).float().mean() < 0.01
    near = np.array(Image.fromarray(a).resize((140, 112), Image.NEAREST))     # already on the grid: not resized again
    nearest = vp([load_clip([near, near])])["pixel_values_videos"]
    assert (nearest - image).abs().max() > 10 * one_level


def test_second_per_grid_ts_is_temporal_patch_over_sampled_fps(tmp_path):
    vp = build_tiny_video_processor("qwen2_5_vl")
    src = frames(4, *VALID["qwen2_5_vl"])
    assert vp([load_clip(src, frame_rate=4, fps=None)])["second_per_grid_ts"].tolist() == [0.5]    # 2 / 4 fps
    path = tmp_path / "ten.mp4"
    write_video(path, flat_frames(30, *VALID["qwen2_5_vl"]), fps=10)
    from_file = vp([load_clip(path), load_clip(path, num_frames=10)])["second_per_grid_ts"]
    assert from_file.tolist() == pytest.approx([2 / 2.0, 2 / (10 / 30 * 10)])
    assert "second_per_grid_ts" not in build_tiny_video_processor("qwen2_vl")([load_clip(src)])


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_video_pads_and_timestamps_in_the_prompt(tiny_vlm, family):
    model, processor = tiny_vlm(family)
    vp = processor.video_processor
    clip = load_clip(frames(6, *VALID[family]), frame_rate=4, fps=None)      # every frame, 4 per second
    enc = encode_prompts(processor, [[clip]], ["What moves?"])
    t, h, w = enc["video_grid_thw"][0].tolist()
    ids = enc["input_ids"][0]
    video_id = processor.tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
    assert int((ids == video_id).sum()) == t * h * w // vp.merge_size ** 2 == vp.num_video_tokens(clip)
    assert torch.equal(enc["mm_token_type_ids"][0] == 2, ids == video_id)
    text = processor.tokenizer.decode(ids)
    stamps = [f"<{s:.1f} seconds>" for s in (0.125, 0.625, 1.125)]   # groups of frames at 0, .25 | .5, .75 | 1, 1.25
    if family == "qwen3_vl":
        group = VISION_START + VIDEO_TOKEN * (h * w // 4) + VISION_END
        assert "user\n" + "".join(s + group for s in stamps) + "What moves?" in text
    else:
        assert VISION_START + VIDEO_TOKEN * (t * h * w // 4) + VISION_END + "What moves?" in text
        assert "seconds>" not in text
    with torch.no_grad():
        logits = model(**{k: v for k, v in enc.items() if isinstance(v, torch.Tensor)}).logits
    assert torch.isfinite(logits).all()                        # the real model reads these inputs


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_an_image_and_a_video_render_in_the_order_given(tiny_vlm, make_image, family):
    _, processor = tiny_vlm(family)
    img, clip = make_image(56, 56), load_clip(frames(4, *VALID[family]))
    first_kind = []
    for visuals in ([img, clip], [clip, img]):
        enc = encode_prompts(processor, [visuals], ["Same?"])
        kinds = enc["mm_token_type_ids"][0]
        first_kind.append(int(kinds[kinds > 0][0]))
        assert int((kinds == 1).sum()) == 4 and int((kinds == 2).sum()) > 0
        assert enc["pixel_values"].shape[0] == 16 and enc["pixel_values_videos"].shape[0] > 0
    assert first_kind == [1, 2]
    rendered = render_prompt(processor, [clip, img], "q")
    assert rendered.index(VIDEO_TOKEN) < rendered.index(IMAGE_TOKEN)
    assert render_prompt(processor, 2, "q").count(IMAGE_TOKEN) == 2         # the old call: a count of images


def test_a_folder_roundtrip_keeps_the_video_processor(tiny_vlm, tmp_path):
    from arr_coc.qwen.processing import load_processor

    model, processor = tiny_vlm("qwen3_vl")
    model.config.save_pretrained(tmp_path)
    processor.save_pretrained(str(tmp_path))
    loaded = load_processor(str(tmp_path))
    assert loaded.family == "qwen3_vl" and loaded.video_processor.to_dict() == processor.video_processor.to_dict()
    assert video_sampling(loaded) == {"family": "qwen3_vl", "fps": 2.0, "min_frames": 4, "max_frames": 768}
    clip = load_clip(frames(4, 100, 70))
    a, b = encode_prompts(processor, [[clip]], ["q"]), encode_prompts(loaded, [[clip]], ["q"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_stock_processor_gets_frames_and_metadata():
    class Stock:        # what encode_prompts hands a transformers processor that has a video processor
        video_processor = object()

    clip = load_clip(frames(30, 8, 8), frame_rate=10)
    kw = video_inputs(Stock(), [clip])
    assert kw["do_sample_frames"] is False and kw["videos"][0] is clip.frames
    assert kw["video_metadata"][0]["fps"] == 10.0 and kw["video_metadata"][0]["frames_indices"] == [0, 5, 10, 15, 20, 25]
    with pytest.raises(ValueError, match="no video processor"):
        video_inputs(SimpleNamespace(), [clip])


def test_a_processor_without_a_video_processor_says_so(tiny_vlm):
    from arr_coc.qwen.processing import ImageOnlyQwenProcessor

    _, processor = tiny_vlm("qwen2_vl")
    bare = ImageOnlyQwenProcessor(processor.image_processor, processor.tokenizer)
    with pytest.raises(ValueError, match="without a video processor"):
        bare(text=[VIDEO_TOKEN], videos=[load_clip(frames(2, 56, 56))])
    with pytest.raises(ValueError, match="1 videos were passed but the prompts hold 0"):
        processor(text=["no placeholder"], videos=[load_clip(frames(2, 56, 56))])


# ----------------------------------------------------------------------------- refusals


def test_bad_files_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(VideoError, match="Could not find the video file") as info:
        load_clip(tmp_path / "nope.mp4")
    assert info.value.code == "video_missing" and isinstance(info.value, ValueError)
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)))
    with pytest.raises(VideoError, match="Could not read .* as a video .*damaged or cut short") as info:
        load_clip(junk)
    assert info.value.code == "video_unreadable"
    src = frames(30, 48, 64)
    for options, message in (({"movflags": "faststart"}, "only [0-9]+ of the 30 frames its header declares"),
                             ({}, "damaged or cut short")):           # index first / index last (then it is cut off)
        whole = tmp_path / f"whole{len(options)}.mp4"
        write_video(whole, src, options=options)
        assert load_clip(whole, fps=None).num_frames == 30                   # control: the whole file decodes
        cut = tmp_path / f"cut{len(options)}.mp4"
        cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
        with pytest.raises(VideoError, match=message):
            load_clip(cut)
    with pytest.raises(VideoError, match="is empty"):
        (tmp_path / "empty.mp4").write_bytes(b"")
        load_clip(tmp_path / "empty.mp4")


def test_a_decoder_error_midway_refuses_the_clip(tmp_path, monkeypatch):
    """FFmpeg raising mid-decode (a damaged packet): refused, saying how far decoding got; never half a clip."""
    from arr_coc.video import decode

    path = tmp_path / "v.mp4"
    write_video(path, frames(30, 48, 64))
    real_open = decode._open

    class Breaks:
        def __init__(self, container):
            self.container = container

        def __getattr__(self, name):
            return getattr(self.container, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.container.close()

        def decode(self, *args, **kwargs):
            for i, frame in enumerate(self.container.decode(*args, **kwargs)):
                if i == 7:
                    raise av.error.InvalidDataError(-1094995529, "Invalid data found when processing input")
                yield frame

    assert load_clip(path).num_frames == 6                                   # control: the file itself is fine
    monkeypatch.setattr(decode, "_open", lambda p, shown: Breaks(real_open(p, shown)))
    with pytest.raises(VideoError, match="decoding stopped after 7 frames of the 30 its header declares "
                                         r"\(InvalidDataError: Invalid data") as info:
        load_clip(path)
    assert info.value.code == "video_damaged"


def test_bad_frames_are_refused_with_what_to_do():
    cases = [
        ([], "no frames", "video_empty"),
        (np.zeros((0, 8, 8, 3), np.uint8), "no frames", "video_empty"),
        ([np.zeros((8, 8, 3), np.uint8), np.zeros((8, 10, 3), np.uint8)], "Frame 1 is 10x8 px but frame 0 is 8x8",
         "video_frames_mismatch"),
        (np.zeros((3, 8, 8, 4), np.uint8), "not RGB-like", "video_not_rgb"),
        ([np.zeros((8, 8), np.uint8)] * 2, "not RGB-like", "video_not_rgb"),
        ([Image.new("I;16", (8, 8))] * 2, "not RGB-like", "video_not_rgb"),
        (np.full((2, 8, 8, 3), 2.0, np.float32), "outside \\[0, 1\\]", "video_not_rgb"),
    ]
    for value, message, code in cases:
        with pytest.raises(VideoError, match=message) as info:
            load_clip(value)
        assert info.value.code == code
    with pytest.raises(VideoError, match="num_frames=10, more than max_frames=8") as info:
        load_clip(frames(20, 8, 8), num_frames=10, max_frames=8)
    assert info.value.code == "video_too_long"
    assert load_clip(frames(20, 8, 8), num_frames=8, max_frames=8).num_frames == 8        # control


def test_the_validator_checks_clips(tmp_path):
    limits = InputLimits(max_frames=8)
    ok = check_clip(frames(4, 56, 56), limits)
    assert isinstance(ok, Clip) and ok.num_frames == 4
    one = load_clip(frames(1, 56, 56))
    assert one.num_frames == 1 and VideoProcessor("qwen2_vl")([one])["video_grid_thw"][0, 0] == 1   # usable as such
    with pytest.raises(InputError, match="a one-frame clip is an image, pass it as an image") as info:
        check_clip(one, limits)
    assert info.value.code == "video_too_short"
    # issue 49: frames in memory, a Clip and a file are kept to max_frames the same way (evenly), never refused
    # with advice to sample at the rate they were sampled at
    for given in (frames(12, 56, 56), load_clip(frames(12, 56, 56))):
        capped = check_clip(given, limits)
        assert capped.num_frames == 8 and capped.indices.tolist() == [0, 2, 3, 5, 6, 8, 9, 11]
    with pytest.raises(InputError, match="more than max_frames=8") as info:   # every frame asked for: refused
        check_clip(frames(12, 56, 56), limits, sampling={"fps": None})
    assert info.value.code == "video_too_long"
    with pytest.raises(InputError, match="too small"):
        check_clip(frames(4, 10, 10), limits)
    path = tmp_path / "clip.mp4"
    write_video(path, flat_frames(40, 56, 56), fps=10)
    with pytest.raises(InputError, match="megapixels, over the"):  # from the header, before decoding
        check_clip(path, InputLimits(max_clip_pixels=56 * 56 * 7))
    with pytest.raises(InputError, match="Could not find the video file 'gone.mp4'"):
        check_clip(tmp_path / "gone.mp4", limits, name="gone.mp4")
    with pytest.raises(InputError, match="the uploaded video") as info:   # no name: no server path in the message
        check_clip(tmp_path / "gone.mp4", limits)
    assert str(tmp_path) not in str(info.value)
    # check_items: a video path where an image could be is a video, sampled by the model's rule, capped at max_frames
    items, questions, _ = check_items([[str(path)]], ["What moves?"], limits, sampling={"family": "qwen3_vl"})
    clip = items[0][0]
    assert isinstance(clip, Clip) and clip.num_frames == 8 and questions == ["What moves?"]
    assert clip.indices.tolist() == sample_indices(40, 10.0, family="qwen3_vl", max_frames=8).tolist()
