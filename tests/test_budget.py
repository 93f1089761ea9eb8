"""One budget: the same string keeps the same number of tokens in the Python API, `ask`, `eval`
(and the app: tests/test_app.py), ambiguous strings are refused everywhere with the same words, and
a caller chooses per call between an exact budget and one met on average."""

from __future__ import annotations

from _pruned import forward_pruned, prepare_state  # noqa: F401
import argparse
import json

import pytest
import torch

from arr_coc.budget import BudgetError, check_mode, parse_budget, parse_budgets, resolve_count

Q = "What color is the star?"
N_TOKENS = 20   # the tiny Qwen2-VL's merged grid for a 120 x 150 image: 4 x 5


@pytest.mark.parametrize("text,value", [("0.1", 0.1), ("10%", 0.1), ("1.0", 1.0), ("100%", 1.0), ("64", 64),
                                        ("64tok", 64), ("1tok", 1), (" 0.25 ", 0.25), (0.5, 0.5), (7, 7)])
def test_how_a_budget_is_written(text, value):
    got = parse_budget(text)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("bad,words", [("1", "ambiguous"), ("abc", "not a budget"), ("0", "count must be >= 1"),
                                       ("1.5", "share must lie in"), ("nan", "share must lie in"),
                                       ("inf", "share must lie in"), ("-3", "negative"), ("0%", "share"),
                                       (True, "not a budget"), (None, "not a budget"), (2.0, "share must lie in")])
def test_bad_budgets_are_refused_with_how_to_write_one(bad, words):
    with pytest.raises(BudgetError, match=words) as info:
        parse_budget(bad)
    assert "1.0" in str(info.value) or "0.1" in str(info.value)   # every message shows a valid example


def test_the_ambiguous_one_says_both_ways_to_write_it():
    with pytest.raises(BudgetError) as info:
        parse_budgets("0.05,1")
    assert "1.0" in str(info.value) and "1tok" in str(info.value)


def test_budget_modes():
    assert [check_mode(m) for m in (None, "exact", "mean", "adaptive")] == [None, "exact", "mean", "adaptive"]
    with pytest.raises(BudgetError, match="exact"):
        check_mode("average")


# --------------------------------------------------------------- the same string everywhere
@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_vlm, make_image):
    """A tiny Qwen2-VL saved as a folder, one image and a one-item JSONL about it."""
    folder = tmp_path_factory.mktemp("budget")
    model, processor = tiny_vlm("qwen2_vl")
    model.save_pretrained(folder / "model")
    processor.save_pretrained(str(folder / "model"))
    make_image(120, 150, 0).save(folder / "img.png")
    (folder / "one.jsonl").write_text(json.dumps({"id": "x", "image": "img.png", "question": Q, "answers": ["red"]}))
    return folder


STRINGS = ["0.25", "25%", "8", "8tok", "1.0"]


@pytest.mark.parametrize("text", STRINGS)
def test_the_same_string_keeps_the_same_tokens_in_the_api_ask_and_eval(text, saved_tiny, capsys):
    from arr_coc.cli import ask as cli_ask
    from arr_coc.cli import main
    from arr_coc.qwen import ARRCOCQwen
    from PIL import Image

    expected = resolve_count(parse_budget(text), N_TOKENS)
    vlm = ARRCOCQwen.from_pretrained(str(saved_tiny / "model"))
    _, trace = vlm.generate(Image.open(saved_tiny / "img.png"), Q, budget=text, method="grid", max_new_tokens=1)
    assert trace.total_tokens == N_TOKENS and trace.kept_tokens == expected

    parser = argparse.ArgumentParser()
    cli_ask.add_arguments(parser)
    args = parser.parse_args(["--model", str(saved_tiny / "model"), "--image", str(saved_tiny / "img.png"),
                              "--question", Q, "--budget", text, "--method", "grid", "--max-new-tokens", "1",
                              "--json"])
    assert cli_ask.run(args) == 0
    assert json.loads(capsys.readouterr().out)["kept_tokens"] == expected

    out = saved_tiny / f"eval-{text}.json"
    assert main(["eval", "--model", str(saved_tiny / "model"), "--data", str(saved_tiny / "one.jsonl"),
                 "--methods", "grid", "--budgets", text, "--max-new-tokens", "1", "--out", str(out), "--quiet"]) == 0
    row = next(r for r in json.loads(out.read_text())["results"] if r["method"] == "grid")
    assert row["kept_tokens_mean"] == expected


def test_an_ambiguous_budget_is_refused_by_the_api_ask_and_eval_alike(saved_tiny, capsys, tiny_vlm, make_image):
    from arr_coc.cli import main
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm("qwen2_vl")
    with pytest.raises(BudgetError, match="ambiguous"):
        ARRCOCQwen(model, processor).generate(make_image(120, 150), Q, budget="1", method="grid")
    for argv in (["ask", "--image", str(saved_tiny / "img.png"), "--question", Q, "--budget", "1"],
                 ["eval", "--data", str(saved_tiny / "one.jsonl"), "--budgets", "0.1,1", "--out", "x.json"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "ambiguous" in err and "1.0" in err and "1tok" in err, err


# --------------------------------------------------------------- exact or on average, per call
def test_mean_budgets_need_a_calibrated_layer(tiny_vlm, make_image):
    from arr_coc.qwen import ARRCOCQwen

    vlm = ARRCOCQwen(*tiny_vlm("qwen2_vl"))   # untrained: no calibrated spread
    with pytest.raises(BudgetError, match="use 'exact'"):
        vlm.generate(make_image(120, 150), Q, budget=0.25, budget_mode="mean", max_new_tokens=1)
    _, trace = vlm.generate(make_image(120, 150), Q, budget=0.25, budget_mode="exact", max_new_tokens=1)
    assert trace.kept_tokens == resolve_count(0.25, N_TOKENS) and trace.budget_mode == "exact"


def test_the_shipped_layer_keeps_exact_budgets_when_asked(tmp_path):
    """Same weights, same items: "exact" keeps the budget on every item, the default ("mean") lets the
    question move it (and keeps at most the budget on average)."""
    from arr_coc.data import read_jsonl
    from arr_coc.paths import default_layer_path, default_model_path
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc_shapes import write_split

    if default_model_path() is None or default_layer_path() is None:
        pytest.skip("the embedded model and its layer are not in this checkout")
    vlm = ARRCOCQwen.from_pretrained(default_model_path(), arr_coc=default_layer_path())
    kept = {"exact": [], None: []}
    for rec in read_jsonl(write_split(tmp_path, split="test", n=12, seed=13)):
        inputs = vlm.build_inputs([[rec.load_image()]], [rec.question])
        for mode in kept:
            _, traces = vlm.prepare(inputs, budget=0.05, budget_mode=mode).outputs
            kept[mode].append((traces[0].kept_tokens, resolve_count(0.05, traces[0].total_tokens)))
    assert all(k == want for k, want in kept["exact"])
    assert any(k != want for k, want in kept[None])   # the default follows the question


# --------------------------------------------------------------- every token is every token (issue 55)
def _calibrated_layer(hidden: int):
    """An untrained layer whose "mean" budgets scale an image's count down (spread_min 0.6 at a far reference) and
    whose adaptive count is at most half the tokens: a budget of 1.0 met as either would drop tokens."""
    from arr_coc.core.config import ARRCOCConfig, AttendingConfig

    att = AttendingConfig(spread_tau=0.05, spread_reference=1e6, void_threshold=0.0, max_ratio=0.5)
    return ARRCOCConfig(attending=att).with_query_dim(hidden)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_budget_of_one_keeps_every_token_in_every_mode_and_method(family, make_image):
    """Issue 55: before the tower in the default "mean" mode a budget of 1.0 kept 226 of 256 tokens and switched the
    adapter on. Every token means every token: every encode mode, budget mode and method keeps them all, the
    adapter stays off, and the logits are the stock model's (the same kernels both sides: exact)."""
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.qwen.adapter import attach_adapter
    from arr_coc.qwen.tiny import build_tiny_qwen

    model, processor = build_tiny_qwen(family, seed=0)
    adapter = attach_adapter(model, rank=2, alpha=4.0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    hidden = model.config.get_text_config().hidden_size
    vlm = ARRCOCQwen(model, processor, arr_coc=_calibrated_layer(hidden), adapter=adapter)
    inputs = vlm.build_inputs([[make_image(112, 140, 1)], [make_image(84, 112, 2)]], [Q, "How many shapes?"])
    for encode in ("after", "before"):
        stock = forward_pruned(vlm, method="none", encode=encode, **inputs).logits
        runs = [("arr_coc", mode, budget) for mode in (None, "exact", "mean", "adaptive") for budget in (1.0, "100%", 10_000)]
        runs += [(m, None, 1.0) for m in ("arr_coc_adaptive", "random", "grid", "divprune", "cdpruner", "visionzip")
                 if encode == "after" or m in ("arr_coc_adaptive", "random", "grid")]
        for method, mode, budget in runs:
            kw = {"budget": parse_budget(budget), "budget_mode": mode, "method": method}
            out = forward_pruned(vlm, encode=encode, **kw, **inputs)
            where = (family, encode, method, mode, budget)
            assert [t.kept_tokens for t in out.traces] == [t.total_tokens for t in out.traces], where
            assert [t.adapter for t in out.traces] == ["", ""], where
            assert torch.equal(out.logits, stock), where
        # a batch of both: the row given every token keeps them all while the selector prunes the other; and the
        # negative control, a budget under every token prunes and the adapter then runs
        out = forward_pruned(vlm, encode=encode, budget=[1.0, 0.9], **inputs)
        assert out.traces[0].kept_tokens == out.traces[0].total_tokens and out.traces[0].adapter == ""
        assert out.traces[1].kept_tokens < out.traces[1].total_tokens and out.traces[1].adapter == "adapter"
        assert torch.equal(out.logits[0], stock[0])


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_budget_of_one_keeps_every_token_of_a_clip(family):
    from test_video import video_inputs

    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.qwen.tiny import build_tiny_qwen

    model, processor = build_tiny_qwen(family, seed=0)
    vlm = ARRCOCQwen(model, processor, arr_coc=_calibrated_layer(model.config.get_text_config().hidden_size))
    inputs = video_inputs(model, processor, t=3, image=False)
    for encode in ("after", "before"):
        stock = forward_pruned(vlm, method="none", encode=encode, **inputs).logits
        for mode in (None, "mean", "adaptive", "exact"):
            out = forward_pruned(vlm, budget=1.0, budget_mode=mode, encode=encode, **inputs)
            assert out.traces[0].kept_tokens == out.traces[0].total_tokens, (encode, mode)
            assert torch.equal(out.logits, stock), (encode, mode)
        assert forward_pruned(vlm, budget=0.5, budget_mode="mean", encode=encode, **inputs).traces[0].kept_tokens \
            < out.traces[0].total_tokens                                              # negative control
