"""scripts/vllm_bench.py's bookkeeping (no model runs here: the measurement itself runs alone, by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("vllm_bench", ROOT / "scripts" / "vllm_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                    # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _row(path, budget, rps, ttft, share=None):
    return {"row": f"{path} {budget}", "path": path, "budget": budget, "throughput_rps": rps, "ttft_s": ttft,
            "prompt_tokens": 50.0, "visual_tokens": 20.0, "accuracy": None, "arr_coc_time_share": share,
            "arr_coc_flop_share": None if budget is None else 0.01, "images_per_encoder_call": 1.0 if share else None,
            "flops": {"e2e": 2e9}}


def test_ratios_are_the_largest_budget_over_every_token_on_each_path():
    b = _bench()
    rows = [_row("vllm", None, 2.0, 0.4), _row("vllm", "0.03", 9.0, 0.1, 0.1), _row("vllm", "0.1", 6.0, 0.2, 0.1),
            _row("hf", None, 1.0, 0.8), _row("hf", "0.1", 4.0, 0.2, 0.05)]
    got = b.ratios(rows, ["0.03", "0.1"])
    assert got["budget"] == "0.1"
    assert got["vllm"] == {"throughput": 3.0, "ttft": 0.5} and got["hf"] == {"throughput": 4.0, "ttft": 0.25}
    assert got["stock_vllm_over_hf_every_token"] == {"throughput": 2.0, "ttft": 0.5}


def test_the_markdown_table_has_a_row_per_measurement_and_the_ratios():
    b = _bench()
    rows = [_row("vllm", None, 2.0, 0.4), _row("vllm", "0.1", 6.0, 0.2, 0.1), _row("hf", None, 1.0, 0.8),
            _row("hf", "0.1", 4.0, 0.2, 0.05)]
    engine = {"load_s": 10.0, "max_num_batched_tokens": 4096, "prefix_caching": True, "threads_env": {}}
    report = {"command": "python scripts/vllm_bench.py", "args": {"max_tokens": 16, "flop_items": 1,
                                                                  "vllm_cores": "all"},
              "setups": [{"setup": {"label": "tiny", "n": 4, "ttft_k": 2, "hf_batch": 2},
                          "rows": rows, "ratios": b.ratios(rows, ["0.1"]),
                          "engines": {"stock": engine, "plugin": engine},
                          "hf": {"torch": "2", "torch_threads": 2, "load_s": 1.0}}],
              "host": {"cpus": 2, "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [1.0, 1.0, 1.0],
                       "wall_s": 60.0}}
    table = b.markdown(report)
    assert table.count("\n| ") == 1 + len(rows)                  # the header and one line per row
    assert "| vllm 0.1 | 6.00 | 200 | 50 | 20 | - | 10.0% | 1.00% | 2.00 |" in table
    assert "vLLM: ARR-COC 10% / stock: throughput x3.00, TTFT x0.50" in table


def test_the_kv_cache_holds_every_request_at_once():
    b = _bench()
    assert b.kv_bytes(1, 10, 1, 1, 1) == 256 * b.MiB                    # the floor
    per_token = 28 * 2 * 2 * 128 * 4                                     # 2B widths: 28 layers, K and V, float32
    assert b.kv_bytes(20, 1100, 28, 2, 128) >= 20 * 1100 * per_token


def _clip_bench():
    spec = importlib.util.spec_from_file_location("vllm_clip_bench", ROOT / "scripts" / "vllm_clip_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_evs_rates_keep_arr_cocs_share_or_evs_floor_of_one_frame_group():
    """vLLM's EVS keeps max(one group, int(total * (1 - q))) tokens (evs.py:16-35): the bench's rate for a share
    keeps that share where EVS can, and one whole group where the share asks for less."""
    b = _clip_bench()

    def retained(q: float, groups: int, per_group: int = 256) -> int:      # vLLM's compute_retained_tokens_count
        return max(per_group, int(groups * per_group * (1 - q)))

    assert b.evs_rate(0.3, 4) == 0.7 and retained(b.evs_rate(0.3, 4), 4) in (307, 308)
    for share, groups in ((0.03, 8), (0.05, 4), (0.1, 8)):                   # below one group: EVS's floor
        assert retained(b.evs_rate(share, groups), groups) == 256


def test_the_clip_tables_ratios_and_shares_are_read_from_each_rows_wall_time():
    b = _clip_bench()
    rows = [{"row": "stock", "throughput_rps": 0.5, "wall_s": 16.0, "ttft_s": 2.0, "visual_tokens": 1024.0,
             "choose_s": 0.0, "tower_s": 0.0},
            {"row": "arr_coc 5%", "throughput_rps": 2.0, "wall_s": 4.0, "ttft_s": 0.5, "visual_tokens": 51.0,
             "choose_s": 1.0, "tower_s": 0.5, "accuracy": 0.5},
            {"row": "HF evs 5%", "visual_tokens": 51.0, "accuracy": 0.25}]
    table = b.markdown({"setups": [{"label": "tiny", "rows": rows}]})
    assert "| arr_coc 5% | 2.00 | 4.00 | 0.500 | 51 | 0.500 | 25% | 12% |" in table
    assert "| HF evs 5% | - | - | - | 51 | 0.250 | - | - |" in table
