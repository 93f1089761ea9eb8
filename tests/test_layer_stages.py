"""`python -m arr_coc bench --layer`: the layer's pass alone, sub-stage by sub-stage (CPU, seconds).

What a user would notice: a texture group, a way of knowing, balancing or attending missing from the table, op
counts per sub-stage that do not add up to the pass's, or a pass whose sub-stages do not cover its time."""

from __future__ import annotations

import json

from arr_coc.__main__ import main


def test_bench_layer_names_every_sub_stage(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["bench", "--layer", "--cpu-time", "--sizes", "336", "--batches", "1,2", "--repeats", "1",
                 "--budgets", "0.1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    groups = json.loads(open("checkpoints/arr-coc-shapes-before/config.json").read())["texture"]["groups"]
    for row in report["rows"]:
        assert list(row["ms"]) == ["texture.pixels"] + [f"texture.{g}" for g in groups] + [
            "texture", "scorers.information", "scorers.perspectival", "scorers.participatory", "scorers.balancing",
            "scorers", "allocator"]
        assert sum(row["ops"].values()) == row["total_ops"] > 0
        assert sum(row["ms"].values()) <= row["pass_ms"] * 1.001
    assert report["clock"] == "process CPU time" and "| texture: object |" in capsys.readouterr().out
