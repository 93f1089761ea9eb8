"""`python -m arr_coc bench`: the whole prefill per encoding mode and budget, on the tiny presets (CPU, seconds).

What a user would notice: a row or a key missing from the JSON, shares that do not add up (the reference
is not 1, "before" is not cheaper than "after" at the same budget), full-depth FLOPs that do not equal
what the full-depth model counts, a layer of the wrong width accepted, a gist whose cost is not counted.
Times are only checked to be positive: they depend on the machine.
"""

from __future__ import annotations

import json

import pytest

from arr_coc.__main__ import main
from arr_coc.budget import resolve_count

ROW_KEYS = {"encode", "gist", "budget", "method", "visual_tokens", "encoded_tokens", "total_tokens", "kv_cache_bytes",
            "vision_s_median", "gist_s_median", "arr_coc_s_median", "prefill_s_median", "total_s_median",
            "vision_flops", "gist_flops", "arr_coc_flops", "prefill_flops", "e2e_flops", "vision_flops_full",
            "gist_flops_full", "prefill_flops_full", "e2e_flops_full", "e2e_flops_share", "e2e_flops_share_run",
            "e2e_time_share", "time_over_flops", "arr_coc_time_share", "gist_time_share", "speedup",
            "ideal_speedup", "speedup_vs_ideal", "overhead_share"}


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code = main(["bench", "--preset", "tiny", "--encode", "after,before", "--budgets", "0.25", "--gist", "0.25",
                 "--repeats", "1", "--out", str(out / "bench.json"), "--markdown", str(out / "bench.md")])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


def _row(report, encode, budget, gist=0.0):
    return next(r for r in report["results"] if (r["encode"], r["budget"], r["gist"]) == (encode, budget, gist))


def test_bench_runs_both_encoding_modes_with_every_key(tiny_report):
    report, md = tiny_report
    assert report["preset"] == "tiny" and report["label"] == "vision 2 of 2 layers, LM 2 of 2"
    assert report["runtime"].startswith("cpu, float32") and "untrained" in report["arr_coc_layer"]
    got = {(r["encode"], r["budget"], r["gist"]) for r in report["results"]}
    assert got == {("after", 0.25, 0.0), ("after", 1.0, 0.0), ("before", 0.25, 0.0), ("before", 1.0, 0.0),
                   ("before", 0.25, 0.25)}
    for r in report["results"]:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["fallback"] is None and r["error"] is None
        assert r["total_s_median"] > 0 and r["prefill_s_median"] > 0 and r["vision_s_median"] > 0
        assert r["e2e_flops"] == r["vision_flops"] + r["gist_flops"] + r["arr_coc_flops"] + r["prefill_flops"]
        for key in ("e2e_flops_share", "e2e_flops_share_run"):
            assert 0 < r[key] <= 1
    assert "| before | 25% |" in md and "| after | 100% |" in md and "tower share of the full prefill" in md


def test_the_reference_is_one_and_before_costs_less_than_after(tiny_report):
    report, _ = tiny_report
    full, after, before = _row(report, "after", 1.0), _row(report, "after", 0.25), _row(report, "before", 0.25)
    assert full["method"] == "none" and full["arr_coc_flops"] == 0
    for key in ("e2e_flops_share", "e2e_flops_share_run", "e2e_time_share", "time_over_flops", "speedup_vs_ideal"):
        assert full[key] == 1.0
    n = full["visual_tokens"]
    assert n == 144 and after["visual_tokens"] == before["visual_tokens"] == resolve_count(0.25, n)
    assert after["encoded_tokens"] == n and before["encoded_tokens"] == before["visual_tokens"]
    # same LM work, far less tower work: the whole prefill costs less before than after
    assert before["prefill_flops"] == after["prefill_flops"] < full["prefill_flops"]
    assert before["vision_flops"] < 0.5 * after["vision_flops"] and after["vision_flops"] == full["vision_flops"]
    assert before["e2e_flops_share"] < after["e2e_flops_share"] < 1
    assert before["arr_coc_flops"] > 0 and after["arr_coc_flops"] > 0 and before["arr_coc_time_share"] > 0
    assert before["gist_flops"] == 0 and before["gist_time_share"] == 0
    # "before" with every cell encodes every cell: the same FLOPs as the stock encoding
    every = _row(report, "before", 1.0)
    assert every["encoded_tokens"] == n and every["vision_flops"] == full["vision_flops"]
    tc = report["model"]["lm"]  # KV cache: 2 (K, V) x layers x kv heads x head dim x tokens x 4 bytes
    assert full["kv_cache_bytes"] == 2 * tc["num_hidden_layers"] * tc["num_key_value_heads"] * \
        (tc["hidden_size"] // tc["num_attention_heads"]) * full["total_tokens"] * 4


def test_a_gist_row_counts_and_times_the_gist_on_its_own(tiny_report):
    report, md = tiny_report
    plain, gist = _row(report, "before", 0.25), _row(report, "before", 0.25, gist=0.25)
    assert gist["gist_flops"] > 0 and gist["gist_s_median"] > 0 and gist["gist_time_share"] > 0
    assert gist["vision_flops"] == plain["vision_flops"]           # the same cells, encoded the same way
    assert gist["e2e_flops"] == plain["e2e_flops"] - plain["arr_coc_flops"] + gist["arr_coc_flops"] + \
        gist["gist_flops"]
    assert gist["e2e_flops_share"] > plain["e2e_flops_share"]
    assert "- gist (before, gist 0.25, 25%)" in md


@pytest.mark.parametrize("preset, small, full", [("tiny", (1, 1), (2, 2)), ("tiny-qwen2.5", (2, 1), (4, 2))])
def test_full_depth_flops_equal_what_the_full_depth_model_counts(preset, small, full):
    """A run of fewer layers, each layer's count scaled to the real depth, gives exactly the count of a run
    at the real depth (Qwen2.5-VL: windowed and full-attention blocks scaled apart)."""
    from arr_coc.evaluation.bench import bench
    from arr_coc.evaluation.bench_depth import full_tower_flops
    from arr_coc.evaluation.bench_presets import SHAPES

    few = bench(preset, vision_layers=small[0], lm_layers=small[1], budgets=[0.25], repeats=1)
    every = bench(preset, vision_layers=full[0], lm_layers=full[1], budgets=[0.25], repeats=1)
    assert few["label"] != every["label"]
    for a, b in zip(few["results"], every["results"]):
        assert (a["encode"], a["budget"]) == (b["encode"], b["budget"])
        assert a["e2e_flops"] < b["e2e_flops"]                   # negative control: scaling has work to do
        for key in ("vision", "prefill", "e2e"):
            assert a[f"{key}_flops_full"] == b[f"{key}_flops"] == b[f"{key}_flops_full"], (preset, key, a, b)
        assert a["e2e_flops_share"] == pytest.approx(b["e2e_flops_share_run"])
        # negative control: scaling the whole tower by the depth ratio (patch embedding and merger included) is not it
        assert a["vision_flops"] * full[0] // small[0] != b["vision_flops"]
    if preset == "tiny-qwen2.5":   # windowed and full-attention blocks are scaled apart (Qwen2.5-VL-3B: 28 and 4)
        from arr_coc.evaluation.bench_depth import TowerCount

        shape = SHAPES["Qwen2.5-VL-3B"]
        kinds = shape.block_kinds(2)
        assert kinds == ["window", "full"] and shape.block_kinds().count("full") == 4
        count = TowerCount(1000, (100, 400), 10)
        assert full_tower_flops(count, kinds, shape.block_kinds()) == 1000 - 500 + 28 * 100 + 4 * 400
        assert full_tower_flops(count, ["full", "full"], ["full"] * 32) == 1000 - 500 + 32 * 250   # the wrong way
        assert full_tower_flops(count, kinds, shape.block_kinds(), out_scale=2.0) == 4900 + 10


def test_another_widths_layer_is_counted_on_meta_with_its_attention(tiny_vlm, make_image):
    """The 7B shapes' LM layers are counted on the meta device: equal to a real run's layer count at the
    tiny width, and to the analytic count (linear layers + 2 * 2 * S^2 * hidden of attention) at 7B width."""
    from arr_coc.evaluation.bench_depth import lm_count, lm_layer_flops, module_totals
    from arr_coc.evaluation.bench_presets import SHAPES
    from arr_coc.evaluation.flops import flop_counter
    from arr_coc.qwen import ARRCOCQwen

    model, processor = tiny_vlm("qwen2_vl")
    vlm = ARRCOCQwen(model, processor)
    inputs = vlm.build_inputs([[make_image(112, 112)]], ["what is here?"])
    pruned, _ = vlm.prepare(inputs, method="none").outputs
    with flop_counter() as counter:
        vlm.backend.prefill(pruned, logits_to_keep=1)
    seq = int(pruned.attention_mask.sum())
    run = lm_count(module_totals(counter), model.config.text_config.num_hidden_layers, seq)
    assert lm_layer_flops(model, model.config.text_config.to_dict(), seq) == run.layers[0] == run.layers[1]
    t = SHAPES["Qwen2-VL-7B"].text
    h, kv = t["hidden_size"], t["num_key_value_heads"] * t["hidden_size"] // t["num_attention_heads"]
    for s in (100, 1118):
        linear = 2 * s * (2 * h * h + 2 * h * kv + 3 * h * t["intermediate_size"])
        assert lm_layer_flops(model, t, s) == linear + 2 * 2 * s * s * h


def test_a_layer_of_another_width_is_refused_with_what_to_do(tmp_path, capsys):
    from arr_coc import ARRCOCConfig, ARRCOCLayer

    ARRCOCLayer(ARRCOCConfig().with_query_dim(192)).save_pretrained(str(tmp_path / "layer"))
    code = main(["bench", "--preset", "tiny", "--arr-coc", str(tmp_path / "layer"), "--budgets", "0.25",
                 "--repeats", "1", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert code == 2 and "192" in err and "leave --arr-coc out" in err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["--method", "fastv", "--encode", "before"], "cannot choose before the tower"),
    (["--preset", "tiny-qwen2.5", "--vision-layers", "1"], "--vision-layers 2 or more"),
    (["--encode", "sideways"], "--encode takes"),
    (["--lm-layers", "3"], "--lm-layers must be in [1, 2]"),
])
def test_bad_options_exit_2_with_the_fix(tmp_path, capsys, argv, says):
    argv = ["bench", *(["--preset", "tiny"] if "--preset" not in argv else []), *argv, "--repeats", "1",
            "--out", str(tmp_path / "b.json")]
    assert main(argv) == 2
    assert says in capsys.readouterr().err


def test_the_tower_flops_agree_with_the_evaluations_counter(tiny_report):
    """bench counts the tower calls it ran; eval's cost re-runs them: both say the same, gist included."""
    from arr_coc.evaluation.bench_presets import PRESETS, build_model
    from arr_coc.evaluation.cost import vision_flops
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.encode import EncodeConfig
    from arr_coc.runtime import Runtime
    from arr_coc.evaluation.scenes import bench_scene

    report, _ = tiny_report
    model, processor, _ = build_model(PRESETS["tiny"], 2, 2, Runtime.resolve("cpu", "float32"))
    vlm = ARRCOCQwen(model, processor)
    image, question = bench_scene(0, 0, 336)
    assert question == report["question"]
    inputs = vlm.build_inputs([[image]], [question])
    for encode, gist in (("after", 0.0), ("before", 0.0), ("before", 0.25)):
        _, traces = vlm.prepare(inputs, budget=0.25, encode=EncodeConfig(encode, gist=gist)).outputs
        row = _row(report, encode, 0.25, gist)
        expected = [row["vision_flops"] + row["gist_flops"]]
        assert vision_flops(vlm.backend, _prompt(vlm, inputs), traces, gist, {}) == expected


def test_cost_at_width_prices_each_item_as_the_bench_counted_it(tmp_path, monkeypatch):
    """scripts/cost_at_width.py fits the tower's and the LM's full-depth FLOPs as quadratics in the counts
    (attention) from bench's before-mode rows: items that encode and read what a bench row did cost that row's
    share; an item on a grid twice as fine maps to the same shares. Negative control: a linear fit misses."""
    import importlib.util
    import sys
    from pathlib import Path

    import numpy as np

    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "tiny", "--encode", "after,before", "--budgets", "0.1,0.25,0.5,0.75,1.0",
                 "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    path = Path(__file__).resolve().parent.parent / "scripts" / "cost_at_width.py"
    spec = importlib.util.spec_from_file_location("cost_at_width", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)   # its dataclass looks itself up there
    spec.loader.exec_module(module)
    cost = module.WidthCost.from_bench(report)
    assert cost.rows == 4 and max(cost.residual) < 1e-6   # FLOPs are exactly quadratic in the counts
    rows = [_row(report, "before", b) for b in (0.1, 0.25, 0.5, 0.75)]
    n = [r["encoded_tokens"] for r in rows]
    assert len(set(n)) == 4 and cost.grid == report["visual_tokens_full"]
    got = cost.shares(n, n, [cost.grid] * 4)
    assert got == pytest.approx([r["e2e_flops_share"] for r in rows], rel=1e-4)
    assert (cost.shares([2 * k for k in n], [2 * k for k in n], [2 * cost.grid] * 4) == got).all()
    linear = np.poly1d(np.polyfit(n, [r["vision_flops_full"] for r in rows], 1))
    assert max(abs(linear(k) - r["vision_flops_full"]) / r["vision_flops_full"] for k, r in zip(n, rows)) > 1e-3


def test_stages_time_arr_cocs_own_work_and_count_what_a_gpu_would_launch(tmp_path, capsys):
    """bench --stages: every stage timed, the layer's forward sync-free, each image chosen alone (batch invariance:
    two images cost twice one image's ops, no more), the whole ARR-COC pass cheaper than the reference's tower on
    this tiny model's image."""
    out = tmp_path / "stages.json"
    assert main(["bench", "--stages", "--preset", "tiny", "--sizes", "336", "--batches", "1,2", "--repeats", "1",
                 "--encode", "before", "--budgets", "0.25", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    one, two = report["rows"]
    for row in (one, two):
        for stage in ("question", "unpatchify", "texture", "scorers", "allocator", "read", "packing", "vision"):
            assert row["arr_coc_ms"][stage] > 0, stage
        assert row["layer_syncs"] == 0 and row["layer_uploads"] <= 4 * row["batch"]
        assert row["own_ms"] == pytest.approx(sum(row["arr_coc_ms"][s] for s in
                                                  ("question", "unpatchify", "texture", "scorers", "allocator", "read",
                                                   "packing")))
    assert two["layer_ops"] <= 2.05 * one["layer_ops"]           # two images: each its own pass, nothing more
    assert two["kept_per_image"] < two["cells_per_image"]
    assert "| 336 | 2 |" in capsys.readouterr().out
    assert main(["bench", "--model", "checkpoints/shapes-qwen2vl", "--out", str(tmp_path / "x.json")]) == 2
    assert "add --stages" in capsys.readouterr().err


def _prompt(vlm, inputs):
    """The prompt of `inputs` as the pipeline reads it (no tower): what the evaluation's cost counts against."""
    return vlm.backend.read_prompt(inputs, encode_all=False)


def test_bench_scenes_are_seeded_cluttered_and_asked_in_the_embedded_model_s_words():
    """The library draws the bench's pictures itself (the test bed is not installed with it): the same picture for
    the same (seed, index, size), another for another index, 8-24 coloured shapes on a light background (not blank),
    and questions the embedded model's word-level tokenizer knows every word of."""
    import numpy as np

    from arr_coc.evaluation.scenes import bench_scene
    from arr_coc_shapes.embedded import _split_words, vocabulary

    (a, qa), (b, qb), (c, _) = bench_scene(0, 1, 448), bench_scene(0, 1, 448), bench_scene(0, 2, 448)
    assert a.size == (448, 448) and a.tobytes() == b.tobytes() and qa == qb
    assert a.tobytes() != c.tobytes()
    for image in (a, c):
        pixels = np.asarray(image, dtype=np.int16)
        coloured = (pixels.max(-1) - pixels.min(-1) > 100).mean()    # the shapes' saturated colours, not the ground
        assert 0.02 < coloured < 0.5, coloured
    known = set(vocabulary())
    assert all(set(_split_words(bench_scene(0, i, 336)[1])) <= known for i in range(40))
    assert not set(_split_words("How many hexagons are there?")) <= known      # negative control
    with pytest.raises(ValueError, match="at least 65 px"):
        bench_scene(0, 0, 64)
