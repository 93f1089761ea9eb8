"""The microscope (app.py, the arr_coc_microscope package): direct handler calls, gradio_client against a live
app, a small load test, and a memory check with its negative control.

Most tests use a tiny random Qwen2-VL saved to a temp folder (fast, answers are gibberish but
deterministic); the `embedded_server` tests run the default embedded checkpoint in a subprocess, as
`make run` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from _app_server import ROOT, check_full_answer as _check_full_answer, free_port, make_bad_inputs, predict as _predict, \
    save_tiny_model, scene

import app  # noqa: E402  (app.py at the repository root, the entry point; importing it loads nothing)
from arr_coc_microscope import handler, inputs, page, readout, server  # noqa: E402

ELEM_IDS = ("image", "question", "arr-toggle", "budget", "method", "encode", "layer", "compare-layer", "compare-encode",
            "gist", "margin", "periphery", "run", "answer-baseline", "answer-arr", "answer-compare", "stats", "heatmap",
            "resolution-a", "resolution-b", "channels", "error")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2vl"))


@pytest.fixture(scope="module")
def scope(tiny_dir):
    return server.load(str(tiny_dir), device="cpu", max_new_tokens=4)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    return make_bad_inputs(tmp_path_factory.mktemp("bad_inputs"))


@pytest.fixture(scope="module")
def good_image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("good") / "scene.png"
    scene(224, 168).save(path)
    return str(path)


def _find(config: dict, elem_id: str) -> dict:
    for c in config["components"]:
        if c.get("props", {}).get("elem_id") == elem_id:
            return c
    raise KeyError(elem_id)


# ----------------------------------------------------------------------------- start-up contract


def test_import_loads_nothing():
    code = "import sys, app; heavy = {'torch', 'gradio', 'transformers'} & set(sys.modules); print(sorted(heavy))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_parse_args_defaults_are_local_and_offline_only_for_local_models(tmp_path):
    """Defaults: the embedded model on loopback, no share link. Importing the app sets no environment;
    start-up turns analytics off, and the hub offline only for a local folder (the embedded model is
    one), never for a hub id, and never over a value the environment already has."""
    args = server.parse_args([])
    assert args.host == "127.0.0.1" and args.share is False and args.model is None
    assert server.parse_args(["--model", "x", "--device", "cpu", "--port", "7999", "--share"]).share is True
    code = (
        "import os, sys, app\n"
        "from arr_coc_microscope.server import set_environment\n"
        "seen = [os.environ.get('HF_HUB_OFFLINE'), os.environ.get('GRADIO_ANALYTICS_ENABLED')]\n"
        "set_environment('Qwen/Qwen2-VL-2B-Instruct')\n"
        "seen += [os.environ.get('HF_HUB_OFFLINE'), os.environ.get('GRADIO_ANALYTICS_ENABLED')]\n"
        "set_environment(sys.argv[1])\n"
        "seen.append(os.environ.get('HF_HUB_OFFLINE'))\n"
        "print(seen)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "GRADIO_ANALYTICS_ENABLED")}
    run = lambda env: subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=120)
    out = run(env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([None, None, None, "False", "1"])
    out = run(dict(env, HF_HUB_OFFLINE="0"))  # the user's own setting wins, even for a local folder
    assert out.stdout.strip() == str(["0", None, "0", "False", "0"]), out.stderr


def test_host_is_loopback_unless_on_a_space(monkeypatch):
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    assert server.parse_args([]).host == "127.0.0.1"
    monkeypatch.setenv("SPACE_ID", "someone/arr-coc")
    assert server.parse_args([]).host == "0.0.0.0"
    assert server.parse_args(["--host", "127.0.0.1"]).host == "127.0.0.1"


def test_a_missing_model_exits_with_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="pass --model"):
        app.main(["--model", str(tmp_path / "no_such_model")])


def test_a_hub_id_without_the_hub_says_so_and_what_to_do(monkeypatch):
    """The tests run offline (HF_HUB_OFFLINE=1): a hub id that is not cached fails at once, and says why."""
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(SystemExit) as info:
        app.main(["--model", "some-org/an-uncached-vl-model", "--device", "cpu"])   # a hub id, never fetched
    message = str(info.value)
    assert "HF_HUB_OFFLINE is set" in message and "unset HF_HUB_OFFLINE" in message
    assert "pass --model with a local folder" in message
    # Online but with no route to the hub: the chain transformers raises (LocalEntryNotFoundError <- a connect error)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    try:
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as cause:
            raise FileNotFoundError("An error happened while trying to locate the file on the Hub") from cause
    except FileNotFoundError as exc:
        error = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        error.__cause__ = exc
    message = server.load_failure("some-org/an-uncached-vl-model", error)
    assert "could not be reached" in message and "go online" in message and "local folder" in message
    # A reason the hub itself gave (a typo in the id, a non-Qwen model) is not blamed on the network.
    assert "could not be reached" not in server.load_failure("Qwen/nope", ValueError("'llama' model"))


def test_page_has_every_hook_and_the_ask_api(scope):
    demo = page.build_demo(scope)
    config = demo.get_config_file()
    for elem_id in ELEM_IDS:
        _find(config, elem_id)
    choices = [c[1] if isinstance(c, (list, tuple)) else c for c in _find(config, "method")["props"]["choices"]]
    assert set(choices) == set(scope.methods) and _find(config, "method")["props"]["value"] == "arr_coc"
    assert {"fastv", "visionzip", "divprune", "cdpruner", "grid", "random", "none"} <= set(choices)
    assert "arr_coc_adaptive" not in choices   # adaptive is the checkbox
    assert [d.get("api_name") for d in config["dependencies"]].count("ask") == 1
    # Gradio writes .pyi stubs next to modules that subclass components
    assert not (ROOT / "app.pyi").exists() and not list((ROOT / "arr_coc_microscope").glob("*.pyi"))


def test_method_list_follows_the_registry_at_start_up(tiny_dir):
    from arr_coc.pipeline.selection import SELECTORS, register_selector

    def keep_first(ctx):
        import torch
        return [torch.arange(1) for _ in ctx.grid_hw]

    register_selector("test_anchor", keep_first)
    try:
        scope = server.load(str(tiny_dir), device="cpu", max_new_tokens=2)
        assert scope.methods[0] == "arr_coc" and "test_anchor" in scope.methods
    finally:
        SELECTORS.pop("test_anchor", None)


def test_examples_cover_shapes_hard_cases_and_licensed_photos():
    examples = page.read_examples()
    names = [os.path.basename(e["image"]) for e in examples]
    for kind in ("low_contrast", "void", "border"):
        assert f"shapes_{kind}.png" in names
    photos = [n for n in names if n.startswith("photo_")]
    assert len(photos) >= 2
    licences = (ROOT / "assets" / "examples" / "LICENSES.md").read_text()
    assert all(p in licences for p in photos)
    assert all(e["question"].strip() for e in examples)


# ----------------------------------------------------------------------------- direct handler calls


def test_ask_gives_both_answers_stats_and_pictures(scope, good_image):
    r = handler.ask(scope, good_image, "What color is the circle?", True, 0.25, False, "arr_coc")
    assert r.error == ""
    assert isinstance(r.answer_baseline, str) and isinstance(r.answer_arr, str)
    rows = {row[0]: row[1:] for row in r.stats}
    total, kept = int(rows["visual tokens (total)"][0]), rows["visual tokens (kept)"][1]
    assert int(rows["visual tokens (kept)"][0]) == total
    assert int(kept.split()[0]) == round(0.25 * total)
    assert rows["kept / budget"] == ["-", "1.00x", "1.00x"]  # this layer keeps its budget exactly (A and B)
    assert rows["answer's cells (predicted)"] == ["-", "-", "-"]  # it has no extent head (the shipped before layer does)
    assert rows["LM prefill speedup"][1].endswith("x") and rows["whole prefill speedup"][1].endswith("x")
    h, w = r.record["arr_coc"]["grid_hw"][0]
    assert Image.open(r.heatmap).size == (w * scope.cell_px, h * scope.cell_px)
    captions = [c for _, c in r.maps]
    assert [c.split(" ")[0] for c in captions] == ["information", "perspectival", "participatory", "relevance"]
    assert "w=" in captions[0] and "participatory" in r.weights
    assert [name for _, name in r.channels] == list(scope.vlm.layer.channel_names)
    assert all(Image.open(p).format == "PNG" for p, _ in r.maps + r.channels)
    assert len({os.path.dirname(p) for p, _ in r.maps + r.channels} | {os.path.dirname(r.heatmap)}) == 1
    record = json.loads(Path(r.trace).read_text())
    assert record["question"] == "What color is the circle?"
    assert record["arr_coc"]["kept_tokens"] == int(kept.split()[0]) == len(record["arr_coc"]["kept_indices"][0])
    assert len(record["arr_coc"]["layer"]["maps"]["relevance"]) == h
    assert record["baseline"]["kept_tokens"] == record["baseline"]["total_tokens"] == total


def test_toggle_off_runs_the_baseline_only(scope, good_image):
    r = handler.ask(scope, good_image, "Is there a red circle?", False, 0.25, False, "arr_coc")
    assert r.error == "" and "ARR-COC is off" in r.answer_arr
    assert r.heatmap is None and r.maps == [] and r.channels == []
    assert r.record["arr_coc"] is None and r.record["compare"] is None and r.resolution_a is None
    assert {row[0]: row[1:] for row in r.stats}["visual tokens (kept)"][1:] == ["-", "-"]
    assert "ARR-COC is off" in r.answer_compare


def test_adaptive_budget_stays_in_its_bounds(scope, good_image):
    r = handler.ask(scope, good_image, "How many circles are there?", True, 0.9, True, "arr_coc")
    t = r.record["arr_coc"]
    assert t["budget"] == "adaptive" and t["method"] == "arr_coc"
    assert 0.05 * t["total_tokens"] - 1 <= t["kept_tokens"] <= 0.5 * t["total_tokens"] + 1


def test_every_listed_method_answers(scope, good_image):
    """Whatever the registry held at start-up (anchors from arr_coc.methods included) runs from the page."""
    for method in scope.methods:
        r = handler.ask(scope, good_image, "Is there a red circle?", True, 0.25, False, method)
        assert not r.error.startswith("**Error:**"), (method, r.error)
        assert r.record["arr_coc"]["method"] == method and r.heatmap is not None, method


@pytest.mark.parametrize("method", ["grid", "random"])
def test_anchor_methods_show_their_kept_tokens(scope, good_image, method):
    r = handler.ask(scope, good_image, "Is there a red circle?", True, 0.5, False, method)
    assert r.record["arr_coc"]["method"] == method and r.heatmap is not None
    assert r.maps == [] and "no relevance maps" in r.error


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_every_bad_input_gets_its_message(scope, bad_inputs):
    for bad in bad_inputs:
        r = handler.ask(scope, bad.image, bad.question, True, 0.25, False, "arr_coc")
        assert bad.message in r.error, (bad.name, r.error)
        if bad.refused:
            assert r.error.startswith("**Error:**") and r.answer_baseline == "" and r.heatmap is None, bad.name
        else:
            assert r.error.startswith("**Note:**") and r.heatmap is not None, bad.name
    huge = next(b for b in bad_inputs if b.name == "huge")
    used = handler.ask(scope, huge.image, huge.question).record["image"]["used_size"]
    assert used[0] * used[1] <= inputs.MAX_INPUT_PIXELS


@pytest.mark.parametrize("budget,method,message", [(0, "arr_coc", "as a token count must be >= 1"),
                                                   (0.0, "arr_coc", "as a share must lie in (0, 1]"),
                                                   ("lots", "arr_coc", "'lots' is not a budget"),
                                                   ("1", "arr_coc", "'1' is ambiguous"),
                                                   ("150%", "arr_coc", "as a share must lie in (0, 1]"),
                                                   (0.25, "nope", "unknown method 'nope'")])
def test_bad_controls_get_messages(scope, good_image, budget, method, message):
    error = handler.ask(scope, good_image, "Is there a circle?", True, budget, False, method).error
    assert message in error and error.startswith("**Error:**")


@pytest.mark.parametrize("budget", [0, 1.5, "abc", "1", "-3", "64 tokens please", True, ""])
def test_a_bad_budget_gets_the_budget_parsers_own_message(scope, good_image, budget):
    from arr_coc.budget import BudgetError, parse_budget

    with pytest.raises(BudgetError) as expected:
        parse_budget(budget)
    r = handler.ask(scope, good_image, "Is there a circle?", True, budget, False, "arr_coc")
    assert r.error == f"**Error:** {expected.value}" and r.answer_baseline == "" and r.record is None


@pytest.mark.parametrize("budget", ["10%", "0.1", 0.1, "20", "20tok", 20, "64", "100%", 1.0, None])
def test_a_budget_keeps_what_the_library_and_cli_keep(scope, good_image, budget):
    """Every way the command line writes a budget, read by the same parser, keeps the same count."""
    from arr_coc.budget import DEFAULT_BUDGET, parse_budget, resolve_count

    r = handler.ask(scope, good_image, "Is there a circle?", True, budget, False, "arr_coc")
    assert r.error == "", r.error
    t = r.record["arr_coc"]
    wanted = DEFAULT_BUDGET if budget is None else parse_budget(budget)
    assert t["kept_tokens"] == resolve_count(wanted, t["total_tokens"]) and r.record["request"]["budget"] == wanted


def test_a_failing_selector_falls_back_to_the_baseline_with_a_notice(scope, good_image, monkeypatch):
    from arr_coc.pipeline.selection import SELECTORS

    def broken(ctx):
        raise RuntimeError("scorer exploded")

    monkeypatch.setitem(SELECTORS, "broken", broken)
    r = handler.ask(scope, good_image, "Is there a circle?", True, 0.25, False, "broken")
    assert "fell back to the baseline path" in r.error and "scorer exploded" in r.error
    assert r.answer_arr == r.answer_baseline
    assert r.record["arr_coc"]["kept_tokens"] == r.record["arr_coc"]["total_tokens"]


def test_a_failing_layer_stage_falls_back_with_a_notice(scope, good_image, monkeypatch):
    layer = scope.vlm.layer

    def explode(*args, **kwargs):
        raise ValueError("information scorer broke")

    monkeypatch.setattr(layer.information, "forward", explode)
    r = handler.ask(scope, good_image, "Is there a circle?", True, 0.25, False, "arr_coc")
    assert "fell back" in r.error and "information scorer broke" in r.error
    assert r.answer_arr == r.answer_baseline and r.maps == []


def test_an_arr_coc_crash_still_answers_with_the_baseline(scope, good_image, monkeypatch):
    real = scope.vlm.respond

    def respond(images, questions, pruning=None, **kw):
        if pruning.method != "none":
            raise RuntimeError("pruning path crashed")
        return real(images, questions, pruning, **kw)

    monkeypatch.setattr(scope.vlm, "respond", respond)
    r = handler.ask(scope, good_image, "Is there a circle?", True, 0.25, False, "arr_coc")
    assert "ARR-COC failed (RuntimeError: pruning path crashed)" in r.error
    assert r.answer_arr == r.answer_baseline and r.record["arr_coc"]["fell_back_to"] == "baseline"


def test_concurrent_direct_calls_do_not_mix(scope):
    inputs = [(scene(28 * (4 + i), 28 * (3 + i), seed=i), f"Is there a circle number {i}?") for i in range(4)]
    expected = [handler.ask(scope, im, q) for im, q in inputs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda iq: handler.ask(scope, *iq), inputs * 2))
    for i, r in enumerate(got):
        e = expected[i % 4]
        assert (r.answer_baseline, r.answer_arr) == (e.answer_baseline, e.answer_arr)
        assert r.record["question"] == e.record["question"]
        assert r.record["baseline"]["total_tokens"] == e.record["baseline"]["total_tokens"]


# ----------------------------------------------------------------------------- gradio_client, live app


@pytest.fixture(scope="module")
def live(scope, tmp_path_factory):
    """The app on a free loopback port, served from a background thread of this process."""
    from gradio_client import Client

    demo = page.build_demo(scope)
    port = free_port()
    server.serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    client = Client(f"http://127.0.0.1:{port}", verbose=False, analytics_enabled=False,
                    download_files=str(tmp_path_factory.mktemp("client_downloads")))
    yield client
    client.close()
    demo.close()


def test_client_api_describes_ask(live):
    info = live.view_api(print_info=False, return_format="dict")
    params = [p["parameter_name"] for p in info["named_endpoints"]["/ask"]["parameters"]]
    assert params == ["image", "question", "arr_coc", "budget", "adaptive", "method", "encode", "layer",
                      "compare_layer", "compare_encode", "gist", "margin", "periphery", "video", "looks", "threshold"]
    assert len(info["named_endpoints"]["/ask"]["returns"]) == len(handler.OUTPUT_NAMES)


def test_client_asks_about_a_video(live, tmp_path):
    """Through the page's API, as the browser sends it: a clip in the video input is answered (the image is ignored),
    its table row lists the tokens per temporal group."""
    import numpy as np
    from gradio_client import handle_file
    from PIL import Image as PILImage

    frames = [PILImage.fromarray(np.full((112, 140, 3), 40 * k, np.uint8)) for k in range(6)]
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500)
    out = live.predict(image=None, question="What changes?", budget=0.25, video=handle_file(str(path)),
                       api_name="/ask")
    baseline, arr, stats, error = out[0], out[1], out[3], out[-1]
    assert "A video: 6 frames" in error and baseline and arr
    rows = {row[0]: row[1:] for row in stats["data"]}
    assert len(rows["tokens per temporal group"][0].split()) == 3


def test_a_clip_needs_no_image_and_a_video_never_uploaded_is_refused_in_words(live, tmp_path):
    """Issue 49: `video=handle_file(path)` alone is a whole request (every input is optional), and a video value the
    app never received (a server path, a URL) gets a message, as an image does, never a bare error event."""
    import numpy as np
    from gradio_client import handle_file
    from PIL import Image as PILImage

    frames = [PILImage.fromarray(np.full((112, 140, 3), 40 * k, np.uint8)) for k in range(4)]
    path = tmp_path / "clip.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500)
    out = live.predict(question="What changes?", video=handle_file(str(path)), api_name="/ask")
    assert out[0] and "A video: 4 frames" in out[-1], out[-1]
    from test_fuzz import raw_api

    for value in ({"path": "/etc/hostname", "meta": {"_type": "gradio.FileData"}}, "/etc/hostname",
                  {"path": "https://example.com/clip.mp4", "meta": {"_type": "gradio.FileData"}}):
        data = [None, "What changes?"] + [None] * 11 + [value]
        error = raw_api(live.src, data)[-1]
        assert error.startswith("**Error:** The ") and ("not uploaded" in error or "URLs" in error), (value, error)
        assert "/etc/hostname" not in error


def test_client_keyword_call_as_documented(live):
    """The docs/APP.md example, keyword for keyword."""
    from gradio_client import handle_file

    example = next(e for e in page.read_examples() if e["image"].endswith("shapes_letter.png"))
    (baseline, arr, compare, stats, heatmap, resolution_a, resolution_b, maps, weights, channels, trace,
     error) = live.predict(
        image=handle_file(example["image"]), question=example["question"],
        arr_coc=True, budget=0.25, adaptive=False, method="arr_coc",
        encode="after", compare_encode="before", gist=0.0, margin=0, periphery=False, api_name="/ask")
    assert error == "" and isinstance(baseline, str) and isinstance(arr, str) and isinstance(compare, str)
    rows = {row[0]: row[1:] for row in stats["data"]}
    assert rows["visual tokens (kept)"] == ["256", "64 (25%)", "64 (25%)"]
    assert rows["cells encoded at full resolution"][1:] == ["256 (100%)", rows["cells encoded at full resolution"][2]]
    assert int(rows["cells encoded at full resolution"][2].split()[0]) < 256        # B encoded before: less
    assert Image.open(resolution_a).format == Image.open(resolution_b).format == "PNG"
    assert json.loads(Path(trace).read_text())["arr_coc"]["kept_indices"][0] == sorted(
        json.loads(Path(trace).read_text())["arr_coc"]["kept_indices"][0])


def test_client_round_trip(live, good_image):
    out = _predict(live, good_image, "What color is the circle?")
    _check_full_answer(out, "What color is the circle?")


def test_client_budget_as_the_command_line_writes_it(live, good_image):
    """Through the API a budget is anything the command line takes, with the same count, by the same rule:
    a whole number is read as the command line reads it, so 1 (JSON's 1.0 too) is as ambiguous as "1" and
    "1.0" keeps every token (the page's slider sends its maximum so); a bad budget gets the budget parser's
    own message in the error output (not a Gradio exception), and the app keeps serving."""
    from arr_coc.budget import BudgetError, parse_budget, resolve_count

    for budget in ("10%", "20tok", "1.0", 20):
        out = _predict(live, good_image, "Is there a circle?", budget=budget)
        assert out["error"] == "", (budget, out["error"])
        rows = {r[0]: r[1:] for r in out["stats"]["data"]}
        total, kept = int(rows["visual tokens (total)"][1]), int(rows["visual tokens (kept)"][1].split()[0])
        assert kept == resolve_count(parse_budget(budget), total), budget
    for budget in ("abc", "1", 0, 1, "1_0"):
        with pytest.raises(BudgetError) as expected:
            parse_budget(str(budget))                       # the command line's words for the same text
        out = _predict(live, good_image, "Is there a circle?", budget=budget)
        assert out["error"] == f"**Error:** {expected.value}" and out["answer_baseline"] == "", budget


def test_client_a_question_that_is_not_text_is_refused(live, good_image):
    """A list or a dict sent as the question was once turned into its repr and answered."""
    for question in (["What color is the circle?"], {"text": "What color is the circle?"}, 5):
        out = _predict(live, good_image, question)
        assert out["error"].startswith("**Error:** The question must be text, not a "), (question, out["error"])
        assert out["answer_baseline"] == "", question
    assert _predict(live, good_image, "What color is the circle?")["answer_baseline"]      # and it keeps serving


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_client_every_bad_input_then_a_good_request(live, bad_inputs, good_image):
    for bad in bad_inputs:
        out = _predict(live, bad.image, bad.question)
        assert bad.message in out["error"], (bad.name, out["error"])
        if bad.refused:
            assert out["answer_baseline"] == "" and out["heatmap"] is None, bad.name
        else:
            assert out["heatmap"] is not None, bad.name
        ok = _predict(live, good_image, "Is there a circle?")
        assert ok["error"] == "", (bad.name, ok["error"])
        _check_full_answer(ok, "Is there a circle?")


# ----------------------------------------------------------------------------- the embedded model (as `make run`)


def test_kept_per_budget_shows_how_the_layer_scaled_the_budget():
    from types import SimpleNamespace

    import torch

    assert readout.kept_per_budget(SimpleNamespace(budget=0.25, total_tokens=256, kept_tokens=40)) == "0.62x"
    assert readout.kept_per_budget(SimpleNamespace(budget=13, total_tokens=256, kept_tokens=26)) == "2.00x"
    assert readout.kept_per_budget(SimpleNamespace(budget="adaptive", total_tokens=256, kept_tokens=40)) == "-"
    # with a periphery the LM reads more tokens than were chosen: the budget compares with the chosen cells
    assert readout.kept_per_budget(SimpleNamespace(budget=0.25, total_tokens=256, kept_tokens=98,
                                                   kept_indices=[torch.arange(64)])) == "1.00x"


def test_a_video_clip_is_answered_side_by_side(scope, tmp_path):
    """An uploaded clip replaces the image: the baseline and config A answer it, the table gives the tokens per
    temporal group, the strip shows every group, and a damaged clip is refused with its message (nothing else
    runs)."""
    import numpy as np
    from PIL import Image as PILImage

    frames = np.full((8, 112, 140, 3), 210, np.uint8)
    for k in range(8):
        frames[k, 40:70, 10 + 12 * k: 40 + 12 * k] = (200, 30, 30)
    path = tmp_path / "clip.gif"
    pictures = [PILImage.fromarray(f) for f in frames]
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=500)
    result = handler.ask(scope, None, "What moves?", True, 0.25, video=str(path))   # the image handler: a clip
    assert not result.error.startswith("**Error"), result.error
    assert result.answer_baseline and result.answer_arr
    rows = {row[0]: row for row in result.stats}
    groups = rows["tokens per temporal group"]
    assert len(groups[1].split()) == 4 and len(groups[2].split()) == 4        # baseline and A: four groups each
    kept, total = int(rows["visual tokens (kept)"][2].split()[0]), int(rows["visual tokens (total)"][2])
    assert kept == round(0.25 * total) and sum(int(x) for x in groups[2].split()) == kept
    strip = PILImage.open(result.heatmap)
    assert strip.size[0] > 3 * strip.size[1]                                    # the groups side by side
    assert result.record["arr_coc"]["kept_per_group"] == [[int(x) for x in groups[2].split()]]
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    refused = handler.ask(scope, None, "What moves?", True, 0.25, video=str(broken))
    assert refused.error.startswith("**Error:**") and not refused.answer_baseline
    refused = handler.ask(scope, None, "What moves?", True, 0.25, method="fastv", video=str(path))
    assert "cannot prune a video" in refused.error
