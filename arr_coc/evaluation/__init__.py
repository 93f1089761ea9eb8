"""Measuring ARR-COC against the published pruning methods.

loop.py    the evaluation loop (accuracy, coverage, tokens, FLOPs, latency per method and budget)
plans.py   how each method runs on a batch (the methods that need more than a SelectionContext)
flops.py   FLOP counting (attention kernels included) and selectors that count their own FLOPs
report.py  JSON, Markdown tables, paired 95% intervals, the plot
bench.py   prefill cost per budget on a Qwen2-VL-2B-shaped model
"""
