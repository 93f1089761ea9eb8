"""The shipped embedded model: loads offline through ARRCOCQwen and answers as well as its training log claims."""

from __future__ import annotations

import json
import os
import time

import pytest

from arr_coc.data import make_item, score
from arr_coc.embedded import DEFAULT_CHECKPOINT

N_ITEMS = 48
MARGIN = 0.15  # ~2 standard errors of a 48-item accuracy


def _claimed_accuracy() -> float:
    with open(os.path.join(DEFAULT_CHECKPOINT, "training_log.json")) as f:
        log = json.load(f)["log"]
    vals = [r["val"]["accuracy"] for r in log if "val" in r]
    assert vals, "the training log holds no validation entry"
    return vals[-1]


def test_shipped_checkpoint_loads_offline_and_keeps_its_claimed_accuracy():
    from arr_coc.model import ARRCOCQwen

    assert os.path.isfile(os.path.join(DEFAULT_CHECKPOINT, "model.safetensors")), "checkpoint missing from checkpoints/"
    assert os.path.getsize(os.path.join(DEFAULT_CHECKPOINT, "model.safetensors")) < 50 * 2**20
    wrapper = ARRCOCQwen.from_pretrained(DEFAULT_CHECKPOINT)
    items = [make_item(4242, "regress", i, canvas="random" if i % 3 == 0 else (448, 448)) for i in range(N_ITEMS)]
    answers, traces = wrapper.generate([[it.image] for it in items], [it.record["question"] for it in items],
                                       method="none", max_new_tokens=4)
    acc = sum(score(a, it.record["answers"]) for a, it in zip(answers, items)) / N_ITEMS
    assert acc >= _claimed_accuracy() - MARGIN, (acc, _claimed_accuracy())
    assert all(t.kept_tokens == t.total_tokens for t in traces)


def test_the_default_model_answers_one_question_quickly():
    from arr_coc.model import ARRCOCQwen

    start = time.perf_counter()
    wrapper = ARRCOCQwen.from_pretrained(DEFAULT_CHECKPOINT)
    item = make_item(4242, "regress", 0)
    answer, trace = wrapper.generate(item.image, item.record["question"], budget=0.25, max_new_tokens=4)
    elapsed = time.perf_counter() - start
    assert isinstance(answer, str) and answer and "?" not in answer
    assert trace.kept_tokens == 64 and trace.total_tokens == 256
    assert elapsed < 10.0  # the target is < 2 s on an idle 2-core CPU; CI hosts may be busy


def test_the_shipped_trained_layer_is_the_default_only_for_the_embedded_model(tmp_path):
    from arr_coc.cli_ask import UNTRAINED, default_layer_path, resolve_layer

    assert resolve_layer(DEFAULT_CHECKPOINT, UNTRAINED) is None
    assert resolve_layer(DEFAULT_CHECKPOINT, "some/layer") == "some/layer"
    # another model's embeddings do not fit the shipped scorers: untrained unless asked
    assert resolve_layer(str(tmp_path), None) is None
    assert resolve_layer("Qwen/Qwen2-VL-2B-Instruct", None) is None
    assert resolve_layer(DEFAULT_CHECKPOINT, None) == default_layer_path()
