"""ShapesVQA-video: the clip generator, its ground truth and relevance targets, the clip files and the
gen-data --video hook (spec: docs/SHAPESVQA.md, "ShapesVQA-video"). Seeded and fast (numpy + PIL)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
from functools import lru_cache

import numpy as np
import pytest
from PIL import Image

from arr_coc_shapes.cli import gen_data as cli
from arr_coc_shapes.drawing import render_background, render_scene
from arr_coc_shapes.video import (
    VIDEO_QUESTION_TYPES, ask_clip, load_clip_frames, make_clip_item, options, save_clip, video_words,
)
from arr_coc_shapes.video.clips import clip_suffix
from arr_coc_shapes.video.spec import DEFAULT_LENGTHS, FRAME_MS, PAN_TYPES

N_ITEMS = 240  # ~30 per question type; ~2 s to generate at 448 px
RECORD_KEYS = ["id", "split", "video", "question", "answer", "answers", "qtype", "n_frames", "fps", "size",
               "boxes_over_time", "events", "scene_cut", "pan", "seed"]


@lru_cache(maxsize=1)
def items():
    return [make_clip_item(0, "test", i) for i in range(N_ITEMS)]


def params_of(record: dict) -> dict:
    """The question's attributes, read back from the record's text (the templates are fixed)."""
    words = record["question"].rstrip("?").split()
    q = record["qtype"]
    if q == "direction":
        return {"shape": words[-2]}
    if q in ("color_start", "color_end"):
        return {"shape": words[-4]}
    if q in ("exists_first", "exists_last"):
        return {"color": words[3], "shape": words[4]}
    return {}


def background_frames(track) -> np.ndarray:
    """The clip with no objects: each frame's window on its shot's world background."""
    worlds = [np.asarray(render_background(track.world_scene(s))) for s in range(len(track.shots))]
    out = []
    for t in range(track.n_frames):
        cx, cy = track.camera(t)
        out.append(worlds[track.shot_at(t)][cy:cy + track.height, cx:cx + track.width])
    return np.stack(out)


def state(track, i: int, t: int):
    """What frame t shows of actor i (None when absent)."""
    if not track.present(i, t):
        return None
    return (track.box_at(i, t), track.actors[i].color_at(t)[1])


# ------------------------------------------------------------------- determinism


def test_same_seed_same_bytes_other_index_or_split_other_clip(tmp_path):
    frames, record, track = make_clip_item(0, "test", 3)
    again, record2, track2 = make_clip_item(0, "test", 3)
    assert frames.tobytes() == again.tobytes() and record == record2 and track == track2
    a = save_clip(frames, tmp_path / f"a{record['video'][-4:]}").read_bytes()
    b = save_clip(again, tmp_path / f"b{record['video'][-4:]}").read_bytes()
    assert a == b
    other, _, _ = make_clip_item(0, "test", 4)
    split, _, _ = make_clip_item(0, "val", 3)
    seed, _, _ = make_clip_item(1, "test", 3)
    for clip in (other, split, seed):  # negative controls
        assert clip.shape != frames.shape or not np.array_equal(clip, frames)


def test_frames_are_the_image_sets_rendering_of_each_frames_scene():
    """Without a pan every frame is render_scene of its frame scene: the same shapes as the image set."""
    checked = 0
    for frames, record, track in items()[:60]:
        if track.pan is None:
            for t in (0, track.n_frames - 1):
                assert np.array_equal(frames[t], np.asarray(render_scene(track.frame_scene(t))))
            checked += 1
    assert checked > 30


# ------------------------------------------------------------------- answers and records


def test_answer_rederived_from_the_track_for_every_question_type():
    seen = collections.Counter()
    for frames, record, track in items():
        q = ask_clip(track, record["qtype"], **params_of(record))
        assert q is not None and q.text == record["question"]
        assert q.answer == record["answer"] and record["answers"] == [record["answer"]]
        assert [[list(b) for b in f] for f in q.boxes_over_time(track)] == record["boxes_over_time"]
        seen[record["qtype"]] += 1
    assert set(seen) == set(VIDEO_QUESTION_TYPES) and min(seen.values()) >= 15


def test_negative_controls_the_answer_follows_the_track():
    """Editing the track changes the derived answer: the ground truth is read from it, not from a plan."""
    changed = collections.Counter()
    for frames, record, track in items():
        q, p = record["qtype"], params_of(record)
        ids = sorted({i for f in ask_clip(track, q, **p).relevant for i in f})
        if q in ("moving_shape", "moving_color", "direction"):
            mover = track.actors[ids[0]]
            still = dataclasses.replace(track, actors=tuple(
                dataclasses.replace(a, velocity=(0, 0)) if a is mover else a for a in track.actors))
            assert ask_clip(still, q, **p) is None  # no mover, or the shape no longer moves
            changed[q] += 1
        elif q in ("color_start", "color_end") and track.actors[ids[0]].recolor is not None:
            a = track.actors[ids[0]]  # the change moved to the queried end: the other colour there
            moved = None if q == "color_end" else dataclasses.replace(a.recolor, frame=0)
            flat = dataclasses.replace(track, actors=tuple(
                dataclasses.replace(x, recolor=moved) if x is a else x for x in track.actors))
            assert ask_clip(flat, q, **p).answer != record["answer"]
            changed[q] += 1
        elif q in ("exists_first", "exists_last") and record["answer"] == "yes":
            gone = dataclasses.replace(track, actors=tuple(a for i, a in enumerate(track.actors) if i not in ids))
            assert ask_clip(gone, q, **p).answer == "no"
            changed[q] += 1
    assert len(changed) >= 6


def test_records_hold_the_specified_keys_and_json():
    for frames, record, track in items()[:40]:
        assert list(record) == RECORD_KEYS
        assert json.loads(json.dumps(record)) == record
        n = record["n_frames"]
        assert n == len(frames) == len(record["boxes_over_time"]) and n in DEFAULT_LENGTHS
        assert record["fps"] == 2 and record["size"] == [frames.shape[2], frames.shape[1]]
        assert record["video"] == f"clips/{record['id']}{clip_suffix(frames)}" and record["seed"] == 0
        assert (record["pan"] is None) == (track.pan is None) and record["scene_cut"] == track.cut
        kinds = {e["kind"] for e in record["events"]}
        assert ("pan" in kinds) == (record["pan"] is not None) and ("cut" in kinds) == (record["scene_cut"] is not None)
        for e in record["events"]:  # appear / disappear / recolor / cut land on frame pairs' boundaries
            if "frame" in e:
                assert e["frame"] % 2 == 0 and 0 < e["frame"] < n


def test_the_answers_words():
    words = set(video_words())
    assert {"moves", "left", "down", "frame", "start", "end", "yes", "cyan", "star"} <= words
    for frames, record, track in items():
        assert record["answer"] in words
        assert set(record["question"].lower().rstrip("?").split()) <= words


def test_question_types_and_answers_roughly_balanced():
    by_type = collections.defaultdict(collections.Counter)
    for frames, record, track in items():
        by_type[record["qtype"]][record["answer"]] += 1
    counts = [sum(c.values()) for c in by_type.values()]
    assert len(counts) == 8 and min(counts) >= N_ITEMS / 8 * 0.5 and max(counts) <= N_ITEMS / 8 * 1.6
    yes = sum(by_type[q]["yes"] for q in ("exists_first", "exists_last"))
    no = sum(by_type[q]["no"] for q in ("exists_first", "exists_last"))
    assert 0.35 < yes / (yes + no) < 0.65
    pooled = collections.Counter()
    for q in ("moving_shape", "moving_color", "direction", "appears_last", "color_start", "color_end"):
        pooled.update(by_type[q])
    colours = [pooled[c] for c in ("red", "green", "blue", "yellow", "purple", "orange", "cyan", "white")]
    shapes = [pooled[s] for s in ("circle", "square", "triangle", "diamond", "cross", "star")]
    for group in (colours, shapes, [by_type["direction"][d] for d in ("left", "right", "up", "down")]):
        assert min(group) >= 0.4 * np.mean(group) and max(group) <= 1.8 * np.mean(group), group
    pans = sum(r["pan"] is not None for _, r, _ in items()) / N_ITEMS
    cuts = sum(r["scene_cut"] is not None for _, r, _ in items()) / N_ITEMS
    assert 0.1 < pans < 0.3 and 0.07 < cuts < 0.25


# ------------------------------------------------------------------- geometry over time


def test_the_mover_moves_and_nothing_else_does():
    checked = 0
    for frames, record, track in items():
        if record["qtype"] != "moving_shape":
            continue
        assert track.pan is None and track.cut is None
        boxes = [f[0] for f in record["boxes_over_time"] if f]
        assert len({tuple(b) for b in boxes}) == len(boxes)  # a new box every frame
        (mover,) = {i for f in ask_clip(track, "moving_shape").relevant for i in f}
        for t in range(track.n_frames - 1):
            diff = np.any(frames[t] != frames[t + 1], axis=2)  # [H, W]
            changing = np.zeros_like(diff)
            for i in range(len(track.actors)):
                if state(track, i, t) == state(track, i, t + 1):
                    continue
                for s in (state(track, i, t), state(track, i, t + 1)):
                    if s is not None:
                        x0, y0, x1, y1 = s[0]
                        changing[y0:y1, x0:x1] = True
                if i != mover:  # other actors only appear, vanish or change colour: never a new box
                    assert {s[0] for s in (state(track, i, t), state(track, i, t + 1)) if s} <= {track.box_at(i, 0)}
            assert not (diff & ~changing).any()  # nothing changes outside what the track says changes
            if track.present(mover, t) and track.present(mover, t + 1):
                x0, y0, x1, y1 = track.box_at(mover, t)
                assert diff[y0:y1, x0:x1].any()  # the mover's pixels change
        checked += 1
    assert checked >= 15


def test_a_pan_shifts_everything_background_included():
    checked = 0
    for frames, record, track in items():
        if track.pan is None:
            continue
        assert record["qtype"] in PAN_TYPES and not any(a.moving for a in track.actors)
        dx, dy = track.pan
        H, W = frames.shape[1:3]
        textured = track.shots[0].texture != "flat"
        for t in range(track.n_frames - 1):
            if track.shot_at(t) != track.shot_at(t + 1) or any(
                    (track.present(i, t), track.actors[i].color_at(t)) !=
                    (track.present(i, t + 1), track.actors[i].color_at(t + 1)) for i in range(len(track.actors))):
                continue  # a cut or an event between t and t + 1
            ys, xs = slice(max(0, -dy), H - max(0, dy)), slice(max(0, -dx), W - max(0, dx))
            later = frames[t + 1][ys, xs]
            shifted = frames[t][max(0, -dy) + dy:H - max(0, dy) + dy, max(0, -dx) + dx:W - max(0, dx) + dx]
            assert np.array_equal(later, shifted)  # frame t + 1 at (x, y) is frame t at (x + dx, y + dy)
            if textured:  # negative control: a still camera does not fit
                assert not np.array_equal(frames[t + 1], frames[t])
                checked += 1
    assert checked >= 10


def test_a_scene_cut_changes_the_frame_at_the_cut_only():
    cuts = 0
    for frames, record, track in items():
        diff = np.abs(np.diff(frames.astype(np.int16), axis=0)).mean(axis=(1, 2, 3))  # [N - 1]
        cut = record["scene_cut"]
        if cut is None:
            assert diff.max() < 15
            continue
        assert diff[cut - 1] > 15 and diff[cut - 1] > 2 * np.delete(diff, cut - 1).max()
        cuts += 1
    assert cuts >= 15


def test_boxes_are_on_the_canvas_and_cover_the_drawn_object():
    for frames, record, track in items()[:120]:
        W, H = record["size"]
        empty = background_frames(track)
        drawn = np.any(frames != empty, axis=3)  # [N, H, W]: object pixels
        covered = np.zeros_like(drawn)
        for t, boxes in enumerate(record["boxes_over_time"]):
            for x0, y0, x1, y1 in boxes:
                assert 0 <= x0 < x1 <= W and 0 <= y0 < y1 <= H
                inside = drawn[t, y0:y1, x0:x1]
                assert inside.mean() > 0.25  # the shape fills its box
                assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any()  # tight
        for t in range(track.n_frames):  # negative control: outside every actor's box nothing is drawn
            for i, obj in track.objects_at(t):
                x0, y0, x1, y1 = obj.box
                covered[t, y0:y1, x0:x1] = True
        assert not (drawn & ~covered).any()


# ------------------------------------------------------------------- clip files


def test_clip_files_round_trip_exactly(tmp_path):
    suffixes = collections.Counter()
    for frames, record, track in items()[:50]:
        path = save_clip(frames, tmp_path / record["video"].split("/")[-1])
        assert np.array_equal(load_clip_frames(path), frames)
        suffixes[path.suffix] += 1
    # lettered objects everywhere: anti-aliased glyphs give more than 256 colours, then APNG
    busy = [make_clip_item(0, "busy", i, opts=options(letter_rate=1.0)) for i in range(12)]
    for frames, record, track in busy:
        path = save_clip(frames, tmp_path / record["video"].split("/")[-1])
        assert np.array_equal(load_clip_frames(path), frames)
        suffixes[path.suffix] += 1
    assert suffixes[".gif"] >= 40 and suffixes[".png"] >= 1
    with pytest.raises(ValueError, match="256"):
        save_clip(busy[[r["video"].endswith(".png") for _, r, _ in busy].index(True)][0], tmp_path / "x.gif")


def test_still_stretches_come_back_as_frames(tmp_path):
    """Pillow merges identical consecutive frames into one longer frame; the loader expands them again."""
    frames, record, track = make_clip_item(0, "test", 9)
    still = np.repeat(frames[:1], 6, axis=0)
    still[3:] = frames[-1]
    for suffix in (".gif", ".png"):
        path = save_clip(still, tmp_path / f"still{suffix}")
        with Image.open(path) as im:  # negative control: the file itself holds 2 frames of 1.5 s
            assert im.n_frames == 2 and im.info["duration"] == 3 * FRAME_MS
        assert np.array_equal(load_clip_frames(path), still)


# ------------------------------------------------------------------- options and command line


def test_holdout_preset_and_random_canvas():
    got = [make_clip_item(5, "holdout", i, "random", options("holdout")) for i in range(24)]
    assert {len(f) for f, _, _ in got} <= {10, 14}
    assert len({tuple(r["size"]) for _, r, _ in got}) > 10
    speeds = [max(abs(v) for v in e["velocity"]) for _, r, _ in got for e in r["events"] if e["kind"] == "move"]
    assert speeds and min(speeds) >= 84 // 13
    with pytest.raises(ValueError, match="4..16"):
        options(lengths=(2, 4))


def _cli(tmp_path, *extra):
    parser = cli.add_arguments(argparse.ArgumentParser())
    return cli.run(parser.parse_args(["--out", str(tmp_path / "out"), "--split", "val", "--n", "6", *extra]))


def test_gen_data_video_writes_n_records_and_clips(tmp_path, capsys):
    assert _cli(tmp_path, "--video", "--seed", "2", "--frames", "4,6", "--canvas", "336x336") == 0
    assert "clips/s" in capsys.readouterr().out
    lines = (tmp_path / "out" / "val.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 6 and len(list((tmp_path / "out" / "clips").iterdir())) == 6
    for i, r in enumerate(records):
        frames = load_clip_frames(tmp_path / "out" / r["video"])
        assert r["id"] == f"val-{i:06d}" and len(frames) == r["n_frames"] in (4, 6)
        assert np.array_equal(frames, make_clip_item(2, "val", i, "336x336", options(lengths=(4, 6))).frames)


def test_gen_data_refuses_options_that_do_not_fit(tmp_path, capsys):
    assert _cli(tmp_path, "--frames", "4,6") == 2
    assert "need --video" in capsys.readouterr().err
    assert _cli(tmp_path, "--video", "--hard-rate", "0.1") == 2
    assert "image splits" in capsys.readouterr().err
    assert _cli(tmp_path, "--video", "--frames", "2,3") == 2
    assert "4..16" in capsys.readouterr().err
    assert not (tmp_path / "out" / "val.jsonl").exists()
