"""The microscope's looks (encode before with saccades, issue 38): the looks control reaches the wrapper, the
table says per look what it added and encoded, the uncertainty against the threshold and why it looked again
or stopped, the trace holds the same, and the FLOPs count every look's tower pass and LM prefill.

A tiny random Qwen2-VL saved to a temp folder (answers are gibberish but deterministic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _app_server import save_tiny_model, scene

from arr_coc.pipeline.trace import Look, Trace  # noqa: E402
from arr_coc_microscope import configs, handler, readout, server  # noqa: E402

Q = "What color is the circle?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_looks"))


@pytest.fixture(scope="module")
def scope(tiny_dir):
    return server.load(str(tiny_dir), device="cpu", max_new_tokens=2)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("looks_image") / "scene.png"
    scene(224, 168).save(path)
    return str(path)


def _rows(result) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in result.stats}


def _ask(scope, image, **controls):
    torch.manual_seed(0)
    return handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="before", compare_layer="off", **controls)


def test_one_look_is_the_before_mode_as_it_was(scope, image):
    default, one = _ask(scope, image), _ask(scope, image, looks=1, threshold=-1)
    for r in (default, one):
        assert r.error == "", r.error
        assert r.record["arr_coc"]["looks"] == [] and r.record["arr_coc"]["config"]["encode"] == {
            "mode": "before", "gist": 0.0, "margin": 0, "periphery": False}
        assert not any(row[0].startswith("look ") for row in r.stats)     # no looks table
        assert [row[0] for row in r.stats] == readout.ROW_NAMES
        assert _rows(r)["encode"][1] == "before"
    assert one.record["arr_coc"]["kept_indices"] == default.record["arr_coc"]["kept_indices"]
    assert one.record["arr_coc"]["flops"] == default.record["arr_coc"]["flops"]
    assert one.answer_arr == default.answer_arr


def test_two_looks_show_the_table_and_cost_more(scope, image):
    one, two = _ask(scope, image), _ask(scope, image, looks=2, threshold=-1)    # -1: always look again
    assert two.error == "", two.error
    t = two.record["arr_coc"]
    assert t["config"]["encode"] == {"mode": "before", "gist": 0.0, "margin": 0, "periphery": False, "looks": 2,
                                     "threshold": -1.0}
    assert _rows(two)["encode"][1] == "before (2 looks, threshold -1)"
    looks = [row for row in two.stats if row[0].startswith("look ")]
    assert [row[0] for row in looks] == ["look 1", "look 2"] and all(row[1] == row[3] == "-" for row in looks)
    assert looks[0][2].endswith(": looked again") and "> threshold -1" in looks[0][2]
    assert looks[1][2].endswith(": stopped: no looks left")
    # the trace: both looks in order; look 2 added cells never encoded on look 1, and read them
    first, second = t["looks"]
    assert (first["look"], second["look"]) == (1, 2) and first["saccade"] and not second["saccade"]
    assert first["decision"] == "looked again" and second["decision"] == "stopped: no looks left"
    assert first["threshold"] == -1.0 and first["go"] and second["go"]
    assert first["added_per_image"] == one.record["arr_coc"]["kept_per_image"]
    assert second["added_per_image"][0] > 0 and second["encoded_per_image"][0] > 0
    assert t["encoded_per_image"][0] == first["encoded_per_image"][0] + second["encoded_per_image"][0]
    assert second["prompt_tokens"] == t["prompt_tokens"] > first["prompt_tokens"]
    assert len(t["kept_indices"][0]) == first["added_per_image"][0] + second["added_per_image"][0]
    # the FLOPs: both looks' tower passes and both prefills
    a, b, base = one.record["arr_coc"]["flops"], t["flops"], two.record["baseline"]["flops"]
    assert b["vision"] > a["vision"] and b["lm_prefill"] > a["lm_prefill"] and b["whole_prefill"] > a["whole_prefill"]
    from conftest import text_prefill_flops

    assert b["lm_prefill"] == sum(text_prefill_flops(scope.vlm, look["prompt_tokens"]) for look in t["looks"])
    assert float(_rows(two)["whole prefill GFLOPs"][1]) > float(_rows(one)["whole prefill GFLOPs"][1])
    share = f"{100 * b['whole_prefill'] / base['whole_prefill']:.0f}%"
    assert _rows(two)["whole prefill FLOPs vs. baseline"][1] == share


def test_a_confident_answer_stops_after_one_look(scope, image):
    r = _ask(scope, image, looks=3, threshold=1.5)                               # above 1: never look again
    t = r.record["arr_coc"]
    assert r.error == "" and len(t["looks"]) == 1 and t["looks"][0]["decision"] == "stopped: confident"
    assert [row[0] for row in r.stats if row[0].startswith("look ")] == ["look 1"]
    assert "<= threshold 1.5" in _rows(r)["look 1"][1] and _rows(r)["look 1"][1].endswith(": stopped: confident")


def test_a_method_without_a_relevance_map_takes_one_look_with_a_note(scope, image):
    r = handler.ask(scope, image, Q, True, 0.25, False, "random", encode="before", compare_layer="off", looks=2,
                    threshold=-1)
    assert "has no relevance map to aim a saccade by: config A ran with one look" in r.error
    assert not r.error.startswith("**Error:**") and r.record["arr_coc"]["looks"] == []
    assert r.record["arr_coc"]["encode"] == "before" and r.record["arr_coc"]["method"] == "random"


@pytest.mark.parametrize("controls,message", [
    ({"looks": 0}, "looks must be a whole number from 1 to 3, not '0'."),
    ({"looks": 4}, "looks must be a whole number from 1 to 3, not '4'."),
    ({"looks": "x"}, "looks must be a whole number from 1 to 3, not 'x'."),
    ({"looks": 1.5}, "looks must be a whole number from 1 to 3, not '1.5'."),
    ({"looks": 2, "threshold": 3}, "threshold must be a number from -1 to 2, not '3'."),
    ({"looks": 2, "threshold": "high"}, "threshold must be a number from -1 to 2, not 'high'."),
])
def test_bad_looks_get_messages(scope, image, controls, message):
    r = handler.ask(scope, image, Q, **controls)
    assert r.error == f"**Error:** {message}" and r.answer_baseline == ""


def test_looks_mean_nothing_after_and_the_readout_of_a_hand_made_trace():
    # after: the plain EncodeConfig, whatever the looks say (like the gist or the margin)
    assert configs.read_encode("after", 0.0, 0, False, 3, -1.0).passes == 1
    e = configs.read_encode("before", 0.25, 1, True, 3, 0.5)
    assert (e.passes, e.saccade.threshold) == (3, 0.5)
    assert configs.encode_text(e) == "before (gist 0.25, margin 1, periphery, 3 looks, threshold 0.5)"
    assert configs.read_encode("before", 0.0, 0, False, 1, -1.0) == configs.read_encode("before", 0.0, 0, False)

    def look(added, encoded, prompt, u, go, saccade):
        return Look(cells=[torch.arange(added)], encoded=[torch.arange(encoded)], prompt_tokens=prompt,
                    uncertainty=u, strength=0.9 if go else 0.1, go=go, saccade=saccade)

    t = Trace(method="arr_coc", budget=0.25, kept_tokens=6, total_tokens=24,
              looks=[look(4, 6, 40, 0.61, True, True), look(2, 1, 42, 0.1, False, False)])
    table = readout.looks_table(t, 0.2734)
    assert [row[:-1] for row in table] == [
        ["1", "4", "6", "40", "0.610", "0.2734", "0.900", "looked again"],
        ["2", "2", "1", "42", "0.100", "0.2734", "0.100", "stopped: confident"]]
    assert readout.look_text(table[0]) == ("+4 cells read, 6 encoded; 40 prompt tokens; uncertainty 0.610 > threshold "
                                           "0.2734 (strength 0.900): looked again")
    record = readout.looks_record(t, 0.2734)
    assert record[1]["decision"] == "stopped: confident" and record[0]["added_per_image"] == [4]


def test_the_page_sends_the_looks_to_the_wrapper(scope, image, tmp_path):
    """The page's controls (defaults: one look, the design's threshold) and its `ask` API, keyword by keyword."""
    import json

    from gradio_client import Client, handle_file

    from _app_server import free_port
    from arr_coc.saccade import THRESHOLD_INIT
    from arr_coc_microscope import page

    demo = page.build_demo(scope, examples=[])
    props = {c["props"].get("elem_id"): c["props"] for c in demo.get_config_file()["components"]
             if c.get("props", {}).get("elem_id")}
    assert (props["looks"]["value"], props["looks"]["minimum"], props["looks"]["maximum"]) == (1, 1, 3)
    assert props["threshold"]["value"] == THRESHOLD_INIT
    port = free_port()
    server.serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}", verbose=False, analytics_enabled=False,
                        download_files=str(tmp_path))
        out = dict(zip(handler.OUTPUT_NAMES, client.predict(
            handle_file(image), Q, encode="before", compare_layer="off", looks=2, threshold=-1, api_name="/ask")))
        bad = dict(zip(handler.OUTPUT_NAMES, client.predict(handle_file(image), Q, looks="x", api_name="/ask")))
        client.close()
    finally:
        demo.close()
    assert out["error"] == "", out["error"]
    rows = {r[0]: r[1:] for r in out["stats"]["data"]}
    assert rows["look 1"][1].endswith(": looked again") and rows["look 2"][1].endswith(": stopped: no looks left")
    record = json.loads(Path(out["trace"]).read_text())["arr_coc"]
    assert record["config"]["encode"]["looks"] == 2 and [look["look"] for look in record["looks"]] == [1, 2]
    assert bad["error"] == "**Error:** looks must be a whole number from 1 to 3, not 'x'."


def test_a_clip_is_answered_with_one_look_and_says_so(scope, tmp_path):
    from PIL import Image as PILImage

    pictures = [PILImage.new("RGB", (140, 112), (40 * k, 210, 210)) for k in range(4)]
    path = tmp_path / "clip.gif"
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=500)
    r = handler.ask(scope, None, "What changes?", True, 0.25, False, "arr_coc", encode="before",
                    compare_layer="off", looks=2, threshold=-1, video=str(path))
    assert not r.error.startswith("**Error"), r.error
    assert "answered with one look" in r.error and r.record["arr_coc"]["looks"] == []
    bad = handler.ask(scope, None, "What changes?", True, 0.25, False, "arr_coc", encode="before", looks=9,
                      video=str(path))
    assert bad.error == "**Error:** looks must be a whole number from 1 to 3, not '9'."
