"""ShapesVQA generator, JSONL reader and gen-data CLI (spec: docs/SHAPESVQA.md)."""

from __future__ import annotations

import argparse
import colorsys
import io
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from arr_coc_shapes.cli import gen_data as cli
from arr_coc.data import JSONLFormatError, normalize_answer, read_jsonl, score
from arr_coc_shapes import (
    COLOR_NAMES,
    HARD_KINDS,
    QUESTION_TYPES,
    SHAPES,
    Scene,
    SceneObject,
    ask,
    boxes_to_cell_mask,
    boxes_to_cell_shares,
    cell_labels,
    generate_scene,
    item_rng,
    make_item,
    parse_canvas,
    questions_for_scene,
    render_scene,
    write_split,
)
from arr_coc_shapes.layout import draw_canvas
from arr_coc_shapes.vocabulary import LETTERED_SHAPES, MAX_SIDE, MIN_LETTER_SIDE, MIN_SIDE

N_ITEMS = 300  # "a few hundred": every hard kind and every answer shows up
COLORS_RE = "|".join(COLOR_NAMES)
SHAPES_RE = "|".join(SHAPES)
# One regex per type, built from the spec's table by hand (not from TEMPLATES),
# so a drifted template fails here.
TEMPLATE_RE = {
    "color": rf"What color is the ({SHAPES_RE})\?",
    "shape": rf"What shape is the ({COLORS_RE}) object\?",
    "exists": rf"Is there a ({COLORS_RE}) ({SHAPES_RE})\?",
    "count": rf"How many ({SHAPES_RE})s are there\?",
    "letter": rf"What letter is on the ({COLORS_RE}) ({SHAPES_RE})\?",
}
ANSWER_RE = {
    "color": rf"({COLORS_RE})",
    "shape": rf"({SHAPES_RE})",
    "exists": r"(yes|no)",
    "count": r"[0-9]",
    "letter": r"[a-z]",
}


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def items():
    return [make_item(0, "test", i) for i in range(N_ITEMS)]


@pytest.fixture(scope="module")
def random_items():
    return [make_item(0, "test", i, canvas="random") for i in range(40)]


def find_object(scene: Scene, box) -> SceneObject:
    matches = [o for o in scene.objects if list(o.box) == list(box)]
    assert len(matches) == 1, f"box {box} matches {len(matches)} objects"
    return matches[0]


# --------------------------------------------------------------- determinism


def test_same_seed_gives_identical_bytes():
    for index in (0, 7, 23):
        a, b = make_item(5, "test", index), make_item(5, "test", index)
        assert png_bytes(a.image) == png_bytes(b.image)
        assert json.dumps(a.record) == json.dumps(b.record)
        assert a.scene == b.scene


def test_different_seed_or_split_differs():
    base = make_item(0, "test", 3)
    for other in (make_item(1, "test", 3), make_item(0, "train", 3), make_item(0, "test", 4)):
        assert png_bytes(other.image) != png_bytes(base.image)
        assert other.scene != base.scene


def test_render_is_pure_in_scene(items):
    for item in items[:5]:
        assert png_bytes(render_scene(item.scene)) == png_bytes(item.image)


def test_write_split_is_byte_identical_and_independent_of_workers(tmp_path):
    one = write_split(tmp_path / "a", split="val", n=6, seed=3, workers=1)
    two = write_split(tmp_path / "b", split="val", n=6, seed=3, workers=2)
    assert one.read_bytes() == two.read_bytes()
    for i in range(6):
        name = f"images/val-{i:06d}.png"
        assert (one.parent / name).read_bytes() == (two.parent / name).read_bytes()


# ----------------------------------------------------------- question format


@pytest.mark.parametrize("qtype", QUESTION_TYPES)
def test_templates_and_answers_match_the_spec(items, qtype):
    typed = [it.record for it in items if it.record["type"] == qtype]
    assert len(typed) >= 30, f"only {len(typed)} {qtype} items in {N_ITEMS}"
    for rec in typed:
        assert re.fullmatch(TEMPLATE_RE[qtype], rec["question"]), rec["question"]
        assert len(rec["answers"]) == 1 and re.fullmatch(ANSWER_RE[qtype], rec["answers"][0]), rec


def test_records_have_exactly_the_spec_keys(items):
    for i, it in enumerate(items):
        rec = it.record
        extra = set(rec) - {"id", "image", "question", "answers", "type", "boxes"}
        assert extra <= {"hard"}
        assert list(rec)[:6] == ["id", "image", "question", "answers", "type", "boxes"]
        assert rec["id"] == f"test-{i:06d}" and rec["image"] == f"images/test-{i:06d}.png"
        assert ("hard" in rec) == (it.scene.hard is not None)


def test_referred_object_is_unique_and_answer_matches_scene(items):
    for it in items:
        rec, objs = it.record, it.scene.objects
        m = re.fullmatch(TEMPLATE_RE[rec["type"]], rec["question"])
        if rec["type"] == "color":
            hits = [o for o in objs if o.shape == m[1]]
            assert len(hits) == 1 and rec["answers"] == [hits[0].color]
        elif rec["type"] == "shape":
            hits = [o for o in objs if o.color == m[1]]
            assert len(hits) == 1 and rec["answers"] == [hits[0].shape]
        elif rec["type"] == "letter":
            hits = [o for o in objs if o.color == m[1] and o.shape == m[2]]
            assert len(hits) == 1 and rec["answers"] == [hits[0].letter.lower()]
        elif rec["type"] == "exists":
            hits = [o for o in objs if o.color == m[1] and o.shape == m[2]]
            assert rec["answers"] == ["yes" if hits else "no"]
        else:
            hits = [o for o in objs if o.shape == m[1]]
            assert rec["answers"] == [str(len(hits))]
        assert sorted(rec["boxes"]) == sorted(list(o.box) for o in hits)


def test_answers_are_balanced(items):
    types = Counter(it.record["type"] for it in items)
    assert all(0.13 <= types[t] / N_ITEMS <= 0.27 for t in QUESTION_TYPES), types
    exists = Counter(it.record["answers"][0] for it in items if it.record["type"] == "exists")
    assert 0.35 <= exists["yes"] / sum(exists.values()) <= 0.65, exists
    counts = Counter(it.record["answers"][0] for it in items if it.record["type"] == "count")
    assert len(counts) >= 9 and max(counts.values()) <= 3 * sum(counts.values()) / 10, counts
    colors = Counter(it.record["answers"][0] for it in items if it.record["type"] == "color")
    shapes = Counter(it.record["answers"][0] for it in items if it.record["type"] == "shape")
    assert set(colors) == set(COLOR_NAMES) and set(shapes) == set(SHAPES)


# ------------------------------------------------------------- scene geometry


def test_boxes_inside_image_and_contain_the_object_colour(items):
    for it in items:
        pixels = np.asarray(it.image)  # [H, W, 3]
        w, h = it.image.size
        for box in it.record["boxes"]:
            x0, y0, x1, y1 = box
            assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h, box
            obj = find_object(it.scene, box)
            crop = pixels[y0:y1, x0:x1].reshape(-1, 3)
            fill = (crop == np.asarray(obj.rgb)).all(axis=1).mean()
            assert fill >= 0.2, f"{it.record['id']}: only {fill:.0%} of {box} has the {obj.color} fill"
            # Tight box: the fill reaches every edge of the box.
            hit = (pixels[y0:y1, x0:x1] == np.asarray(obj.rgb)).all(axis=2)
            assert hit[0].any() and hit[-1].any() and hit[:, 0].any() and hit[:, -1].any(), box


def test_object_counts_sizes_letters_and_overlap(items):
    for it in items:
        objs, (w, h) = it.scene.objects, it.image.size
        assert 8 <= len(objs) <= 24
        for i, o in enumerate(objs):
            assert MIN_SIDE <= max(o.width, o.height) <= MAX_SIDE
            assert all(abs(c - ref) <= 15 for c, ref in zip(o.rgb, dict(zip(COLOR_NAMES, [
                (220, 40, 40), (40, 170, 60), (40, 80, 220), (240, 210, 40),
                (140, 60, 190), (245, 140, 30), (40, 200, 210), (245, 245, 245)]))[o.color]))
            if o.letter is not None:
                assert o.shape in LETTERED_SHAPES and min(o.width, o.height) >= MIN_LETTER_SIDE
                assert o.letter_size >= 0.6 * o.height
            for other in objs[i + 1:]:  # may touch, may not share area
                a, b = o.box, other.box
                assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3])
        for box in it.record["boxes"]:
            assert (box[2] - box[0]) * (box[3] - box[1]) <= 0.04 * w * h


def test_backgrounds_never_read_as_a_named_colour(items):
    for it in items:
        r, g, b = it.scene.background
        if r == g == b:
            assert 20 <= r <= 120
        else:
            _, s, v = colorsys.rgb_to_hsv(r / 255, g / 255, b / 255)
            assert s <= 0.25 and v <= 0.5, it.scene.background


def test_letters_are_drawn_in_the_contrasting_ink(items):
    it = next(it for it in items if it.record["type"] == "letter")
    obj = find_object(it.scene, it.record["boxes"][0])
    x0, y0, x1, y1 = obj.box
    crop = np.asarray(it.image)[y0:y1, x0:x1].reshape(-1, 3)
    ink = (crop == np.asarray(obj.letter_rgb)).all(axis=1).mean()
    assert ink > 0.03, f"letter ink covers only {ink:.1%} of the box"


def test_hard_cases_appear_and_do_what_they_say(items):
    kinds = Counter(it.scene.hard for it in items)
    assert all(kinds[k] >= 10 for k in HARD_KINDS), kinds
    gaps = []  # px between the low-contrast target and its bright distractor
    for it in items:
        w, h = it.image.size
        if it.scene.hard == "low_contrast":
            assert it.record["type"] == "letter"
            target = find_object(it.scene, it.record["boxes"][0])
            assert target.color in ("green", "cyan", "purple", "orange")
            bright = [o for o in it.scene.objects if o.width >= 52 and o.color in ("yellow", "red", "orange")]
            assert bright, "no bright distractor"
            gaps.append(max(0, bright[0].box[0] - target.box[2], target.box[0] - bright[0].box[2],
                            bright[0].box[1] - target.box[3], target.box[1] - bright[0].box[3]))
        elif it.scene.hard == "void":
            assert it.scene.texture == "flat" and it.scene.faint and len(it.scene.objects) <= 11
            covered = sum(o.width * o.height for o in it.scene.objects) / (w * h)
            assert covered < 0.06
        elif it.scene.hard == "border":
            assert any(o.box[0] == 0 or o.box[1] == 0 or o.box[2] == w or o.box[3] == h for o in it.scene.objects)
            if it.record["type"] in ("color", "shape", "letter"):
                x0, y0, x1, y1 = it.record["boxes"][0]
                assert x0 == 0 or y0 == 0 or x1 == w or y1 == h
    assert np.mean(np.array(gaps) <= 3) >= 0.8, gaps  # "beside", unless there was no room


def test_canvas_sizes(items, random_items):
    assert {it.image.size for it in items} == {(448, 448)}
    sizes = [it.image.size for it in random_items]
    assert all(v % 28 == 0 and 336 <= v <= 896 for size in sizes for v in size)
    assert len(set(sizes)) > 20 and any(w != h for w, h in sizes)
    rng = item_rng(0, "x", 0)
    drawn = {draw_canvas(rng, "random") for _ in range(2000)}
    assert {w for w, _ in drawn} == set(range(336, 897, 28))  # the whole range is reachable
    assert parse_canvas("336x896") == (336, 896)


@pytest.mark.parametrize("bad", ["448x450", "300x448", "924x448", "448", "big"])
def test_bad_canvas_is_rejected_with_a_hint(bad):
    with pytest.raises(ValueError, match="multiple of 28|WIDTHxHEIGHT"):
        parse_canvas(bad)


def test_random_canvas_items_are_valid(random_items):
    for it in random_items:
        w, h = it.image.size
        assert 8 <= len(it.scene.objects) <= 24
        assert all(0 <= b[0] < b[2] <= w and 0 <= b[1] < b[3] <= h for b in it.record["boxes"])


# ------------------------------------------------------ cell-level supervision


def test_random_ten_percent_of_cells_rarely_covers_the_answer(items):
    """A query-blind budget of 10% of the 28 px cells should seldom see every box cell."""
    rng = np.random.default_rng(0)
    covered = []
    for it in items:
        mask = boxes_to_cell_mask(it.record["boxes"], it.image.size, 28)  # [16, 16]
        keep = np.zeros(mask.size, dtype=bool)
        keep[rng.choice(mask.size, size=round(0.1 * mask.size), replace=False)] = True
        covered.append(bool(np.all(keep.reshape(mask.shape)[mask])))
    nonempty = [c for c, it in zip(covered, items) if it.record["boxes"]]
    rate, rate_nonempty = float(np.mean(covered)), float(np.mean(nonempty))
    print(f"\nrandom 10% of cells covers all box cells in {rate:.1%} of items "
          f"({rate_nonempty:.1%} of items with boxes; the rest have boxes=[])")
    assert rate < 0.25 and rate_nonempty < 0.1


def test_boxes_to_cell_mask():
    mask = boxes_to_cell_mask([[28, 0, 57, 28]], (112, 84), 28)  # 4 wide, 3 high
    assert mask.shape == (3, 4)
    assert mask.tolist() == [[False, True, True, False], [False] * 4, [False] * 4]
    assert not boxes_to_cell_mask([], (112, 84), 28).any()
    assert boxes_to_cell_mask([[0, 0, 1, 1]], (100, 100), 32).shape == (4, 4)  # partial cells count


def test_boxes_to_cell_shares_spread_each_box_by_area():
    # a 28 x 28 box straddling two cells, a 14 x 14 box inside one cell, on a 3 x 2 grid of 28 px cells
    shares = boxes_to_cell_shares([[14, 0, 42, 28], [56, 28, 70, 42]], (84, 56), 28)
    assert shares.dtype == np.float32 and shares.shape == (2, 3)
    assert shares.tolist() == [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]  # every box weighs 1, whatever its size
    # the centre cell of an object outweighs its edge cells; the mask is exactly the cells with a share
    shares = boxes_to_cell_shares([[20, 20, 64, 64]], (84, 84), 28)
    assert shares[1, 1] > shares[0, 1] > shares[0, 0] > 0 and abs(shares.sum() - 1) < 1e-6
    assert (boxes_to_cell_mask([[20, 20, 64, 64]], (84, 84), 28) == (shares > 0)).all()
    assert boxes_to_cell_shares([[70, 0, 98, 28]], (84, 28), 28).tolist() == [[0.0, 0.0, 0.5]]  # half outside


def test_cell_labels_follow_the_objects():
    objs = (
        SceneObject("square", "red", (220, 40, 40), (28, 28, 84, 84), "Q", 34),  # 2x2 cells exactly
        SceneObject("circle", "blue", (40, 80, 220), (140, 0, 160, 20)),  # part of cell (0, 5)
    )
    scene = Scene(224, 112, (60, 60, 60), objs)
    labels = cell_labels(scene, 28)
    assert labels.color.shape == (4, 8)
    expected = np.zeros((4, 8), dtype=np.int64)
    expected[1:3, 1:3] = COLOR_NAMES.index("red") + 1
    expected[0, 5] = COLOR_NAMES.index("blue") + 1
    assert (labels.color == expected).all()
    assert (labels.letter[1:3, 1:3] == ord("Q") - ord("A") + 1).all() and labels.letter[0, 5] == 0
    assert labels.shape[0, 5] == SHAPES.index("circle") + 1 and labels.object[1, 1] == 1
    assert cell_labels(scene, 28, min_cover=0.5).color[0, 5] == 0  # the small circle covers < 50%


def test_cell_labels_agree_with_item_boxes(items):
    for it in items[:40]:
        labels = cell_labels(it.scene, 28)
        for box in it.record["boxes"]:
            index = it.scene.objects.index(find_object(it.scene, box)) + 1
            won = labels.object == index
            assert won.any() and (won <= boxes_to_cell_mask([box], it.image.size, 28)).all()


# ------------------------------------------------------------- several questions


def test_questions_for_scene_are_valid_and_distinct():
    rng = item_rng(0, "scene", 0)
    scene = generate_scene(rng, (448, 448))
    assert 8 <= len(scene.objects) <= 24
    questions = questions_for_scene(scene, rng, 12)
    assert len(questions) == 12 and len({q.text for q in questions}) == 12
    assert len({q.type for q in questions}) >= 4
    for q in questions:
        assert re.fullmatch(TEMPLATE_RE[q.type], q.text)
        assert ask(scene, q.type, q.color, q.shape) == q


@pytest.mark.parametrize("hard", [None, *HARD_KINDS])
def test_generate_scene_hard_kinds(hard):
    scene = generate_scene(item_rng(1, "scene", 0), (336, 672), hard=hard)
    assert scene.size == (336, 672) and scene.hard == hard and 8 <= len(scene.objects) <= 24


# ------------------------------------------------------------- JSONL reader


def test_reader_round_trips_the_generator(tmp_path):
    path = write_split(tmp_path, split="dev", n=5, seed=1)
    records = read_jsonl(path)
    assert [r.id for r in records] == [f"dev-{i:06d}" for i in range(5)]
    for rec, line in zip(records, path.read_text().splitlines()):
        raw = json.loads(line)
        assert rec.image == tmp_path.resolve() / raw["image"] and rec.image.is_file()
        assert (rec.question, list(rec.answers), rec.type) == (raw["question"], raw["answers"], raw["type"])
        assert [list(b) for b in rec.boxes] == raw["boxes"] and rec.extra == {k: raw[k] for k in raw.keys() - {
            "id", "image", "question", "answers", "type", "boxes"}}
        assert rec.load_image().size == (448, 448)


def test_reader_accepts_converted_real_data(tmp_path):
    (tmp_path / "img.jpg").write_bytes(b"")
    line = {"id": 42, "image": "img.jpg", "question": "What is it?", "answers": ["a dog", "dog", "dog"]}
    (tmp_path / "vqa.jsonl").write_text(json.dumps(line) + "\n\n")
    (rec,) = read_jsonl(tmp_path / "vqa.jsonl")
    assert rec.id == "42" and rec.type is None and rec.boxes is None and rec.answers == ("a dog", "dog", "dog")


GOOD = {"id": "x-1", "image": "a.png", "question": "What color is the star?", "answers": ["red"],
        "type": "color", "boxes": [[0, 0, 10, 10]]}


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "not valid JSON"),
        (json.dumps(["a", "list"]), "JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "answers"}), "missing required key.*answers"),
        (json.dumps({**GOOD, "answers": "red"}), "list of strings"),
        (json.dumps({**GOOD, "answers": []}), "non-empty list"),
        (json.dumps({**GOOD, "boxes": [[0, 0, 10]]}), r"'boxes'\[0\]"),
        (json.dumps({**GOOD, "boxes": [[10, 0, 0, 10]]}), "x1 < x0"),
        (json.dumps({**GOOD, "image": "missing.png"}), "not found"),
        (json.dumps({**GOOD, "id": "x-0"}), "duplicate id"),
    ],
)
def test_reader_rejects_a_malformed_line_naming_it(tmp_path, bad_line, message):
    (tmp_path / "a.png").write_bytes(b"")
    lines = [json.dumps({**GOOD, "id": "x-0"}), "", bad_line]  # the bad record is on line 3
    (tmp_path / "set.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(JSONLFormatError, match=rf"line 3: .*{message}") as err:
        read_jsonl(tmp_path / "set.jsonl")
    assert err.value.line == 3


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="gen-data"):
        read_jsonl(tmp_path / "nope.jsonl")


@pytest.mark.parametrize(
    "prediction, answers, expected",
    [("Red.", ["red"], 1.0), ("  RED ", ["red"], 1.0), ("blue", ["red"], 0.0), ("3", ["3"], 1.0),
     ("t-shirt!", ["T shirt", "tshirt"], 1.0), ("yes", ["no"], 0.0), ("", ["red"], 0.0)],
)
def test_score_is_exact_match_after_normalisation(prediction, answers, expected):
    assert score(prediction, answers) == expected


def test_normalize_answer():
    assert normalize_answer("  What's   UP?! ") == "whats up"


# ------------------------------------------------------------------- CLI


def test_gen_data_cli_writes_n_records_with_images(tmp_path, capsys):
    parser = cli.add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--out", str(tmp_path / "out"), "--split", "test", "--n", "7", "--seed", "2",
                              "--canvas", "random"])
    assert cli.run(args) == 0
    records = read_jsonl(tmp_path / "out" / "test.jsonl")  # checks every image exists
    assert len(records) == 7 and len(list((tmp_path / "out" / "images").glob("test-*.png"))) == 7
    assert "images/s" in capsys.readouterr().out


def test_gen_data_cli_rejects_bad_canvas(tmp_path, capsys):
    args = cli.add_arguments(argparse.ArgumentParser()).parse_args(["--out", str(tmp_path), "--canvas", "500x500"])
    assert cli.run(args) == 2
    assert "multiple of 28" in capsys.readouterr().err
    assert not Path(tmp_path, "test.jsonl").exists()
