"""`python -m arr_coc eval` end to end (CPU, offline, small); `bench` is tested in tests/test_bench.py.

The evaluation runs on the embedded model (checkpoints/shapes-qwen2vl) when it exists,
else on a tiny random Qwen2-VL saved to a temporary folder, so it never depends on
training having finished. What a user would notice: a results.json missing keys, rows
that disagree with the budget, an oracle that does not cover the answer's cells, FLOPs
that do not fall with the budget.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from arr_coc.__main__ import main
from arr_coc.budget import parse_budgets, resolve_count
from arr_coc.core.layer import ARRCOCLayer
from arr_coc.evaluation.flops import count_flops
from arr_coc.evaluation.loop import REQUIRED_KEYS, resolve_methods
from arr_coc.evaluation.report import paired_difference, paired_stats

EMBEDDED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "shapes-qwen2vl")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    from arr_coc_shapes import write_split

    out = tmp_path_factory.mktemp("shapes")
    return str(write_split(out, split="test", n=20, seed=0))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded checkpoint, else a tiny random Qwen2-VL saved like one."""
    if os.path.isfile(os.path.join(EMBEDDED, "config.json")):
        return EMBEDDED
    from _app_server import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2vl")))


def test_eval_end_to_end_writes_results_table_and_plot(split, model_dir, tmp_path, capsys):
    out, plot, table = tmp_path / "results.json", tmp_path / "acc.png", tmp_path / "table.md"
    t0 = time.perf_counter()
    code = main(["eval", "--model", model_dir, "--data", split, "--methods", "all", "--budgets", "0.1,1.0",
                 "--limit", "20", "--batch-size", "10", "--out", str(out), "--plot", str(plot),
                 "--markdown", str(table), "--quiet"])
    seconds = time.perf_counter() - t0
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model"] == model_dir and report["data"] == split and report["n"] == 20
    rows = {(r["method"], r["budget"]): r for r in report["results"]}
    methods = ["random", "grid", "downscale", "fastv", "visionzip", "divprune", "cdpruner", "oracle", "arr_coc"]
    from arr_coc.paths import resolve_layer

    shipped = resolve_layer(model_dir, None)
    spreads = bool(shipped) and ARRCOCLayer.from_pretrained(shipped).config.attending.spread_tau > 0
    if shipped:  # the embedded model: `all` includes the trained layer shipped for it
        assert report["arr_coc_weights"] == shipped and "arr_coc_trained" not in report["skipped"]
        methods.append("arr_coc_trained")
    else:        # any other model: skipped, with what to pass
        assert "arr_coc_trained" in report["skipped"] and "--arr-coc-weights" in report["skipped"]["arr_coc_trained"]
    assert set(rows) == {("none", 1.0)} | {(m, b) for m in methods for b in (0.1, 1.0)}
    n_tokens = rows[("none", 1.0)]["total_tokens_mean"]
    for (method, budget), r in rows.items():
        assert set(REQUIRED_KEYS) <= set(r)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["n"] == 20
        assert set(r["per_type"]) <= {"color", "shape", "exists", "count", "letter"}
        assert r["total_tokens_mean"] == n_tokens                 # always the ORIGINAL image's tokens
        assert r["prefill_flops_mean"] > 0 and r["latency_s_median"] > 0
        if budget == 1.0:                                         # keeps everything: identical to none
            assert r["kept_tokens_mean"] == n_tokens and r["accuracy"] == rows[("none", 1.0)]["accuracy"]
        elif method != "downscale":
            k = resolve_count(0.1, int(n_tokens))
            if method == "arr_coc_trained" and spreads:  # the shipped layer's budget follows the question
                assert round(0.6 * k) <= r["kept_tokens_mean"] <= k, r["kept_tokens_mean"]
            else:
                assert r["kept_tokens_mean"] == k
            assert r["prefill_flops_mean"] < rows[("none", 1.0)]["prefill_flops_mean"]
            assert 0.0 <= r["full_coverage"] <= r["coverage"] <= 1.0
        else:
            assert r["coverage"] is None and abs(r["kept_tokens_mean"] - 0.1 * n_tokens) <= 0.2 * 0.1 * n_tokens
    # the oracle keeps the answer's cells first: the ceiling of coverage
    assert rows[("oracle", 0.1)]["coverage"] >= 0.9
    assert rows[("oracle", 1.0)]["full_coverage"] == 1.0 and rows[("random", 0.1)]["full_coverage"] < 0.5
    assert all(rows[("oracle", 0.1)]["coverage"] >= rows[(m, 0.1)]["coverage"] for m in methods if m != "downscale")
    # FastV and VisionZip pay for their extra work; random and grid pay nothing
    assert rows[("fastv", 0.1)]["selector_flops_mean"] > 0 and rows[("visionzip", 0.1)]["selector_flops_mean"] > 0
    assert rows[("random", 0.1)]["selector_flops_mean"] == 0 == rows[("grid", 0.1)]["selector_flops_mean"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    md = table.read_text()
    assert "| arr_coc |" in md and "| oracle |" in md and "prefill GFLOPs" in md
    # per-item answers, in the report's item order: paired comparisons between methods
    assert len(report["ids"]) == 20 and all(len(r["correct"]) == 20 for r in report["results"])
    assert all(sum(r["correct"]) / 20 == pytest.approx(r["accuracy"]) for r in report["results"])
    # Per item: what the VLM said and how much of the answer's cells it kept, enough to see why an item failed.
    from arr_coc.data import read_jsonl, score

    records = list(read_jsonl(split))[:20]
    for r in report["results"]:
        assert [score(a, rec.answers) for a, rec in zip(r["answers"], records)] == r["correct"]
        covered = [c for c in r["item_coverage"] if c is not None]
        assert sum(r["item_kept"]) / 20 == pytest.approx(r["kept_tokens_mean"])
        if r["method"] != "downscale":  # after the tower: every cell of the full grid encoded
            assert r["item_encoded"] == r["item_total"] and sum(r["item_total"]) / 20 == r["total_tokens_mean"]
        if r["coverage"] is not None:
            assert len(covered) == r["n_with_boxes"] and sum(covered) / len(covered) == pytest.approx(r["coverage"])
    assert "minus each method on the same items" in md and "| oracle | " in md.split("minus each method")[1]
    print(f"eval of 20 items took {seconds:.1f} s")


def test_eval_fast_buckets_fills_each_choice_to_its_bucket_eagerly(split, model_dir, tmp_path, capsys):
    """`eval --fast buckets`: the fast path's fixed shapes without compiling (what scripts/eval_buckets.py did by
    monkeypatching the loader): every kept count is a bucket (or the whole grid), never below the eager run's."""
    from arr_coc.buckets import CELL_BUCKETS

    rows = {}
    for fast in ("off", "buckets"):
        out = tmp_path / f"{fast}.json"
        assert main(["eval", "--model", model_dir, "--data", split, "--methods", "grid", "--budgets", "0.05",
                     "--limit", "3", "--batch-size", "3", "--fast", fast, "--out", str(out), "--quiet"]) == 0
        rows[fast] = next(r for r in json.loads(out.read_text())["results"] if r["method"] == "grid")
    off, filled = rows["off"], rows["buckets"]
    assert all(k in CELL_BUCKETS or k == n for k, n in zip(filled["item_kept"], filled["item_total"]))
    assert all(f >= o for f, o in zip(filled["item_kept"], off["item_kept"]))
    assert any(f > o for f, o in zip(filled["item_kept"], off["item_kept"]))     # the fill added cells
    with pytest.raises(SystemExit):
        main(["ask", "--fast", "buckets", "--help"])                            # an eval option only
    assert "invalid choice: 'buckets'" in capsys.readouterr().err


def test_eval_is_seeded(split, model_dir, tmp_path):
    reports = []
    for i in range(2):
        out = tmp_path / f"r{i}.json"
        assert main(["eval", "--model", model_dir, "--data", split, "--methods", "random,oracle", "--budgets", "0.1",
                     "--limit", "6", "--batch-size", "3", "--seed", "3", "--out", str(out), "--quiet"]) == 0
        reports.append(json.loads(out.read_text()))
    strip = lambda rep: [(r["method"], r["accuracy"], r["coverage"], r["kept_tokens_mean"]) for r in rep["results"]]  # noqa: E731
    assert strip(reports[0]) == strip(reports[1])


def test_eval_errors_say_what_to_do(split, tmp_path, capsys):
    assert main(["eval", "--data", split, "--methods", "random,nonsense", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(["eval", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.json")]) == 2
    assert "gen-data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--data", split, "--budgets", "0", "--out", str(tmp_path / "x.json")])
    assert parse_budgets("0.05,0.1,64,1.0") == [0.05, 0.1, 64, 1.0]
    with pytest.raises(ValueError, match="ambiguous"):   # every token, or one token? say which
        parse_budgets("0.1,1")
    methods, skipped = resolve_methods("all")
    assert "arr_coc_trained" not in methods and "arr_coc_trained" in skipped


def test_arr_coc_trained_runs_saved_weights(split, model_dir, tmp_path):
    from arr_coc import ARRCOCConfig, ARRCOCLayer

    with open(os.path.join(model_dir, "config.json")) as f:
        hidden = json.load(f)["text_config"]["hidden_size"]
    folder = tmp_path / "arr"
    ARRCOCLayer(ARRCOCConfig().with_query_dim(hidden)).save_pretrained(folder)
    out = tmp_path / "r.json"
    assert main(["eval", "--model", model_dir, "--data", split, "--methods", "arr_coc_trained", "--budgets", "0.25",
                 "--limit", "4", "--arr-coc-weights", str(folder), "--out", str(out), "--quiet"]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["method"] == "arr_coc_trained" and row["kept_share"] == pytest.approx(0.25, abs=0.01)


def test_flop_counter_counts_cpu_attention():
    q = torch.randn(1, 2, 50, 8)
    _, flops = count_flops(torch.nn.functional.scaled_dot_product_attention, q, q, q, is_causal=True)
    assert flops == 2 * (2 * 1 * 2 * 50 * 50 * 8)


def test_paired_difference_counts_items_each_method_alone_got_right():
    rows = [{"method": "a", "budget": 0.1, "correct": [1, 1, 1, 0, 1, 1, 0, 1]},
            {"method": "b", "budget": 0.1, "correct": [1, 0, 0, 0, 1, 1, 1, 0]},
            {"method": "none", "budget": 1.0, "correct": [1, 1, 1, 1, 1, 1, 1, 1]}]
    p = paired_difference({"results": rows}, "a", "b", 0.1)
    assert (p["wins"], p["losses"], p["n"]) == (3, 1, 8) and p["diff"] == pytest.approx(2 / 8)
    assert p["low"] < p["diff"] < p["high"] and p["low"] < 0   # 3 wins to 1 loss in 8 items is not significant
    assert paired_difference({"results": rows}, "a", "none", 0.1)["diff"] == pytest.approx(-2 / 8)  # none: its 100% row
    assert paired_difference({"results": rows}, "a", "missing", 0.1) is None


def test_one_paired_interval_for_the_tables_the_scripts_and_eval_vs_full():
    """d = a - b = [1,0,0,1,-1,0,1,0]: mean 0.25, sd sqrt(3.5 / 7), half 1.96 * sd / sqrt(8) = 0.49, by hand."""
    from arr_coc.evaluation.loop import _Rows, compare_with_full

    a, b = [1, 1, 0, 1, 0, 1, 1, 0], [0, 1, 0, 0, 1, 1, 0, 0]
    p = paired_stats(a, b)
    assert (p["diff"], p["n"], p["wins"], p["losses"]) == (0.25, 8, 3, 1)
    assert p["low"] == pytest.approx(-0.24) and p["high"] == pytest.approx(0.74)
    row = {"status": "ok", "correct": a, "answers": ["x"] * 8}
    compare_with_full(row, _Rows(correct=b, answers=["x"] * 8, prefill_flops=[None] * 8, vision_flops=[0] * 8))
    assert row["vs_full"] == [-0.24, 0.74]                       # eval's row: the same interval, rounded
    one = paired_stats([1], [0])
    assert one["diff"] == 1.0 and math.isnan(one["low"]) and math.isnan(one["high"])   # one item: no interval


def test_the_table_says_when_a_row_kept_another_share_than_its_budget():
    from arr_coc.evaluation.report import accuracy_table

    rows = [{"method": "fastv", "budget": 0.05, "accuracy": 0.78, "coverage": 0.5, "kept_share": 13 / 256},
            {"method": "arr_coc_trained", "budget": 0.05, "accuracy": 0.81, "coverage": 0.8, "kept_share": 12 / 256}]
    lines = accuracy_table({"budgets": [0.05], "results": rows}).splitlines()
    assert lines[2] == "| fastv | 0.780 (0.50) |"                      # 5.08%: the budget, rounded to tokens
    assert lines[3] == "| arr_coc_trained | 0.810 (0.80; 4.7% kept) |"  # a budget met on average


def test_a_selector_that_raises_is_reported_as_failed_not_as_the_unpruned_row(split, model_dir, tmp_path, capsys):
    """The library keeps every token of an item its selector failed on (right for users); the evaluation
    must not report that as the method's accuracy. --no-strict shows the silent fallback it refuses."""
    from arr_coc.pipeline.selection import SELECTORS, register_selector

    def broken(ctx):
        raise RuntimeError("scorer exploded")

    register_selector("test_broken", broken, overwrite=True)
    try:
        out = tmp_path / "strict.json"
        assert main(["eval", "--model", model_dir, "--data", split, "--methods", "none,test_broken",
                     "--budgets", "0.1", "--limit", "4", "--out", str(out), "--quiet"]) == 0
        rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
        assert rows["test_broken"]["status"] == "failed" and rows["test_broken"]["accuracy"] is None
        assert "scorer exploded" in rows["test_broken"]["error"]
        assert "failed" in capsys.readouterr().out   # the table says so

        loose = tmp_path / "loose.json"   # negative control: without strict mode the row looks like `none`
        assert main(["eval", "--model", model_dir, "--data", split, "--methods", "none,test_broken",
                     "--budgets", "0.1", "--limit", "4", "--no-strict", "--out", str(loose), "--quiet"]) == 0
        rows = {r["method"]: r for r in json.loads(loose.read_text())["results"]}
        assert rows["test_broken"]["status"] == "ok" and rows["test_broken"]["fallbacks"] == {"keep_all": 4}
        assert rows["test_broken"]["correct"] == rows["none"]["correct"]
    finally:
        SELECTORS.pop("test_broken", None)


def test_flops_that_cannot_be_counted_are_unknown_not_zero(split, model_dir, tmp_path):
    from arr_coc.pipeline.selection import SELECTORS, get_selector, register_selector

    calls = []

    def once_only(ctx):   # answers in prepare (4 items, each chosen alone), then refuses the off-the-clock FLOP count
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("cannot run twice")
        return get_selector("grid")(ctx)

    register_selector("test_once", once_only, overwrite=True)
    try:
        out = tmp_path / "flops.json"
        assert main(["eval", "--model", model_dir, "--data", split, "--methods", "grid,test_once",
                     "--budgets", "0.1", "--limit", "4", "--out", str(out), "--markdown", str(tmp_path / "t.md"),
                     "--quiet"]) == 0
        rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
        assert rows["test_once"]["status"] == "ok" and rows["test_once"]["prefill_flops_mean"] is None
        assert rows["grid"]["prefill_flops_mean"] > 0
        assert "unknown" in (tmp_path / "t.md").read_text()
    finally:
        SELECTORS.pop("test_once", None)
