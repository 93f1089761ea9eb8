"""Converters of real data sets (arr_coc.data.convert) on tiny fixtures written in each data set's
published layout (docs/DATA.md), and the per-record metrics (arr_coc.data.metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from arr_coc.data import read_jsonl, score_record, vqa_accuracy, vqa_normalize, yes_no_score
from arr_coc.data.convert import LayoutError, convert
from arr_coc.data.metrics import metric_of, yes_no

ROOT = Path(__file__).resolve().parent.parent


def _images(folder: Path, names_sizes: dict[str, tuple[int, int]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in names_sizes.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (90, 120, 150)).save(folder / name)
    return folder


def _dump(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("humans, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_averages_the_ten_leave_one_out_subsets(humans, expected):
    answers = ["red"] * humans + ["blue"] * (10 - humans)
    assert vqa_accuracy("red", answers) == pytest.approx(expected)


@pytest.mark.parametrize("prediction, answer", [
    ("two", "2"), ("2", "two"), ("the dog", "dog"), ("A dog.", "dog"), ("Yes.", "yes"), ("dont", "don't"),
    ("black-and-white", "black and white"), ("3,000", "3000"), ("none", "0"), ("  Red\n", "red"),
])
def test_vqa_normalisation_makes_equal_answers_equal(prediction, answer):
    assert vqa_normalize(prediction) == vqa_normalize(answer)
    assert vqa_accuracy(prediction, [answer] * 10) == 1.0


def test_vqa_normalisation_keeps_what_differs():
    assert vqa_normalize("3.5") == "3.5"               # a decimal point stays
    assert vqa_normalize("red car") != vqa_normalize("red")
    assert vqa_accuracy("cat", ["dog"] * 10) == 0.0
    assert vqa_accuracy("2", ["two"]) == 1.0           # one reference: exact match after normalisation


def test_yes_no_follows_popes_rule():
    assert yes_no("No, there is not.") == "no" and yes_no("There is not a dog") == "no"
    assert yes_no("Yes, there is a dog. No doubt.") == "yes" and yes_no("a cat") == "yes"
    assert yes_no_score("No.", ["no"]) == 1.0 and yes_no_score("Yes", ["no"]) == 0.0


def test_score_record_uses_the_records_metric(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    rows = [{"id": "1", "image": "a.png", "question": "q?", "answers": ["red"] * 3 + ["blue"] * 7, "metric": "vqa"},
            {"id": "2", "image": "a.png", "question": "q?", "answers": ["red", "blue"]},
            {"id": "3", "image": "a.png", "question": "q?", "answers": ["no"], "metric": "yesno"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vqa, exact, pope = read_jsonl(tmp_path / "d.jsonl")
    assert metric_of(vqa) == "vqa" and metric_of(exact) == "exact"
    assert score_record("Red", vqa) == pytest.approx(0.9) and score_record("blue", vqa) == 1.0
    assert score_record("Red!", exact) == 1.0 and score_record("green", exact) == 0.0
    assert score_record("No, there is none.", pope) == 1.0
    with pytest.raises(ValueError, match="known metrics"):
        score_record("x", {"id": "4", "answers": ["x"], "metric": "bleu"})


def test_the_evaluation_report_keeps_partial_credit():
    from arr_coc.evaluation.loop import _Rows, summarise

    row = summarise("none", 1.0, _Rows(correct=[0.9, 1.0, 0.0], types=["a"] * 3))
    assert row["correct"] == [0.9, 1, 0] and row["accuracy"] == pytest.approx(1.9 / 3)


# ---------------------------------------------------------------------------- GQA


def _gqa(tmp_path):
    images = _images(tmp_path / "images", {"2354786.jpg": (500, 333), "2375429.jpg": (640, 480)})
    questions = {
        "07333408": {"semantic": [], "entailed": [], "equivalent": ["07333408"], "question": "What is on the white wall?",
                     "imageId": "2375429", "isBalanced": True, "groups": {"global": "", "local": "14-wall_on,s"},
                     "answer": "pipe", "semanticStr": "select: wall (722332)->relate: _,on,s (722335) [0]",
                     "annotations": {"answer": {"0": "722335"}, "question": {"4:6": "722332"},
                                     "fullAnswer": {"1": "722335", "5": "722332"}},
                     "types": {"detailed": "relS", "semantic": "rel", "structural": "query"},
                     "fullAnswer": "The pipe is on the wall."},
        "20644644": {"question": "Which room is it?", "imageId": "2354786", "answer": "bedroom",
                     "annotations": {"answer": {}, "question": {}, "fullAnswer": {}},
                     "types": {"detailed": "place", "semantic": "global", "structural": "query"},
                     "fullAnswer": "It is a bedroom.", "isBalanced": True},
    }
    graphs = {"2375429": {"width": 640, "height": 480, "location": "bathroom", "objects": {
        "722332": {"name": "wall", "x": 600, "y": 10, "w": 100, "h": 200, "attributes": ["white"], "relations": []},
        "722335": {"name": "pipe", "x": 5, "y": 6, "w": 30, "h": 40, "attributes": [],
                   "relations": [{"name": "on", "object": "722332"}]}}},
              "2354786": {"width": 500, "height": 333, "objects": {}}}
    src = _dump(tmp_path / "val_balanced_questions.json", questions)
    return src, _dump(tmp_path / "val_sceneGraphs.json", graphs), images


def test_gqa_boxes_are_the_annotated_objects_in_pixels(tmp_path):
    src, graphs, _ = _gqa(tmp_path)
    report = convert("gqa", src, tmp_path / "out", scene_graphs=graphs)
    assert report.counts == {"val_balanced": 2} and report.with_boxes == {"val_balanced": 1}
    recs = {r.id: r for r in read_jsonl(tmp_path / "out" / "val_balanced.jsonl")}
    wall = recs["07333408"]
    assert wall.answers == ("pipe",) and wall.type == "query" and wall.image.name == "2375429.jpg"
    # the question's object first, then the answer's; the wall is clipped at the image's right edge
    assert wall.boxes == ((600, 10, 640, 210), (5, 6, 35, 46))
    assert recs["20644644"].boxes == ()          # a question about no object: no box, not "unknown"
    assert "metric" not in wall.extra            # GQA's accuracy is exact match


def test_gqa_without_scene_graphs_has_no_boxes_and_refuses_other_layouts(tmp_path):
    src, _, _ = _gqa(tmp_path)
    report = convert("gqa", src, tmp_path / "out", split="testdev", limit=1)
    rec, = read_jsonl(report.files["testdev"])
    assert rec.boxes is None and "no --scene-graphs given: no boxes" in report.summary()
    bad = _dump(tmp_path / "q.json", {"1": {"imageId": "2354786", "question": "q?", "answer": "a", "types": {},
                                            "annotations": {}}, "2": {"question": "q?", "answer": "a"}})
    with pytest.raises(LayoutError, match=r"q.json: item 1 \(question '2'\) has no 'imageId'; .*GQA's balanced"):
        convert("gqa", bad, tmp_path / "out")
    test = _dump(tmp_path / "test_balanced_questions.json", {"1": {"imageId": "2354786", "question": "q?"}})
    with pytest.raises(LayoutError, match="no answers to score"):
        convert("gqa", test, tmp_path / "out")
    with pytest.raises(LayoutError, match="not an object keyed by questionId"):
        convert("gqa", _dump(tmp_path / "l.json", [1]), tmp_path / "out")


# ---------------------------------------------------------------------------- TextVQA


def _textvqa(tmp_path):
    images = _images(tmp_path / "train_images", {"0054c91397f2fe05.jpg": (400, 200), "a0b1.jpg": (100, 100)})
    answers = ["coca cola"] * 6 + ["coke"] * 3 + ["Coca-Cola"]
    data = {"dataset_type": "val", "dataset_name": "textvqa", "dataset_version": "0.5.1", "data": [
        {"question": "what brand is it?", "image_id": "0054c91397f2fe05", "image_classes": ["Bottle"],
         "flickr_original_url": "https://x", "flickr_300k_url": "https://y", "image_width": 400, "image_height": 200,
         "answers": list(reversed(answers)), "question_tokens": ["what", "brand"], "question_id": 34602,
         "set_name": "val"},
        {"question": "what number?", "image_id": "a0b1", "image_width": 100, "image_height": 100,
         "answers": ["7"] * 10, "question_id": 34603, "set_name": "val"}]}
    box = lambda x, y, w, h: {"top_left_x": x, "top_left_y": y, "width": w, "height": h,  # noqa: E731
                              "rotation": 0, "roll": 0, "pitch": 0, "yaw": 0}
    ocr = {"dataset_type": "val", "dataset_name": "textvqa", "dataset_version": "0.2", "data": [
        {"image_id": "0054c91397f2fe05", "ocr_tokens": ["Coca", "Cola", "zero"],
         "ocr_info": [{"word": "Coca", "bounding_box": box(0.1, 0.2, 0.2, 0.1)},
                      {"word": "Cola", "bounding_box": box(0.35, 0.25, 0.2, 0.1)},
                      {"word": "zero", "bounding_box": box(0.7, 0.7, 0.1, 0.1)}]},
        {"image_id": "a0b1", "ocr_tokens": ["8"], "ocr_info": [{"word": "8", "bounding_box": box(0, 0, 1, 1)}]}]}
    return _dump(tmp_path / "TextVQA_0.5.1_val.json", data), _dump(tmp_path / "TextVQA_Rosetta_OCR_v0.2_val.json",
                                                                     ocr), images


def test_textvqa_boxes_are_the_ocr_tokens_spelling_an_answer_scaled_to_pixels(tmp_path):
    src, ocr, images = _textvqa(tmp_path)
    report = convert("textvqa", src, tmp_path / "out", images=images, ocr=ocr)
    cola, seven = read_jsonl(report.files["val"])
    assert cola.id == "34602" and cola.answers[:7] == ("coca cola",) * 6 + ("coke",) and len(cola.answers) == 10
    assert cola.extra["metric"] == "vqa" and score_record("Coca Cola", cola) == 1.0
    # "Coca" + "Cola": the run's box, normalised [0.1, 0.2]-[0.55, 0.35] of a 400 x 200 image
    assert cola.boxes == ((40, 40, 220, 70),)
    assert seven.boxes == () and "no OCR token spells an answer: boxes []" in report.summary()


def test_textvqa_refuses_other_layouts(tmp_path):
    src, ocr, images = _textvqa(tmp_path)
    with pytest.raises(LayoutError, match="has no 'data'; this does not look like TextVQA's questions"):
        convert("textvqa", _dump(tmp_path / "x.json", {"questions": []}), tmp_path / "out", images=images)
    broken = json.loads(ocr.read_text())
    del broken["data"][1]["ocr_info"][0]["bounding_box"]
    with pytest.raises(LayoutError, match=r"item 1 \(image_id 'a0b1'\), ocr_info\[0\] has no 'bounding_box'; .*Rosetta OCR"):
        convert("textvqa", src, tmp_path / "out", images=images, ocr=_dump(tmp_path / "ocr.json", broken))
    test = json.loads(src.read_text())
    del test["data"][0]["answers"]
    with pytest.raises(LayoutError, match="test answers are hidden"):
        convert("textvqa", _dump(tmp_path / "t.json", test), tmp_path / "out", images=images)


# ---------------------------------------------------------------------------- VQAv2


def _vqav2(tmp_path):
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000393225.jpg": (64, 48)})
    questions = {"info": {}, "task_type": "Open-Ended", "data_type": "mscoco", "license": {},
                 "data_subtype": "val2014", "questions": [
                     {"image_id": 393225, "question": "What color is the bowl?", "question_id": 393225000},
                     {"image_id": 999, "question": "Is it missing?", "question_id": 999000}]}
    answers = ["white"] * 3 + ["light blue"] * 7
    annotations = {"info": {}, "license": {}, "data_type": "mscoco", "data_subtype": "val2014", "annotations": [
        {"question_type": "what color is the", "multiple_choice_answer": "light blue", "image_id": 393225,
         "answer_type": "other", "question_id": 393225000,
         "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(answers)]},
        {"question_type": "is it", "multiple_choice_answer": "no", "image_id": 999, "answer_type": "yes/no",
         "question_id": 999000, "answers": [{"answer": "no", "answer_confidence": "yes", "answer_id": 1}] * 10}]}
    return (_dump(tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json", questions),
            _dump(tmp_path / "v2_mscoco_val2014_annotations.json", annotations), images)


def test_vqav2_ten_answers_coco_file_names_and_missing_images_skipped(tmp_path):
    src, ann, images = _vqav2(tmp_path)
    report = convert("vqav2", src, tmp_path / "out", images=images, annotations=ann)
    rec, = read_jsonl(report.files["val2014"])       # the second question's image is not there
    assert report.skipped == {f"image not found under {images}": 1}
    assert rec.image.name == "COCO_val2014_000000393225.jpg" and rec.type == "other" and rec.boxes is None
    assert rec.answers[0] == "light blue" and sorted(rec.answers) == sorted(["white"] * 3 + ["light blue"] * 7)
    assert score_record("white", rec) == pytest.approx(0.9)


def test_vqav2_needs_its_annotations_in_their_layout(tmp_path):
    src, ann, images = _vqav2(tmp_path)
    with pytest.raises(ValueError, match="vqav2 needs --annotations FILE"):
        convert("vqav2", src, tmp_path / "out", images=images)
    with pytest.raises(ValueError, match="vqav2 does not read --ocr"):
        convert("vqav2", src, tmp_path / "out", images=images, annotations=ann, ocr=ann)
    broken = json.loads(ann.read_text())
    del broken["annotations"][1]["answers"]
    with pytest.raises(LayoutError, match=r"item 1 \(question_id 999000\) has no 'answers'; this does not look like VQAv2's annotations"):
        convert("vqav2", src, tmp_path / "out", images=images, annotations=_dump(tmp_path / "a.json", broken))
    with pytest.raises(LayoutError, match="annotations.json has no 'questions'; this does not look like VQAv2's questions"):
        convert("vqav2", ann, tmp_path / "out", images=images, annotations=ann)


# ---------------------------------------------------------------------------- COCO instances, POPE, RefCOCO


def _instances(tmp_path, file_name="COCO_val2014_000000310196.jpg"):
    return _dump(tmp_path / "instances.json", {
        "info": {}, "licenses": [],
        "images": [{"id": 310196, "file_name": file_name, "width": 100, "height": 80, "license": 1}],
        "annotations": [
            {"id": 11, "image_id": 310196, "category_id": 35, "bbox": [10.5, 20, 30, 40], "area": 1200, "iscrowd": 0},
            {"id": 12, "image_id": 310196, "category_id": 35, "bbox": [90, 70, 30, 30], "area": 900, "iscrowd": 0},
            {"id": 13, "image_id": 310196, "category_id": 1, "bbox": [0, 0, 5, 5], "area": 25, "iscrowd": 1}],
        "categories": [{"id": 1, "name": "person", "supercategory": "person"},
                       {"id": 35, "name": "snowboard", "supercategory": "sports"},
                       {"id": 67, "name": "dining table", "supercategory": "furniture"}]})


def test_coco_instances_become_one_record_per_image_and_category(tmp_path):
    inst = _instances(tmp_path)
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    report = convert("coco", inst, tmp_path / "out", images=images, split="val2014", image_mode="copy")
    board, person = read_jsonl(report.files["val2014"])     # the file's order: the first annotation is a snowboard
    assert board.question == "Where is the snowboard?" and board.answers == ("snowboard",) and board.type == "sports"
    assert board.boxes == ((10.5, 20, 40.5, 60), (90, 70, 100, 80))      # clipped to the 100 x 80 image
    assert person.boxes == ((0, 0, 5, 5),) and board.image == tmp_path / "out" / "images" / board.image.name
    with pytest.raises(LayoutError, match=r"i.json: images\[0\] \(id 1\) has no 'file_name'; this does not look like COCO"):
        convert("coco", _dump(tmp_path / "i.json", {"images": [{"id": 1}], "annotations": [], "categories": []}),
                tmp_path / "out", images=images)


def test_pope_boxes_of_the_asked_object_and_the_yes_no_metric(tmp_path):
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    rows = [{"question_id": 1, "image": "COCO_val2014_000000310196.jpg", "text": "Is there a snowboard in the image?",
             "label": "yes"},
            {"question_id": 2, "image": "COCO_val2014_000000310196.jpg",
             "text": "Is there a dining table in the image?", "label": "no"}]
    src = tmp_path / "coco_pope_adversarial.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = convert("pope", src, tmp_path / "out", images=images, instances=_instances(tmp_path),
                     image_mode="symlink")
    yes, no = read_jsonl(report.files["coco_pope_adversarial"])
    assert yes.boxes == ((10.5, 20, 40.5, 60), (90, 70, 100, 80)) and no.boxes == ()
    assert yes.type == "adversarial" and yes.extra["metric"] == "yesno" and yes.image.is_file()
    assert score_record("Yes, there is a snowboard.", yes) == 1.0 and score_record("No, there is not.", no) == 1.0
    src.write_text(json.dumps({"question_id": 1, "image": "x.jpg", "text": "Is there a cat in the image?"}) + "\n")
    with pytest.raises(LayoutError, match=r"line 1 \(question_id 1\) has no 'label'; this does not look like a POPE question file"):
        convert("pope", src, tmp_path / "out", images=images)


def _refs(tmp_path):
    refs = [{"sent_ids": [0, 1], "file_name": "COCO_train2014_000000310196_11.jpg", "ann_id": 11, "ref_id": 5,
             "image_id": 310196, "split": "train", "category_id": 35,
             "sentences": [{"tokens": ["left", "board"], "raw": "Left board", "sent_id": 0, "sent": "left board"},
                           {"tokens": ["board"], "raw": "board", "sent_id": 1, "sent": "board"}]},
            {"sent_ids": [2], "file_name": "COCO_train2014_000000310196_13.jpg", "ann_id": 13, "ref_id": 6,
             "image_id": 310196, "split": "testA", "category_id": 1,
             "sentences": [{"tokens": ["man"], "raw": "man", "sent_id": 2, "sent": "man"}]}]
    return _dump(tmp_path / "refs_unc.json", refs)


def test_refcoco_one_record_per_sentence_one_file_per_split(tmp_path):
    inst = _instances(tmp_path, file_name="COCO_train2014_000000310196.jpg")
    images = _images(tmp_path / "train2014", {"COCO_train2014_000000310196.jpg": (100, 80)})
    report = convert("refcoco", _refs(tmp_path), tmp_path / "out", images=images, instances=inst)
    assert report.counts == {"train": 2, "testA": 1}
    left, board = read_jsonl(report.files["train"])
    assert (left.id, left.question, left.answers, left.type) == ("5-0", "left board", ("snowboard",), "refer")
    assert left.boxes == board.boxes == ((10.5, 20, 40.5, 60),) and left.image.name == "COCO_train2014_000000310196.jpg"
    only = convert("refcoco+", _refs(tmp_path), tmp_path / "only", images=images, instances=inst, split="testA")
    assert list(only.files) == ["testA"]


def test_refcoco_refuses_pickles_and_swapped_files(tmp_path):
    inst = _instances(tmp_path)
    images = _images(tmp_path / "train2014", {})
    pickle_file = tmp_path / "refs(unc).p"
    pickle_file.write_bytes(b"\x80\x04\x95\x00\x00")
    with pytest.raises(LayoutError, match="is a Python pickle; this project never loads pickles"):
        convert("refcoco", pickle_file, tmp_path / "out", images=images, instances=inst)
    with pytest.raises(LayoutError, match="is a COCO instances file; give it as --instances"):
        convert("refcocog", inst, tmp_path / "out", images=images, instances=inst)
    with pytest.raises(ValueError, match="refcoco needs --instances"):
        convert("refcoco", _refs(tmp_path), tmp_path / "out", images=images)


# ---------------------------------------------------------------------------- command line


def test_cli_convert_end_to_end(tmp_path, capsys):
    from arr_coc.cli import main

    src, ann, images = _vqav2(tmp_path)
    out = tmp_path / "vqa"
    assert main(["convert", "vqav2", "--src", str(src), "--annotations", str(ann), "--images", str(images),
                 "--out", str(out), "--limit", "5"]) == 0
    assert "wrote 1 records to" in capsys.readouterr().out
    rec, = read_jsonl(out / "val2014.jsonl")            # the image path resolves from the JSONL's folder
    assert rec.image.resolve() == (images / "COCO_val2014_000000393225.jpg").resolve()
    assert _lines(out / "val2014.jsonl")[0]["image"] == "../val2014/COCO_val2014_000000393225.jpg"
    assert main(["convert", "gqa", "--src", str(ann), "--images", str(images), "--out", str(out)]) == 2
    assert "convert: error:" in capsys.readouterr().err
    assert main(["convert", "pope", "--src", str(src), "--out", str(out)]) == 2
    assert "no images folder at" in capsys.readouterr().err


def test_the_converters_import_no_torch():
    code = ("import sys, arr_coc.data.convert as c\n"
            "[c.converter(d) for d in c.DATASETS]\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "NO-TORCH", out.stderr[-500:]
    from arr_coc.cli.convert import DATASETS as CHOICES   # the command's choices, kept without importing the library
    from arr_coc.data.convert import DATASETS

    assert list(CHOICES) == list(DATASETS)


def test_an_image_name_cannot_leave_the_images_folder(tmp_path):
    images = _images(tmp_path / "val2014", {"a.jpg": (8, 8)})
    src = tmp_path / "coco_pope_random.json"
    src.write_text(json.dumps({"question_id": 1, "image": "../../x.jpg", "text": "Is there a cat in the image?",
                               "label": "no"}) + "\n")
    with pytest.raises(LayoutError, match="leaves the images folder"):
        convert("pope", src, tmp_path / "out", images=images, image_mode="copy")


def test_a_converted_gqa_file_trains_stage_one(tmp_path, tiny_vlm):
    """The converter's output is training data as it stands: stage 1 reads its boxes and trains the layer."""
    import torch

    from arr_coc.core.layer import ARRCOCLayer
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.training.config import TrainConfig
    from arr_coc.training.loop import train

    src, graphs, _ = _gqa(tmp_path)
    questions = json.loads(src.read_text())
    questions["07333409"] = dict(questions["07333408"], question="What is the pipe on?", answer="wall",
                                 annotations={"answer": {"4": "722332"}, "question": {"3": "722335"},
                                              "fullAnswer": {}})
    _dump(src, questions)
    report = convert("gqa", src, tmp_path / "out", scene_graphs=graphs)
    assert report.with_boxes == {"val_balanced": 2}
    data = str(tmp_path / "out" / "val_balanced.jsonl")
    model, processor = tiny_vlm("qwen2_vl")
    cfg = TrainConfig(stage=1, out=str(tmp_path / "layer"), steps=3, batch_size=2, eval_every=3, warmup=1)
    state = train(cfg, "", data, progress=False, vlm=ARRCOCQwen(model, processor))
    assert state["step"] == 3 and state["train_items"] == 2 and state["val_items"] == 1
    # the boxes reach the loss: an item without answer cells contributes no gradient (ranking_loss skips it)
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["grad_norm"] > 0 for r in state["log"])
    assert ARRCOCLayer.from_pretrained(cfg.out).config.knowing.query_dim == model.config.text_config.hidden_size


# ---------------------------------------------------------------------------- malformed records (issue 39)
# Every wrong type is refused naming the file, the record and the field; every record or box left out or
# changed is counted in the summary and listed, with its file, record and field, in OUT/convert_log.txt.


def _log(report) -> str:
    assert report.log_file is not None and report.log_file.name == "convert_log.txt"
    return report.log_file.read_text()


def _pope_file(tmp_path, rows) -> Path:
    src = tmp_path / "coco_pope_random.json"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def _pope(tmp_path, rows):
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    src = _pope_file(tmp_path, rows)
    return lambda: convert("pope", src, tmp_path / "out", images=images)


POPE_ROW = {"question_id": 7, "image": "COCO_val2014_000000310196.jpg", "text": "Is there a snowboard in the image?",
            "label": "yes"}


@pytest.mark.parametrize("key,value,words", [("text", 5, "'text' is 5, not a string"),
                                             ("image", 548882, "'image' is 548882, not a string"),
                                             ("question_id", None, "'question_id' is None, not an integer or a string"),
                                             ("label", "maybe", "'label' is 'maybe', not yes or no")])
def test_pope_a_wrong_type_names_the_file_the_record_and_the_field(tmp_path, key, value, words):
    run = _pope(tmp_path, [POPE_ROW, {**POPE_ROW, "question_id": 8, key: value}])
    with pytest.raises(LayoutError) as info:
        run()
    assert str(info.value).startswith("coco_pope_random.json: line 2") and words in str(info.value)
    if key != "question_id":
        assert "(question_id 8)" in str(info.value)


def _broken_instances(tmp_path, image=None, annotation=None):
    inst = json.loads(_instances(tmp_path).read_text())
    inst["images"][0].update(image or {})
    inst["annotations"][0].update(annotation or {})
    return _dump(tmp_path / "instances.json", inst)


@pytest.mark.parametrize("image,annotation,words", [
    ({"width": "abc"}, None, "images[0] (id 310196): 'width' is 'abc', not a positive number"),
    ({"height": 0}, None, "images[0] (id 310196): 'height' is 0, not a positive number"),
    (None, {"bbox": [None, 20, 30, 40]}, "annotations[0] (id 11): 'bbox' is [None, 20, 30, 40], not [x, y, w, h]"),
    (None, {"bbox": [10, 20, 30]}, "annotations[0] (id 11): 'bbox' is [10, 20, 30], not [x, y, w, h]"),
    (None, {"bbox": "10 20 30 40"}, "annotations[0] (id 11): 'bbox' is '10 20 30 40', not [x, y, w, h]"),
])
@pytest.mark.parametrize("reader", ["coco", "pope", "refcoco"])
def test_the_coco_instances_reader_names_the_file_the_record_and_the_field(tmp_path, image, annotation, words,
                                                                          reader):
    """COCO, POPE and RefCOCO read the instances file with one reader: a wrong type is one error for all."""
    inst = _broken_instances(tmp_path, image, annotation)
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    src = {"coco": inst, "pope": _pope_file(tmp_path, [POPE_ROW]), "refcoco": _refs(tmp_path)}[reader]
    with pytest.raises(LayoutError) as info:
        convert(reader, src, tmp_path / "out", images=images, **({} if reader == "coco" else {"instances": inst}))
    assert str(info.value).startswith("instances.json: ") and words in str(info.value), str(info.value)


@pytest.mark.parametrize("bbox,kind", [([200, 200, 10, 10], "box dropped: wholly outside the image"),
                                       ([10, 20, -30, 40], "box dropped: no area")])
def test_coco_a_dropped_box_and_the_record_it_empties_are_listed(tmp_path, bbox, kind):
    inst = _broken_instances(tmp_path, annotation={"bbox": bbox})       # the snowboard's first box
    inst_data = json.loads(inst.read_text())
    inst_data["annotations"][1]["bbox"] = bbox                            # and its second: the record is empty
    _dump(inst, inst_data)
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    report = convert("coco", inst, tmp_path / "out", images=images, split="val2014")
    assert [r.id for r in read_jsonl(report.files["val2014"])] == ["310196-1"]   # the person stays
    log = _log(report)
    assert f"{kind}" in log and "instances.json: annotation 11 (image 310196): bbox" in log
    assert "instances.json: annotation 12 (image 310196): bbox" in log
    assert "record dropped: no box of its category is left\tinstances.json: record '310196-35'" in log
    assert "record dropped: no box of its category is left: 1" in report.summary()


def test_coco_a_clipped_box_is_listed_as_changed_and_a_box_inside_is_not(tmp_path):
    inst = _instances(tmp_path)
    images = _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80)})
    report = convert("coco", inst, tmp_path / "out", images=images, split="val2014")
    changed = [what for kind, what in report.log.entries if kind == "box changed: clipped to the image"]
    assert changed == ["instances.json: annotation 12 (image 310196): bbox [90, 70, 30, 30] clipped to "
                       "[90.0, 70.0, 100, 80] (100x80 image)"]                 # 11 and 13 lie inside


def test_coco_limit_takes_the_first_records_in_the_files_order(tmp_path):
    inst = json.loads(_instances(tmp_path).read_text())
    inst["images"].append({"id": 5, "file_name": "COCO_val2014_000000000005.jpg", "width": 100, "height": 80})
    inst["annotations"].insert(0, {"id": 1, "image_id": 310196, "category_id": 67, "bbox": [1, 1, 5, 5]})
    inst["annotations"].append({"id": 2, "image_id": 5, "category_id": 1, "bbox": [1, 1, 5, 5]})
    src = _dump(tmp_path / "instances_val2014.json", inst)
    _images(tmp_path / "val2014", {"COCO_val2014_000000310196.jpg": (100, 80),
                                   "COCO_val2014_000000000005.jpg": (100, 80)})
    report = convert("coco", src, tmp_path / "out", limit=2)              # images: val2014/ beside the file
    assert [r.id for r in read_jsonl(report.files["val2014"])] == ["310196-67", "310196-35"]


def test_gqa_a_wrong_type_and_a_box_outside_are_named(tmp_path):
    src, graphs, images = _gqa(tmp_path)
    g = json.loads(graphs.read_text())
    g["2375429"]["objects"]["722335"]["x"] = "abc"
    with pytest.raises(LayoutError) as info:
        convert("gqa", src, tmp_path / "out", scene_graphs=_dump(tmp_path / "g.json", g))
    assert str(info.value).startswith("g.json: scene graph '2375429' (for question '07333408'), object '722335': "
                                      "'x' is 'abc', not a number"), str(info.value)
    g["2375429"]["objects"]["722335"]["x"] = 5000                         # wholly outside the 640 x 480 image
    report = convert("gqa", src, tmp_path / "out", scene_graphs=_dump(tmp_path / "g.json", g))
    wall = next(r for r in read_jsonl(report.files["val_balanced"]) if r.id == "07333408")
    assert wall.boxes is None                      # not the wall alone: the question points at the pipe too
    log = _log(report)
    assert "box dropped: wholly outside the image\tg.json: scene graph '2375429' (for question '07333408'), " \
           "object '722335': bbox [5000, 6, 30, 40]" in log
    assert "val_balanced_questions.json: record '07333408'" in log          # and its note, with the record id


def test_gqa_unresolved_references_are_listed_with_their_record_ids(tmp_path):
    src, graphs, _ = _gqa(tmp_path)
    g = json.loads(graphs.read_text())
    del g["2375429"]["objects"]["722335"]
    report = convert("gqa", src, tmp_path / "out", scene_graphs=_dump(tmp_path / "g.json", g))
    assert ("note: an annotated object is not in the scene graph: no boxes",
            "val_balanced_questions.json: record '07333408'") in report.log.entries


def test_textvqa_wrong_types_pixel_ocr_boxes_and_a_wrong_stated_size(tmp_path):
    src, ocr, images = _textvqa(tmp_path)
    data = json.loads(src.read_text())
    data["data"][0]["image_width"] = "abc"
    with pytest.raises(LayoutError) as info:
        convert("textvqa", _dump(tmp_path / "t.json", data), tmp_path / "out", images=images, ocr=ocr)
    assert str(info.value).startswith("t.json: item 0 (question_id 34602): 'image_width' is 'abc', not a positive")
    pixels = json.loads(ocr.read_text())
    for info_ in pixels["data"][0]["ocr_info"]:                          # boxes in pixels, not shares
        box = info_["bounding_box"]
        box.update(top_left_x=box["top_left_x"] * 400, top_left_y=box["top_left_y"] * 200,
                   width=box["width"] * 400, height=box["height"] * 200)
    report = convert("textvqa", src, tmp_path / "out", images=images, ocr=_dump(tmp_path / "o.json", pixels))
    cola = read_jsonl(report.files["val"])[0]
    assert cola.boxes is None                                            # not clipped into a wrong box
    assert "box dropped: OCR box not normalised to [0, 1]\to.json: item 0 (image_id '0054c91397f2fe05'), " \
           "ocr_info[0].bounding_box: [40.0, 40.0, 80.0, 20.0]" in _log(report)
    data = json.loads(src.read_text())
    data["data"][0].update(image_width=800, image_height=400)           # the file is 400 x 200
    report = convert("textvqa", _dump(tmp_path / "TextVQA_0.5.1_val.json", data), tmp_path / "out", ocr=ocr)
    cola = read_jsonl(report.files["val"])[0]                            # images: train_images/ beside the file
    assert cola.boxes is None and "boxes are for a 800x400 image, but 0054c91397f2fe05.jpg is 400x200" in _log(report)


def test_vqav2_a_wrong_image_id_and_a_mismatched_annotation(tmp_path):
    src, ann, images = _vqav2(tmp_path)
    q = json.loads(src.read_text())
    q["questions"][0]["image_id"] = "abc"
    with pytest.raises(LayoutError) as info:
        convert("vqav2", _dump(tmp_path / "q.json", q), tmp_path / "out", images=images, annotations=ann)
    assert str(info.value).startswith("q.json: item 0 (question_id 393225000): 'image_id' is 'abc', not a COCO")
    a = json.loads(ann.read_text())
    a["annotations"][0]["image_id"] = 12345
    with pytest.raises(ValueError, match="no record to write") as info:
        convert("vqav2", src, tmp_path / "out", images=images, annotations=_dump(tmp_path / "a.json", a))
    assert "record dropped: its question and its annotation name different images: 1" in str(info.value)
    assert "(question_id 393225000): 'image_id' 393225, but its annotation in a.json says 12345" in str(info.value)


def test_vqav2_finds_its_images_in_the_split_folder_by_default(tmp_path):
    src, ann, _ = _vqav2(tmp_path)                                       # images in val2014/ beside the files
    report = convert("vqav2", src, tmp_path / "out", annotations=ann)
    assert report.counts == {"val2014": 1}


def test_refcoco_a_ref_on_another_image_and_a_box_outside(tmp_path):
    inst = json.loads(_instances(tmp_path, file_name="COCO_train2014_000000310196.jpg").read_text())
    inst["images"].append({"id": 9, "file_name": "COCO_train2014_000000000009.jpg", "width": 100, "height": 80})
    inst["annotations"][2]["bbox"] = [500, 500, 5, 5]                    # ref 6's box: outside its image
    inst_path = _dump(tmp_path / "instances.json", inst)
    refs = json.loads(_refs(tmp_path).read_text())
    refs.append(dict(refs[0], ref_id=7, image_id=9))                     # ann 11 is on image 310196, not 9
    images = _images(tmp_path / "train2014", {"COCO_train2014_000000310196.jpg": (100, 80),
                                               "COCO_train2014_000000000009.jpg": (100, 80)})
    report = convert("refcoco", _dump(tmp_path / "refs.json", refs), tmp_path / "out", images=images,
                     instances=inst_path)
    assert report.counts == {"train": 2, "testA": 1}                     # ref 7 is not written with 310196's box
    man, = read_jsonl(report.files["testA"])
    assert man.boxes is None                                             # unknown, not "points at nothing"
    log = _log(report)
    assert "record dropped: the ref's image is not its annotation's\trefs.json: item 2 (ref_id 7): 'image_id' 9, " \
           "but ann_id 11 is on image 310196" in log
    assert "box dropped: wholly outside the image\tinstances.json: annotation 13 (image 310196)" in log


def test_a_clean_conversion_writes_no_log(tmp_path):
    """Negative control: nothing dropped or changed, nothing listed (and an old log is not left behind)."""
    src, ann, images = _vqav2(tmp_path)
    q = json.loads(src.read_text())
    q["questions"] = q["questions"][:1]
    out = tmp_path / "out"
    out.mkdir()
    (out / "convert_log.txt").write_text("stale")
    report = convert("vqav2", _dump(src, q), out, images=images, annotations=ann)
    assert report.log.entries == [] and report.log_file is None and not (out / "convert_log.txt").exists()
