"""Benchmark-harness plugins: ARR-COC as a model of lmms-eval (`arr_coc.harness.lmms_eval`).

Installing the project (`make install`, an editable install) registers the entry point
`lmms_eval.models: arr_coc = arr_coc.harness:lmms_eval_models`, so lmms-eval 0.7.x runs

    python -m lmms_eval --model arr_coc --model_args pretrained=Qwen/Qwen2.5-VL-7B-Instruct,budget=0.1 \\
        --tasks textvqa_val,gqa,pope --batch_size 8

Importing this package imports neither lmms-eval nor torch; `requests.py` reads lmms-eval's requests
without lmms-eval, `lmms_eval.py` is the model class (it needs lmms-eval and accelerate installed).
"""

from __future__ import annotations

from typing import Any

MODEL_ID = "arr_coc"
CLASS_PATH = "arr_coc.harness.lmms_eval.ARRCOCLmms"


def lmms_eval_models() -> Any:
    """The entry point's payload: lmms-eval's `ModelManifest` naming the chat model class (lmms-eval calls
    this while it builds its model registry)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, chat_class_path=CLASS_PATH)


__all__ = ["CLASS_PATH", "MODEL_ID", "lmms_eval_models"]
