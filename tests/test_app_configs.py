"""The microscope's two encoding modes and its side-by-side configurations: config A's encode toggle changes
what the vision tower encodes, the resolution picture colours the right cells, config B runs the layer it
was given, the trace says which cells were encoded at which resolution and why an image fell back, and
the FLOPs the page shows are counted as the evaluation counts them.

A tiny random Qwen2-VL saved to a temp folder (answers are gibberish but deterministic); two saved
ARR-COC layers that choose differently stand for two checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from _app_server import free_port, save_tiny_model, scene

from arr_coc import viz  # noqa: E402
from arr_coc.pipeline.trace import FOVEAL, GIST_ONLY, GRID_REASON, NOT_ENCODED, PERIPHERY, UNREAD, Trace  # noqa: E402
from arr_coc_microscope import configs, handler, page, server  # noqa: E402

Q = "What color is the circle?"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_configs"))


@pytest.fixture(scope="module")
def layer_dirs(tiny_dir, tmp_path_factory) -> tuple[str, str]:
    """Two ARR-COC layers for the tiny model that keep different cells (other balancer weights, other seed)."""
    from arr_coc import ARRCOCConfig, ARRCOCLayer
    from arr_coc.qwen.tiny import build_tiny_qwen

    model, _ = build_tiny_qwen("qwen2_vl", seed=0)
    dim = int(model.get_input_embeddings().weight.shape[-1])
    folder = tmp_path_factory.mktemp("layers")
    torch.manual_seed(0)
    ARRCOCLayer(ARRCOCConfig().with_query_dim(dim)).save_pretrained(folder / "x")
    torch.manual_seed(1)
    ARRCOCLayer(ARRCOCConfig().with_query_dim(dim).replace(balancing={"init_weights": (0.9, 0.05, 0.05)})
                ).save_pretrained(folder / "y")
    return str(folder / "x"), str(folder / "y")


@pytest.fixture(scope="module")
def scope(tiny_dir):
    return server.load(str(tiny_dir), device="cpu", max_new_tokens=4)


@pytest.fixture(scope="module")
def two_layers(tiny_dir, layer_dirs):
    """The app as `python app.py --model TINY --arr-coc X --compare-arr-coc Y` builds it."""
    s = server.load(str(tiny_dir), device="cpu", arr_coc=layer_dirs[0], max_new_tokens=4)
    configs.add_layers(s, [layer_dirs[1]])
    return s


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("configs_image") / "scene.png"
    scene(224, 168).save(path)
    return str(path)


def _rows(result) -> dict[str, list[str]]:
    return {row[0]: row[1:] for row in result.stats}


# ----------------------------------------------------------------------------- the encode toggle


def test_encode_before_encodes_only_the_chosen_cells_and_still_answers(scope, image):
    after = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="after", compare_layer="off")
    before = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="before", compare_layer="off")
    for r in (after, before):
        assert r.error == "", r.error
        assert isinstance(r.answer_arr, str) and r.record["arr_coc"]["new_tokens"] > 0   # an answer was produced
    a, b = after.record["arr_coc"], before.record["arr_coc"]
    total = a["total_tokens"]
    assert (a["encode"], b["encode"]) == ("after", "before")
    assert a["encoded_per_image"] == [total]                              # negative control: after encodes all
    assert b["encoded_per_image"] == [b["kept_tokens"]] and b["kept_tokens"] < total
    assert _rows(before)["cells encoded at full resolution"][1] == f"{b['kept_tokens']} (25%)"
    assert _rows(after)["cells encoded at full resolution"][1] == f"{total} (100%)"
    assert before.answer_compare == handler.NO_COMPARE and before.resolution_b is None


def test_the_page_toggle_reaches_the_wrapper(scope, image, tmp_path):
    """Through the page's own `ask` API: the encode radio and the before-mode settings become the run's EncodeConfig."""
    from gradio_client import Client, handle_file

    demo = page.build_demo(scope, examples=[])
    port = free_port()
    server.serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}", verbose=False, analytics_enabled=False,
                        download_files=str(tmp_path))
        out = dict(zip(handler.OUTPUT_NAMES, client.predict(
            handle_file(image), Q, encode="before", gist=0.25, margin=1, periphery=True, compare_layer="off",
            api_name="/ask")))
        client.close()
    finally:
        demo.close()
    assert out["error"] == "", out["error"]
    record = json.loads(Path(out["trace"]).read_text())["arr_coc"]
    assert record["config"]["encode"] == {"mode": "before", "gist": 0.25, "margin": 1, "periphery": True}
    assert record["gist_grid"] and record["periphery_per_image"][0] > 0 and record["margin_per_image"][0] > 0
    assert 0 < record["gist_s"] <= record["vision_s"]
    rows = {r[0]: r[1:] for r in out["stats"]["data"]}
    assert rows["encode"][1] == "before (gist 0.25, margin 1, periphery)" and rows["gist (ms)"][1] != "-"


def test_the_trace_says_which_cells_were_encoded_at_which_resolution(scope, image):
    from arr_coc.qwen.encoding import dilate

    r = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="before", margin=1, compare_layer="off")
    t = r.record["arr_coc"]
    h, w = t["grid_hw"][0]
    chosen = torch.tensor(t["cells"]["chosen"][0])
    margin = sorted(set(dilate(chosen, (h, w), 1).tolist()) - set(chosen.tolist()))
    assert t["cells"]["encoded_not_read"][0] == margin and len(margin) == t["margin_per_image"][0] > 0
    codes = torch.tensor(t["cells"]["resolution"][0]).reshape(-1)
    assert set(codes[chosen].tolist()) == {FOVEAL} and set(codes[margin].tolist()) == {UNREAD}
    assert (codes == NOT_ENCODED).sum() == h * w - len(margin) - len(chosen)
    assert t["cells"]["legend"][FOVEAL] == "full resolution, read"
    assert r.record["baseline"]["cells"]["encoded_not_read"] == [[]]      # the baseline reads all it encodes


def test_a_method_that_needs_the_encoded_tokens_runs_after_with_a_note(scope, image):
    r = handler.ask(scope, image, Q, True, 0.25, False, "fastv", encode="before", compare_layer="off")
    assert "cannot choose before the vision tower" in r.error and not r.error.startswith("**Error:**")
    assert r.record["arr_coc"]["encode"] == "after" and r.record["arr_coc"]["method"] == "fastv"


@pytest.mark.parametrize("controls,message", [
    ({"encode": "sideways"}, "encode 'sideways' is not one of: after, before."),
    ({"layer": "nope"}, "layer 'nope' is not one of: untrained."),
    ({"compare_layer": "nope"}, "compare_layer 'nope' is not one of: off, untrained."),
    ({"encode": "before", "margin": 9}, "margin must be a whole number from 0 to 4, not '9'."),
    ({"encode": "before", "margin": 1.5}, "margin must be a whole number from 0 to 4, not '1.5'."),
    ({"encode": "before", "gist": 1.0}, "gist must be a number from 0 to 0.95, not '1.0'."),
    ({"encode": "before", "gist": "lots"}, "gist must be a number from 0 to 0.95, not 'lots'."),
    ({"encode": "before", "periphery": True, "compare_layer": "off"}, "periphery=True shows the language model the "
                                                                       "gist: it needs gist > 0."),
])
def test_bad_encode_and_layer_controls_get_messages(scope, image, controls, message):
    r = handler.ask(scope, image, Q, **controls)
    assert r.error == f"**Error:** {message}" and r.answer_baseline == ""


def test_before_mode_settings_are_not_checked_when_nothing_encodes_before(scope, image):
    r = handler.ask(scope, image, Q, encode="after", compare_layer="off", periphery=True)
    assert r.error == "" and r.record["arr_coc"]["config"]["encode"]["mode"] == "after"


# ----------------------------------------------------------------------------- the resolution picture


def test_resolution_levels_and_picture_colour_the_right_cells():
    """A hand-made trace on a 4 x 6 grid with a 2 x 3 gist: one chosen cell, its margin, one periphery token."""
    from arr_coc.qwen.encoding import dilate

    chosen = torch.tensor([7])                                   # row 1, col 1
    encoded = dilate(chosen, (4, 6), 1)                          # rows 0-2, cols 0-2
    t = Trace(method="arr_coc", budget=1, kept_tokens=2, total_tokens=24, kept_indices=[chosen], grid_hw=[(4, 6)],
              encode="before", encoded_cells=[encoded], periphery_cells=[torch.tensor([23])],  # gist cell (1, 2)
              gist_grid=[(2, 3)])
    codes = t.resolution(0).reshape(4, 6)
    assert codes[1, 1] == FOVEAL and codes[0, 0] == codes[2, 2] == UNREAD
    assert codes[3, 5] == codes[2, 4] == PERIPHERY          # the footprint of gist cell (1, 2): rows 2-3, cols 4-5
    assert codes[3, 0] == codes[0, 5] == GIST_ONLY
    no_gist = Trace(method="arr_coc", budget=1, kept_tokens=1, total_tokens=24, kept_indices=[chosen],
                    grid_hw=[(4, 6)], encode="before", encoded_cells=[chosen])
    assert no_gist.resolution(0).reshape(4, 6)[3, 5] == NOT_ENCODED

    cell, grey = 28, (100, 110, 120)
    picture = viz.resolution_picture(Image.new("RGB", (6 * cell, 4 * cell), grey), t.resolution(0), (4, 6),
                                     tokens=t.periphery_cells[0])
    assert picture.size[0] == 6 * cell and picture.size[1] > 4 * cell          # the legend strip below

    def expected(level: int) -> tuple[int, ...]:
        a = viz.RESOLUTION_ALPHA
        return tuple(round((1 - a) * g + a * c) for g, c in zip(grey, viz.RESOLUTION_COLOURS[level]))

    def at(r: int, c: int) -> tuple[int, ...]:
        return picture.getpixel((c * cell + 5, r * cell + 5))    # off the centre, where a token's dot would be

    for (r, c), level in {(1, 1): FOVEAL, (0, 0): UNREAD, (3, 5): PERIPHERY, (3, 0): GIST_ONLY}.items():
        assert at(r, c) == expected(level), (r, c)
    assert len({expected(level) for level in range(5)}) == 5                    # five distinct legend colours
    assert at(1, 1) != expected(UNREAD)                                          # a wrong level would fail
    assert picture.getpixel((int(5.5 * cell), int(3.5 * cell))) == (255, 255, 255)   # the token's dot at cell 23


def test_the_pages_resolution_picture_matches_the_trace(scope, image):
    r = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="before", margin=1, compare_layer="off")
    t = r.record["arr_coc"]
    h, w = t["grid_hw"][0]
    px = scope.cell_px
    shown = Image.open(image).convert("RGB").resize((w * px, h * px))
    picture = Image.open(r.resolution_a).convert("RGB")
    codes = t["cells"]["resolution"][0]
    fovea = t["cells"]["chosen"][0][0]
    never = next(i for i in range(h * w) if codes[i // w][i % w] == NOT_ENCODED)
    for cell, level in ((fovea, FOVEAL), (t["cells"]["encoded_not_read"][0][0], UNREAD), (never, NOT_ENCODED)):
        x, y = (cell % w) * px + px // 2, (cell // w) * px + px // 2
        a, colour = viz.RESOLUTION_ALPHA, viz.RESOLUTION_COLOURS[level]
        want = tuple(round((1 - a) * p + a * c) for p, c in zip(shown.getpixel((x, y)), colour))
        assert picture.getpixel((x, y)) == want, (cell, level)


# ----------------------------------------------------------------------------- two layers side by side


def test_two_layers_side_by_side_with_the_baseline(two_layers, layer_dirs, image):
    from arr_coc import ARRCOCQwen

    names = list(two_layers.layers)
    assert names == [configs.layer_label(d) for d in layer_dirs]
    assert two_layers.default_compare == (names[1], "after")            # B compares checkpoints by default
    r = handler.ask(two_layers, image, Q, True, 0.25, False, "arr_coc")
    assert r.error == "", r.error
    assert all(isinstance(x, str) and x for x in (r.answer_baseline, r.answer_arr, r.answer_compare))
    assert all(len(row) == 4 for row in r.stats)                        # name, baseline, A, B
    rows = _rows(r)
    assert rows["ARR-COC layer"] == ["-", names[0], names[1]]
    a, b = r.record["arr_coc"], r.record["compare"]
    assert (a["config"]["layer"], b["config"]["layer"]) == (names[0], names[1])
    # B ran layer y: the same cells as that layer alone on the same VLM, not layer x's
    alone = ARRCOCQwen(two_layers.vlm.backend.model, two_layers.vlm.backend.processor, arr_coc=layer_dirs[1])
    _, trace = alone.generate(Image.open(image).convert("RGB"), Q, budget=0.25, max_new_tokens=1)
    assert b["kept_indices"][0] == trace.kept_indices[0].tolist()
    assert a["kept_indices"][0] != b["kept_indices"][0]
    # the other way round, and one layer in both columns (after vs. before): the choice is the request's
    swapped = handler.ask(two_layers, image, Q, True, 0.25, False, "arr_coc", layer=names[1], compare_layer=names[0])
    assert swapped.record["arr_coc"]["kept_indices"] == b["kept_indices"]
    same = handler.ask(two_layers, image, Q, True, 0.25, False, "arr_coc", compare_layer=names[0],
                       compare_encode="before")
    assert same.record["compare"]["encoded_per_image"][0] < same.record["arr_coc"]["encoded_per_image"][0]


def test_the_page_offers_the_layers_the_server_was_given(two_layers):
    config = page.build_demo(two_layers, examples=[]).get_config_file()
    props = {c["props"].get("elem_id"): c["props"] for c in config["components"] if c.get("props", {}).get("elem_id")}
    choices = lambda p: [c[1] if isinstance(c, (list, tuple)) else c for c in p["choices"]]  # noqa: E731
    names = list(two_layers.layers)
    assert choices(props["layer"]) == names and props["layer"]["value"] == names[0]
    assert choices(props["compare-layer"]) == [configs.OFF, *names] and props["compare-layer"]["value"] == names[1]


def test_compare_layer_options_and_their_errors(tiny_dir, layer_dirs, tmp_path):
    args = server.parse_args(["--compare-arr-coc", layer_dirs[0], "--compare-arr-coc", "untrained", "--no-flops"])
    assert args.compare_arr_coc == [layer_dirs[0], "untrained"] and args.flops is False
    assert server.parse_args([]).compare_arr_coc == [] and server.parse_args([]).flops is True
    s = server.load(str(tiny_dir), device="cpu", max_new_tokens=2)
    with pytest.raises(ValueError, match="no such folder"):
        configs.add_layers(s, [str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="it has no config.json"):   # refused before a wrapper is built
        configs.add_layers(s, [str(tmp_path / "empty")])
    (tmp_path / "empty" / "config.json").write_text("{}")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="could not build the layer"):
        configs.add_layers(s, [str(tmp_path / "empty")])
    configs.add_layers(s, ["untrained", layer_dirs[0]])    # "untrained" is the --arr-coc layer here: not twice
    assert list(s.layers) == ["untrained", configs.layer_label(layer_dirs[0])]


# ----------------------------------------------------------------------------- why a fallback happened, in both modes


@pytest.mark.parametrize("encode", ["after", "before"])
def test_a_failing_selector_says_why_in_either_mode(scope, image, monkeypatch, encode):
    from arr_coc.pipeline.selection import SELECTORS, choose_before_encoding

    def broken(ctx):
        raise RuntimeError("scorer exploded")

    monkeypatch.setitem(SELECTORS, "broken", choose_before_encoding(broken))
    r = handler.ask(scope, image, Q, True, 0.25, False, "broken", encode=encode, compare_layer="off")
    t = r.record["arr_coc"]
    assert t["encode"] == encode and t["fallback"] == ["keep_all"]
    assert t["fallback_reason"] == ["RuntimeError: scorer exploded"] and "scorer exploded" in r.error
    assert r.answer_arr == r.answer_baseline


def test_a_failing_gist_says_why(scope, image, monkeypatch):
    from arr_coc.pipeline import fovea

    def no_gist(*args, **kwargs):
        raise RuntimeError("gist tower broke")

    monkeypatch.setattr(fovea, "encode_gist", no_gist)
    r = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", encode="before", gist=0.25, compare_layer="off")
    t = r.record["arr_coc"]
    assert t["fallback"] == ["keep_all"] and t["fallback_reason"] == ["gist failed: RuntimeError: gist tower broke"]
    assert t["encoded_per_image"] == [t["total_tokens"]] and "gist tower broke" in r.error


@pytest.mark.parametrize("encode", ["after", "before"])
def test_a_low_structure_image_says_why(scope, tmp_path, encode):
    flat = tmp_path / "flat.png"
    Image.new("RGB", (224, 168), (120, 120, 120)).save(flat)
    r = handler.ask(scope, str(flat), Q, True, 0.25, False, "arr_coc", encode=encode, compare_layer="off")
    assert r.record["arr_coc"]["fallback"] == ["grid"] and r.record["arr_coc"]["fallback_reason"] == [GRID_REASON]
    assert r.record["baseline"]["fallback_reason"] == [None]


# ----------------------------------------------------------------------------- time and FLOPs


def test_the_readout_states_vision_and_the_whole_prefill(scope, image):
    r = handler.ask(scope, image, Q, True, 0.25, False, "arr_coc", compare_encode="before", gist=0.25)
    rows = _rows(r)
    for col, t in ((0, r.record["baseline"]), (1, r.record["arr_coc"]), (2, r.record["compare"])):
        whole = 1000 * (t["vision_s"] + t["arr_coc_s"] + t["prefill_s"])   # ARR-COC's own work: selection + packing
        assert float(rows["whole prefill (ms)"][col]) == pytest.approx(whole, abs=0.051)
        assert float(rows["ARR-COC's own work (ms)"][col]) == pytest.approx(1000 * t["arr_coc_s"], abs=0.051)
        assert t["arr_coc_s"] >= t["select_s"]
        assert float(rows["vision tower, gist incl. (ms)"][col]) == pytest.approx(1000 * t["vision_s"], abs=0.051)
    assert rows["gist (ms)"][:2] == ["-", "-"] and float(rows["gist (ms)"][2]) > 0
    # FLOPs: before (B) costs less than after (A) in the tower and in the whole prefill
    a, b, base = (r.record[k]["flops"] for k in ("arr_coc", "compare", "baseline"))
    assert b["vision"] < a["vision"] == base["vision"]
    assert b["whole_prefill"] < a["whole_prefill"] < base["whole_prefill"]
    assert base["selector"] == 0 and a["selector"] > 0
    assert rows["whole prefill FLOPs vs. baseline"][0] == "100%"
    assert rows["whole prefill FLOPs vs. baseline"][2] == f"{100 * b['whole_prefill'] / base['whole_prefill']:.0f}%"


def test_lm_flops_depend_on_the_prompt_length_only(scope, image):
    """The cost's LM prefill (counted on the real pruned prompt) equals a text prompt of the same length's."""
    from arr_coc.evaluation.cost import lm_flops
    from conftest import text_prefill_flops

    w = scope.vlm
    inputs = w.backend.build_inputs([[Image.open(image).convert("RGB")]], [Q])
    for budget in (0.25, 1.0):
        pruned, traces = w.prepare(inputs, budget=budget, method="arr_coc").outputs
        assert lm_flops(w.backend, pruned, 0, {}) == text_prefill_flops(w.backend, traces[0].prompt_tokens) > 0


def test_no_flops_shows_dashes(scope, image, monkeypatch):
    monkeypatch.setattr(scope, "count_flops", False)
    r = handler.ask(scope, image, Q)
    assert r.error == "" and _rows(r)["vision GFLOPs"] == ["-", "-", "-"] and r.record["arr_coc"]["flops"] is None


def test_switching_to_before_swaps_in_the_layer_trained_for_it(tiny_dir, layer_dirs, image):
    """As with the embedded model's shipped pair: the --arr-coc layer for encode after, the before-mode layer
    (here layer y) for encode before without a gist; any other choice is the user's and is kept."""
    s = server.load(str(tiny_dir), device="cpu", arr_coc=layer_dirs[0], max_new_tokens=2)
    configs.add_layers(s, [layer_dirs[1]])
    main, before = list(s.layers)
    s.before_layer = before
    assert configs.layer_for_mode(s, main, "before") == before          # negative control at the end: no pair
    assert configs.layer_for_mode(s, main, "before", gist=0.25) == main  # with a gist: the layer reading tokens
    assert configs.layer_for_mode(s, before, "after") == main
    assert configs.layer_for_mode(s, before, "before", gist="0.25") == main
    assert configs.layer_for_mode(s, configs.OFF, "before") == configs.OFF
    r = handler.ask(s, image, Q, True, 0.25, False, "arr_coc", encode="before", compare_layer=configs.OFF)
    assert r.error == "", r.error
    assert r.record["arr_coc"]["config"]["layer"] == before
    r = handler.ask(s, image, Q, True, 0.25, False, "arr_coc", encode="before", layer=main, compare_layer=configs.OFF)
    assert r.record["arr_coc"]["config"]["layer"] == main               # chosen explicitly: kept
    # the page: both encode radios (and the gist) drive their config's layer dropdown
    config = page.build_demo(s, examples=[]).get_config_file()
    ids = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    driven = {(ids[t[0]], ids[d["outputs"][0]]) for d in config["dependencies"] for t in d["targets"]
              if len(d["outputs"]) == 1}
    assert {("encode", "layer"), ("compare-encode", "compare-layer"), ("gist", "layer")} <= driven
    s.before_layer = None
    assert configs.layer_for_mode(s, main, "before") == main
