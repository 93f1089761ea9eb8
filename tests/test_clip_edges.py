"""Clips at the edges (issue 49): a budget is a ceiling (a clip's minimum is one token per temporal group, stated,
applied and reported, never every token), a clip is read the same way through every route, the model made for
clips answers them in the app, and every refusal is one line with what to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _app_server import save_tiny_model
from arr_coc import ARRCOC
from arr_coc.budget import count_of
from arr_coc.qwen import ARRCOCQwen
from arr_coc.video import load_clip

Q = "What moves?"
METHODS = ("arr_coc", "random", "grid", "evs", "uniform_frames")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_clips"))


@pytest.fixture(scope="module")
def wrapper(tiny_dir):
    return ARRCOCQwen.from_pretrained(str(tiny_dir))


def _frames(n: int, size: int = 112, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        f = np.full((size, size, 3), 200, np.uint8)
        x = (8 * k) % (size - 30)
        f[30:60, x:x + 30] = rng.integers(0, 255, 3)
        out.append(f)
    return out


def _gif(path: Path, frames: list[np.ndarray], ms: int = 500) -> Path:
    pictures = [Image.fromarray(f) for f in frames]
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=ms, loop=0)
    return path


def _allowed(trace) -> int:
    """What the budget allows a clip: its count, or its minimum of one token per temporal group."""
    t, n = len(trace.kept_per_group[0]), trace.total_tokens // len(trace.kept_per_group[0])
    return max(t, count_of(trace.budget, t * n))


# ----------------------------------------------------------------------------- 1. a budget is a ceiling


@pytest.mark.parametrize("frames", [2, 8, 64])
def test_no_budget_keeps_more_than_it_allows_through_generate(wrapper, frames):
    clip = load_clip(_frames(frames, 56), frame_rate=2.0)
    for budget in (1e-9, 0.001, 0.05, 0.3, 1.0, 1, 2, 7, 10_000):
        for method in METHODS:
            _, trace = wrapper.generate(clip, Q, budget=budget, method=method, max_new_tokens=1)
            assert trace.fallback.count("keep_all") == 0, (budget, method, trace.error)
            assert trace.kept_tokens <= _allowed(trace), (frames, budget, method, trace.kept_per_group)
            if trace.kept_tokens > count_of(budget, trace.total_tokens):        # the minimum applied: said so
                assert "minimum of one token per temporal group" in " ".join(trace.notes), trace.notes


def test_the_check_catches_the_old_fallback(wrapper, monkeypatch):
    """Negative control: the allocator's old floor (no minimum below one token per group) lets groups keep zero
    cells, which the pipeline then fills with every token: the ceiling check fails."""
    import torch

    import arr_coc.core.temporal as temporal

    def old_allocate(score, k, min_per_group=1):
        t = score.shape[0]
        flat = score.reshape(t, -1).float()
        k = max(1, min(int(k), t * flat.shape[1]))
        top = torch.sort(flat.reshape(-1), descending=True, stable=True).indices[:k]
        return torch.zeros(flat.numel(), dtype=torch.bool).index_fill_(0, top, True).reshape(score.shape)

    monkeypatch.setattr(temporal, "allocate", old_allocate)
    _, trace = wrapper.generate(load_clip(_frames(16, 56), frame_rate=2.0), Q, budget=2, max_new_tokens=1)
    assert "keep_all" in trace.fallback and trace.kept_tokens > _allowed(trace)


def test_ask_and_the_app_keep_to_the_budget_and_say_when_the_minimum_applies(wrapper, tiny_dir, tmp_path, capsys,
                                                                             monkeypatch):
    from arr_coc_microscope import server
    from arr_coc_microscope.handler import ask

    path = _gif(tmp_path / "clip.gif", _frames(16, 56))
    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(lambda cls, *a, **k: wrapper))
    from arr_coc.cli import main

    assert main(["ask", "--model", str(tiny_dir), "--video", str(path), "--question", Q, "--budget", "2tok",
                 "--max-new-tokens", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kept_tokens"] == 8 and "minimum of one token per temporal group" in " ".join(out["notes"])
    scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=1)
    scope.count_flops = False
    result = ask(scope, None, Q, True, 0.02, video=str(path), compare_layer="off")
    assert not result.error.startswith("**Error"), result.error
    assert result.record["arr_coc"]["kept_tokens"] <= 8 and "minimum of one token" in result.error


# ----------------------------------------------------------------------------- 2. one reading of a clip


def test_a_gif_path_is_the_same_clip_through_generate_ask_and_the_app(wrapper, tiny_dir, tmp_path, capsys,
                                                                      monkeypatch):
    from arr_coc.cli import main
    from arr_coc_microscope import server
    from arr_coc_microscope.handler import ask

    frames = _frames(8, 56)
    frames[4:] = [frames[4]] * 4                   # an encoder merges these: 5 stored frames, 8 shown
    path = _gif(tmp_path / "merged.gif", frames)
    assert Image.open(path).n_frames < 8
    _, lib = wrapper.generate(str(path), Q, budget=0.5, max_new_tokens=1)
    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(lambda cls, *a, **k: wrapper))
    for flag in ("--video", "--image"):            # an animated GIF is a clip wherever it is given
        assert main(["ask", "--model", str(tiny_dir), flag, str(path), "--question", Q, "--budget", "0.5",
                     "--max-new-tokens", "1", "--json"]) == 0
        cli = json.loads(capsys.readouterr().out)
        assert cli["kept_per_group"] == lib.kept_per_group[0] and cli["frames"] == 8
    scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=1)
    scope.count_flops = False
    for image, video in ((str(path), None), (None, str(path))):
        record = ask(scope, image, Q, True, 0.5, video=video, compare_layer="off").record
        assert record["arr_coc"]["kept_per_group"] == lib.kept_per_group and record["video"]["frames"] == 8
    assert len(lib.kept_per_group[0]) == 4         # 8 frames shown: 4 temporal groups, not the stored frames'


def test_a_clip_given_as_a_picture_goes_to_the_clip_model_with_a_note_gif_and_mp4(wrapper, tmp_path, capsys,
                                                                                 monkeypatch):
    """Issue 55: `ask --image clip.gif` was answered by the image model (the model was chosen before the file was
    known to be a clip) and an mp4 given as --image got no note. One file, one reading, one model."""
    from test_video import _write_mp4

    from arr_coc.cli import main
    from arr_coc.paths import default_model_path

    if default_model_path(video=True) == default_model_path():
        pytest.skip("this checkout ships no model for clips")
    loaded = []
    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(lambda cls, path, *a, **k: loaded.append(path)
                                                                   or wrapper))
    gif = _gif(tmp_path / "c.gif", _frames(4, 56))
    mp4 = tmp_path / "c.mp4"
    _write_mp4(mp4, np.stack(_frames(4, 64)))
    for clip, note in ((gif, "The animated image (4 frames) is read as a clip"),
                       (mp4, "The video file given as a picture is read as a clip")):
        for flag in ("--video", "--image"):
            assert main(["ask", flag, str(clip), "--question", Q, "--budget", "0.5", "--max-new-tokens", "1",
                         "--json"]) == 0
            out = json.loads(capsys.readouterr().out)
            assert loaded[-1] == default_model_path(video=True), (clip, flag)     # the model made for clips
            assert (note in " ".join(out["notes"])) == (flag == "--image"), (flag, out["notes"])
            assert out["frames"] == 4


def test_the_page_names_the_clip_model_relative_to_the_app_s_folder(tiny_dir, monkeypatch):
    """Issue 55: the header showed the clip model's absolute server path; every other model and layer is shown
    relative to the app's folder (`arr_coc.paths.shown_path`)."""
    import os

    from arr_coc.paths import default_model_path
    from arr_coc_microscope import page, server

    path = default_model_path(video=True)
    if path is None or path == default_model_path():
        pytest.skip("this checkout ships no model for clips")
    scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=1)
    monkeypatch.setattr(ARRCOC, "from_pretrained", classmethod(lambda cls, *a, **k: scope.vlm))
    server.add_clip_model(scope, os.path.abspath(path))
    header = page._introduction(scope)
    assert "(`checkpoints/shapes-qwen2vl-video`)" in header and os.getcwd() not in header, header


def test_a_transparent_clip_reads_the_same_from_a_file_and_from_memory(tmp_path):
    frames = []
    for k in range(4):
        f = np.zeros((56, 56, 4), np.uint8)
        f[..., :3] = (61, 61, 61)                   # the hidden colour of transparent pixels
        f[10:30, 10 + 5 * k:30 + 5 * k] = (200, 30, 30, 255)
        frames.append(Image.fromarray(f, "RGBA"))
    path = tmp_path / "alpha.png"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    from_file, from_memory = load_clip(str(path)), load_clip(frames, frame_rate=2.0)
    assert np.array_equal(from_file.frames, from_memory.frames)
    assert from_file.frames[0, 0, 0].tolist() == [255, 255, 255]          # flattened onto white, as pictures are


def test_a_clip_with_no_frame_rate_is_refused_with_what_to_do(tmp_path):
    """A header that states no rate (0 fps) is not read at FFmpeg's guess of 25 fps: sampling by fps needs the
    file's rate, so the clip is refused with what to pass (and with it, read)."""
    from arr_coc.errors import InputError
    from arr_coc.validation.clips import check_clip

    path = _zero_fps_avi(tmp_path / "zero.avi")
    with pytest.raises(InputError, match="frame rate is unknown.*frame_rate="):
        check_clip(path)
    assert check_clip(path, sampling={"frame_rate": 4.0}).num_frames == 8    # with its rate: read


def _zero_fps_avi(path: Path) -> Path:
    """An MJPEG AVI of 16 frames whose stream header says 0 fps (dwRate = 0), as some tools write them."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("mjpeg", rate=4)
        stream.width = stream.height = 56
        stream.pix_fmt = "yuvj420p"
        for f in _frames(16, 56):
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    data = bytearray(path.read_bytes())
    strh = data.index(b"strh")
    data[strh + 8 + 24: strh + 8 + 28] = (0).to_bytes(4, "little")      # dwRate: frames per dwScale seconds
    avih = data.index(b"avih")
    data[avih + 8: avih + 12] = (0).to_bytes(4, "little")                # dwMicroSecPerFrame
    path.write_bytes(bytes(data))
    return path


# ----------------------------------------------------------------------------- 3. the app answers a clip with a clip model


def test_the_app_answers_a_clip_with_the_clip_model_and_an_image_with_the_image_model(tiny_dir, tmp_path):
    from arr_coc_microscope import server
    from arr_coc_microscope.handler import ask

    clip_dir = save_tiny_model(tmp_path / "clip_model", family="qwen2_vl")
    scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=1)
    scope.count_flops = False
    server.add_clip_model(scope, str(clip_dir))
    clip = _gif(tmp_path / "c.gif", _frames(8, 56))
    got = ask(scope, None, Q, True, 0.25, video=str(clip), compare_layer="off")
    assert got.record["answered_by"] == str(clip_dir) and got.record["arr_coc"]["model"] == str(clip_dir)
    assert f"answered by {clip_dir}" in got.error
    rows = {row[0]: row for row in got.stats}
    assert rows["model (answered)"][1] == str(clip_dir)
    from test_video import _write_mp4

    mp4 = tmp_path / "c.mp4"
    _write_mp4(mp4, np.stack(_frames(4, 64)))
    for path, note in ((clip, "The animated image"), (mp4, "The video file given as a picture")):   # issue 55
        given = ask(scope, str(path), Q, True, 0.25, compare_layer="off")     # a clip sent as the picture
        assert given.record["answered_by"] == str(clip_dir) and note in given.error, given.error
    picture = tmp_path / "p.png"
    Image.fromarray(_frames(1, 112)[0]).save(picture)
    image = ask(scope, str(picture), Q, True, 0.25, compare_layer="off")
    assert image.record["answered_by"] == str(tiny_dir)


def test_an_image_and_a_clip_together_are_refused_and_the_page_clears_the_other_box(tiny_dir, tmp_path):
    from arr_coc_microscope import page, server
    from arr_coc_microscope.handler import ask

    scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=1)
    picture = tmp_path / "p.png"
    Image.fromarray(_frames(1, 112)[0]).save(picture)
    both = ask(scope, str(picture), Q, True, 0.25, video=str(_gif(tmp_path / "c.gif", _frames(4, 56))))
    assert both.error.startswith("**Error:** Both an image and a video were sent") and not both.answer_baseline
    assert page._clear_if_set("x.png")["value"] is None and "value" not in page._clear_if_set(None)
    demo = page.build_demo(scope, examples=[])
    ids = {c["props"].get("elem_id"): c["id"] for c in demo.config["components"]}
    wired = {(d["targets"][0][0], d["outputs"][0]) for d in demo.config["dependencies"]
             if d["targets"] and d["targets"][0][1] == "change" and len(d["outputs"]) == 1}
    assert (ids["image"], ids["video"]) in wired and (ids["video"], ids["image"]) in wired


# ----------------------------------------------------------------------------- 4. the command line


VIDEO_CASES = [
    (["--encode", "before", "--passes", "2"], "Looking again (passes > 1) applies to images only"),
    (["--method", "fastv"], "Method 'fastv' cannot prune a video"),
    (["--method", "visionzip"], "Method 'visionzip' cannot prune a video"),
]


@pytest.mark.parametrize("extra,words", VIDEO_CASES, ids=[" ".join(e) for e, _ in VIDEO_CASES])
def test_clip_refusals_are_one_line_before_the_model_loads(extra, words, tiny_dir, tmp_path, capsys, monkeypatch):
    _refuse_model_loads(monkeypatch)
    rc, out, err = _cli(["ask", "--model", str(tiny_dir), "--video", str(_gif(tmp_path / "c.gif", _frames(4, 56))),
                         "--question", Q, *extra], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err and words in lines[0], err


@pytest.mark.parametrize("name,content,words", [
    ("gone.mp4", None, "Could not find the video file"),
    ("notes.mp4", b"not a video at all", "Could not read"),
])
def test_a_bad_video_is_refused_before_the_model_loads(name, content, words, tiny_dir, tmp_path, capsys, monkeypatch):
    _refuse_model_loads(monkeypatch)
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    rc, _, err = _cli(["ask", "--model", str(tiny_dir), "--video", str(path), "--question", Q], capsys)
    assert rc == 2 and words in err and "Traceback" not in err, err


def _refuse_model_loads(monkeypatch) -> None:
    import arr_coc.qwen.loading as loading   # what the backend registry's Qwen entry loads with

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(loading, "load_vlm", refuse)


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from arr_coc.cli import main

    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (print(exc.code, file=sys.stderr) or 1)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- 5. eval on clips


@pytest.fixture(scope="module")
def clip_split(tmp_path_factory):
    from arr_coc_shapes.cli import main

    folder = tmp_path_factory.mktemp("clips")
    assert main(["gen-data", "--video", "--out", str(folder), "--split", "test", "--n", "4", "--frames", "4",
                 "--canvas", "336x336"]) == 0
    return folder / "test.jsonl"


def test_eval_on_clips_takes_any_methods_and_refuses_what_it_cannot_use(tiny_dir, clip_split, tmp_path, capsys):
    from arr_coc.cli import main

    out = tmp_path / "r.json"
    base = ["eval", "--model", str(tiny_dir), "--data", str(clip_split), "--quiet", "--arr-coc-weights", "untrained",
            "--max-new-tokens", "1", "--out", str(out)]
    assert main(base + ["--methods", "grid,divprune,uniform_frames", "--budgets", "0.001,0.3"]) == 0   # no none
    report = json.loads(out.read_text())
    assert report["model"] == str(tiny_dir) and report["runtime"] and all(r["answers"] for r in report["results"])
    rows = {(r["method"], r["budget"]): r for r in report["results"]}
    assert rows[("uniform_frames", 0.001)]["over_budget"] == 4 and rows[("uniform_frames", 0.3)]["over_budget"] == 0
    assert "minimum of one token" in rows[("grid", 0.001)]["budget_notes"][0]
    for extra, words in ((["--fastv-layer", "3"], "--fastv-layer"), (["--encode", "before", "--passes", "2"],
                                                                     "applies to images only")):
        capsys.readouterr()
        assert main(base + ["--methods", "arr_coc"] + extra) == 2 and words in capsys.readouterr().err
    assert main(base + ["--methods", "random", "--budgets", "0.3", "--seed", "1"]) == 0
    one = json.loads(out.read_text())["results"][0]["item_kept"]
    assert main(base + ["--methods", "random", "--budgets", "0.3", "--seed", "2", "--no-strict",
                        "--budget-mode", "exact"]) == 0
    assert json.loads(out.read_text())["seed"] == 2 and json.loads(out.read_text())["results"][0]["item_kept"] == one


def test_an_mp4_split_evaluates(tiny_dir, tmp_path):
    import av

    from arr_coc.cli import main

    records = []
    for i in range(2):
        path = tmp_path / f"clip{i}.mp4"
        with av.open(str(path), "w") as box:
            stream = box.add_stream("libx264" if "libx264" in av.codecs_available else "mpeg4", rate=2)
            stream.width = stream.height = 112
            stream.pix_fmt = "yuv420p"
            for f in _frames(8, 112, seed=i):
                for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                    box.mux(packet)
            for packet in stream.encode():
                box.mux(packet)
        boxes = [[[30, 30, 60, 60]]] * 8
        records.append({"id": f"v{i}", "video": path.name, "question": Q, "answers": ["circle"], "qtype": "moving",
                        "size": [112, 112], "boxes_over_time": boxes})
    data = tmp_path / "split.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "r.json"
    assert main(["eval", "--model", str(tiny_dir), "--data", str(data), "--methods", "none,arr_coc,oracle@before",
                 "--budgets", "0.25", "--quiet", "--arr-coc-weights", "untrained", "--max-new-tokens", "1",
                 "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["none"]["item_total"] == [64, 64] and rows["arr_coc"]["kept_share"] == pytest.approx(0.25, abs=0.02)
