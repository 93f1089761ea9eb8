"""LoRA adapters (issue 47): active only where tokens were pruned, saved and loaded in peft's format, refused when
they do not fit, costed, trained without moving the frozen VLM.

Every model here is built fresh (peft injects its layers into the model it is given; the session's shared tiny
models stay untouched). The adapters' LoRA B matrices are set non-zero (seeded), so an adapter that ran where it
should not would change the logits."""

from __future__ import annotations

from _pruned import forward_pruned, prepare_state  # noqa: F401
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from arr_coc.qwen import ARRCOCQwen
from arr_coc.qwen.adapter import AdapterError, attach_adapter
from arr_coc.qwen.tiny import build_tiny_qwen

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _adapted(family: str, rank: int = 4, **overrides):
    """(wrapper with a non-zero adapter, the same model without one), from one seed."""
    model, processor = build_tiny_qwen(family, seed=0, **overrides)
    stock, _ = build_tiny_qwen(family, seed=0, **overrides)
    adapter = attach_adapter(model, rank=rank, alpha=2.0 * rank)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return ARRCOCQwen(model, processor, adapter=adapter), ARRCOCQwen(stock, processor)


def _inputs(wrapper, make_image):
    return wrapper.build_inputs([[make_image(112, 140, 1)], [make_image(84, 112, 2)]],
                                ["What color is the circle?", "How many shapes are there?"])


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_kept_is_the_stock_model_and_pruned_is_not(family, make_image):
    vlm, stock = _adapted(family)
    inputs = _inputs(vlm, make_image)
    for encode in ("after", "before"):
        for kw in ({"method": "none"}, {"budget": 1.0}):          # nothing chosen, and a choice of every cell
            got, want = forward_pruned(vlm, encode=encode, **kw, **inputs), forward_pruned(stock, encode=encode, **kw,
                                                                                                 **inputs)
            assert torch.equal(got.logits, want.logits), (encode, kw)
            assert [t.adapter for t in got.traces] == ["", ""]
        got, want = forward_pruned(vlm, budget=0.25, encode=encode, **inputs), \
            forward_pruned(stock, budget=0.25, encode=encode, **inputs)
        assert [t.kept_indices[0].tolist() for t in got.traces] == [t.kept_indices[0].tolist() for t in want.traces]
        assert (got.logits - want.logits).abs().max() > 1e-3, encode        # the negative control: it does run
        assert [t.to_dict()["adapter"] for t in got.traces] == ["adapter", "adapter"]


def test_a_batch_of_both_runs_the_adapter_for_the_pruned_row_only(make_image):
    from arr_coc.pipeline.request import Pruning

    vlm, stock = _adapted("qwen2_vl")
    inputs = _inputs(vlm, make_image)
    n = [t.total_tokens for t in prepare_state(stock, inputs, method="none").traces]
    kept = [torch.arange(n[0]), torch.arange(0, n[1], 3)]
    for encode in ("after", "before"):
        got = forward_pruned(vlm, kept_indices=kept, encode=encode, **inputs)
        want = forward_pruned(stock, kept_indices=kept, encode=encode, **inputs)
        assert [t.adapter for t in got.traces] == ["", "adapter"]
        assert torch.equal(got.logits[0], want.logits[0])
        assert (got.logits[1] - want.logits[1]).abs().max() > 1e-3
        mine = vlm.answer(inputs, Pruning.of(kept_indices=kept, encode=encode), max_new_tokens=3)
        theirs = stock.answer(inputs, Pruning.of(kept_indices=kept, encode=encode), max_new_tokens=3)
        assert torch.equal(mine.sequences[0], theirs.sequences[0]) and mine.sequences.shape == theirs.sequences.shape


def _switch_state(adapter) -> tuple:
    """What peft's switch and the adapter's own decide: every tuner layer's flag and active adapters, every
    parameter's requires_grad."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = adapter.model
    return ([(n, m.disable_adapters, tuple(m.active_adapters)) for n, m in model.named_modules()
             if isinstance(m, BaseTunerLayer)], [(n, p.requires_grad) for n, p in model.named_parameters()])


@pytest.mark.parametrize("trainable", [False, True])
def test_the_adapter_s_switch_leaves_what_peft_s_switch_leaves(trainable, make_image):
    from arr_coc.qwen.adapter import _fast_switch

    fast, _ = _adapted("qwen2_vl")
    slow, _ = _adapted("qwen2_vl")
    slow.adapter._tuners = None                       # peft's own switch, walking the model
    lora = [m for m in fast.adapter.model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")]
    assert fast.adapter._tuners == lora and len(lora) == 16     # the tiny model's 2 blocks x 4 + 2 layers x 4, found once
    inputs = _inputs(fast, make_image)
    for a in (fast.adapter, slow.adapter):
        a.trainable = trainable
    for on in (True, False, True):
        with fast.adapter.active(on), slow.adapter.active(on):
            assert _switch_state(fast.adapter) == _switch_state(slow.adapter)
            assert all(m.disable_adapters is not on for m in fast.adapter._tuners)
    assert _switch_state(fast.adapter) == _switch_state(slow.adapter)          # off again, as built
    got, want = (forward_pruned(v, budget=0.25, encode="before", **inputs) for v in (fast, slow))
    assert torch.equal(got.logits, want.logits) and [t.adapter for t in got.traces] == ["adapter", "adapter"]
    # the guard: a tuner layer without peft's flag sends the adapter to peft's switch
    flag = fast.adapter._tuners[0].__dict__.pop("_disable_adapters")
    assert _fast_switch(fast.adapter.model) is None
    fast.adapter._tuners[0].__dict__["_disable_adapters"] = flag
    assert _fast_switch(fast.adapter.model) == fast.adapter._tuners


def _hub_cache(tmp_path: Path, folder: Path, repo: str) -> Path:
    cache = tmp_path / "hub"
    root = cache / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / COMMIT)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    return cache


def test_save_and_load_a_folder_and_a_hub_cache_offline(tmp_path, make_image, monkeypatch):
    import huggingface_hub.constants

    vlm, _ = _adapted("qwen2_vl")
    inputs = _inputs(vlm, make_image)
    want = forward_pruned(vlm, budget=0.25, encode="before", **inputs).logits
    vlm.save_pretrained(tmp_path / "pair")                               # the layer + adapter/ beside it
    names = sorted(p.name for p in (tmp_path / "pair" / "adapter").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "arr_coc_adapter.json"} <= set(names)
    model, processor = build_tiny_qwen("qwen2_vl", seed=0)
    again = ARRCOCQwen(model, processor, arr_coc=str(tmp_path / "pair"), adapter=str(tmp_path / "pair"))
    assert torch.equal(forward_pruned(again, budget=0.25, encode="before", **inputs).logits, want)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE",
                        str(_hub_cache(tmp_path, tmp_path / "pair" / "adapter", "someone/tiny-adapter")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, processor = build_tiny_qwen("qwen2_vl", seed=0)
    hub = ARRCOCQwen(model, processor, arr_coc=str(tmp_path / "pair"), adapter="someone/tiny-adapter")
    out = forward_pruned(hub, budget=0.25, encode="before", **inputs)
    assert torch.equal(out.logits, want) and out.traces[0].adapter == "someone/tiny-adapter"
    with pytest.raises(AdapterError, match="someone/missing.*not in the Hugging Face cache"):
        ARRCOCQwen(model, processor, adapter="someone/missing")


def _refused(model, processor, adapter, match: str) -> None:
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(AdapterError, match=match) as info:
        ARRCOCQwen(model, processor, adapter=adapter)
    handle.remove()
    assert "\n" not in str(info.value) and not calls          # one line, before the model ran
    assert not any(".lora_" in n for n, _ in model.named_parameters())   # nothing was injected


def test_a_missing_or_unfit_adapter_is_refused_in_one_line_before_the_model_runs(tmp_path, monkeypatch):
    vlm, _ = _adapted("qwen2_vl")
    vlm.adapter.save_pretrained(tmp_path / "a")
    _refused(*build_tiny_qwen("qwen2_vl"), str(tmp_path / "nowhere"), "no adapter at .*no such folder")
    _refused(*build_tiny_qwen("qwen2_5_vl"), str(tmp_path / "a"), "another base model .*model_type")
    _refused(*build_tiny_qwen("qwen2_vl", vision_config={"depth": 3}), str(tmp_path / "a"), "vision.depth")
    (tmp_path / "a" / "arr_coc_adapter.json").unlink()       # a plain peft folder: its shapes are still checked
    _refused(*build_tiny_qwen("qwen2_vl", vision_config={"embed_dim": 48}), str(tmp_path / "a"), "has shape")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))   # another rank
    _refused(*build_tiny_qwen("qwen2_vl"), str(tmp_path / "a"), "at rank 8")
    from arr_coc.qwen import loading

    monkeypatch.setattr(loading, "load_vlm", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(AdapterError, match="no adapter at"):
        ARRCOCQwen.from_pretrained("checkpoints/shapes-qwen2vl", adapter=str(tmp_path / "nowhere"))


def _broken(folder: Path, how: str) -> str:
    """Break a saved adapter folder one way; -> the file the refusal must name."""
    weights, config, base = (folder / n for n in ("adapter_model.safetensors", "adapter_config.json",
                                                  "arr_coc_adapter.json"))
    if how == "truncated weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "empty weights":
        weights.write_bytes(b"")
    elif how == "weights not safetensors":
        weights.write_text("not a tensor file")
    elif how == "corrupt config":
        config.write_text('{"r": 4, "peft_type": "LORA", ')
    elif how == "config a list":
        config.write_text("[1, 2]")
    elif how == "rank not a number":
        config.write_text(json.dumps({**json.loads(config.read_text()), "r": "four"}))
    elif how == "corrupt base file":
        base.write_bytes(b"\xff\xfe{")
    return {"config": "adapter_config.json", "rank": "adapter_config.json",
            "base": "arr_coc_adapter.json"}.get(how.split()[1] if how.startswith("corrupt") else how.split()[0],
                                                "adapter_model.safetensors")


BROKEN = ("truncated weights", "empty weights", "weights not safetensors", "corrupt config", "config a list",
          "rank not a number", "corrupt base file")


@pytest.mark.parametrize("how", BROKEN)
def test_a_broken_adapter_folder_is_refused_naming_the_file_api_and_cli(how, tmp_path, capsys):
    """Issue 55: a truncated weights file ended in a raw SafetensorError, a corrupt config in a JSONDecodeError (API)
    and "could not load a Qwen-VL model" (CLI: the wrong blame). Now: AdapterError naming the file; exit 2."""
    from arr_coc.cli import main

    vlm, _ = _adapted("qwen2_vl")
    vlm.adapter.save_pretrained(tmp_path / "a")
    name = _broken(tmp_path / "a", how)
    _refused(*build_tiny_qwen("qwen2_vl"), str(tmp_path / "a"), name)
    try:
        rc = main(["ask", "--image", "assets/examples/shapes_letter.png", "--question", "What letter?",
                   "--adapter", str(tmp_path / "a"), "--budget", "0.1"])
    except SystemExit as exit_:
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2 and name in err and "Traceback" not in err, err
    assert "Qwen-VL model" not in err and len(err.strip().splitlines()) == 1, err


def test_the_adapters_flops_are_in_the_cost_when_it_ran_and_only_then(make_image):
    from arr_coc.evaluation.cost import item_flops
    from arr_coc.evaluation.flops import count_flops
    from arr_coc.pipeline.request import Pruning

    rank = 4
    vlm, stock = _adapted("qwen2_vl", rank=rank)
    # by hand, the tiny Qwen2-VL: tower 2 blocks of width 32 (qkv 32->96, proj 32->32, fc1 32->64, fc2 64->32), LM 2
    # layers of width 64 (q 64->64, k 64->32, v 64->32, o 64->64); 2 r (d_in + d_out) per token per linear
    tower = 2 * (2 * rank * ((32 + 96) + (32 + 32) + (32 + 64) + (64 + 32)))
    lm = 2 * (2 * rank * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64)))
    assert vlm.adapter.flops_per_token() == (tower, lm) == (6144, 7168)
    inputs = _inputs(vlm, make_image)
    for encode in ("before", "after"):
        done = vlm.answer(inputs, Pruning.of("arr_coc", 0.25, encode=encode), max_new_tokens=1)
        base = stock.answer(inputs, Pruning.of("arr_coc", 0.25, encode=encode), max_new_tokens=1)
        got, want = item_flops(vlm.backend, done, 0, 0.0, {}), item_flops(stock.backend, base, 0, 0.0, {})
        for b, (f, g, tr) in enumerate(zip(got, want, done.traces)):
            cells = sum(int(c.numel()) for c in tr.encoded_cells) if encode == "before" else 0   # "after": stock tower
            extra = cells * 4 * tower + tr.prompt_tokens * lm                 # 4 patches per merged cell
            assert f.adapter == extra and f.whole == g.whole + extra and f.lm == g.lm + tr.prompt_tokens * lm
            alone = done.first.pruned.rows([b])                               # the counter agrees with the arithmetic
            with vlm.backend.adapted(True):
                on = count_flops(vlm.backend.model, **alone.model_kwargs(), logits_to_keep=1)[1]
            off = count_flops(stock.backend.model, **alone.model_kwargs(), logits_to_keep=1)[1]
            assert on - off == tr.prompt_tokens * lm
    none = vlm.answer(inputs, Pruning.of("none"), max_new_tokens=1)
    assert [f.adapter for f in item_flops(vlm.backend, none, 0, 0.0, {})] == [0, 0]


def test_the_tower_adapter_counts_as_the_arithmetic_says(make_image):
    from arr_coc.evaluation.flops import count_flops

    vlm, _ = _adapted("qwen2_vl")
    prompt = prepare_state(vlm, _inputs(vlm, make_image), method="none", encode="before").batch
    cells = [torch.arange(0, 12).numpy()]
    off = count_flops(vlm.backend.encode_cells, prompt, [0], cells)[1]
    with vlm.backend.adapted(True):
        on = count_flops(vlm.backend.encode_cells, prompt, [0], cells)[1]
    assert on - off == vlm.backend.adapter_flops(12, 0)


def _snapshot(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _shipped():
    from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_BEFORE_LAYER

    return ARRCOCQwen.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_BEFORE_LAYER, adapter=False), EMBEDDED_MODEL, \
        SHIPPED_BEFORE_LAYER


@pytest.mark.parametrize("stage", ["frozen", "joint"])
def test_two_steps_move_the_adapter_and_in_joint_the_layer_and_never_the_vlm(stage, tmp_path):
    from arr_coc.training.adapter import AdapterTrainConfig, train_adapter
    from arr_coc_shapes.adapter_items import ShapesSource

    wrapper, model, layer = _shipped()
    vlm, net = _snapshot(wrapper.model), _snapshot(wrapper.arr_coc_layer)
    cfg = AdapterTrainConfig(out=str(tmp_path / "pair"), stage=stage, steps=2, batch_size=2, val_items=2,
                             eval_every=100, rank=4, lr=1e-2, layer_lr=1e-2, warmup=1)
    state = train_adapter(cfg, model, layer, progress=False, vlm=wrapper, items=ShapesSource())
    assert state["step"] == 2 and all(r["grad_norm"] for r in state["log"])
    after = _snapshot(wrapper.model)
    lora = [n for n in after if ".lora_" in n]
    assert lora and all(not torch.equal(after[n], torch.zeros_like(after[n])) for n in lora if "lora_B" in n)
    base = {n.replace(".base_layer", ""): p for n, p in after.items() if n not in lora}   # peft wraps each linear
    assert set(base) == set(vlm)
    assert all(torch.equal(base[n], vlm[n]) for n in vlm), "the frozen VLM moved"
    moved = [n for n, p in wrapper.arr_coc_layer.named_parameters() if not torch.equal(p, net[n])]
    assert bool(moved) == (stage == "joint")
    folder = tmp_path / "pair" / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md", "training_loss.png",
                 "training_log_adapter.json"):
        assert (folder / name).is_file(), name


def test_a_stopped_run_resumes_to_the_same_adapter(tmp_path):
    from arr_coc.training.adapter import AdapterTrainConfig, train_adapter
    from arr_coc_shapes.adapter_items import ShapesSource

    def run(out, **kw):
        wrapper, model, layer = _shipped()
        cfg = AdapterTrainConfig(out=str(out), steps=2, batch_size=2, val_items=2, eval_every=100, rank=4, lr=1e-2,
                                 warmup=1, hard=True)
        train_adapter(cfg, model, layer, progress=False, vlm=wrapper, items=ShapesSource(), **kw)
        return wrapper

    straight = _snapshot(run(tmp_path / "a").model)
    run(tmp_path / "b", stop_after=1)
    resumed = _snapshot(run(tmp_path / "b", resume=True).model)
    assert all(torch.equal(straight[n], resumed[n]) for n in straight if ".lora_" in n)


def test_hard_items_oversample_the_named_types():
    from arr_coc.training.adapter import AdapterTrainConfig, type_weights
    from arr_coc_shapes.adapter_items import ShapesItems, ShapesSource

    cfg = AdapterTrainConfig(hard=True, hard_types=("count",), hard_weight=4, val_items=1)
    weights = type_weights(cfg)
    assert weights == {"count": 4}
    assert ShapesSource().draw(cfg, 3, weights)[0].hard_rate == 0.42       # 0.3 x 4, at the generator's ceiling
    plain = [ShapesItems(3, "x", 60)[i][3] for i in range(60)]
    hard = [ShapesItems(3, "x", 60, weights)[i][3] for i in range(60)]
    assert hard.count("count") > 2 * plain.count("count")
    with pytest.raises(ValueError, match="hard types"):
        ShapesSource().check(AdapterTrainConfig(hard_types=("colour",)))


def test_jsonl_items_hold_out_validation_and_oversample_by_weight(tmp_path):
    from arr_coc_shapes import write_split
    from arr_coc.data import read_jsonl
    from arr_coc.training.adapter_items import JsonlItems, answer_to_learn

    split = write_split(tmp_path, "train", n=40, seed=4)
    data, val = JsonlItems.split([str(split)], n=200, val_items=8, seed=1)
    assert len(val) == len(data.held_ids) == 8 and len(data.records) == 32
    assert not set(data.held_ids) & {r.id for r in data.records}           # never trained on
    assert sorted(q for _, q, _, _ in val) == sorted(r.question for r in read_jsonl(split) if r.id in data.held_ids)
    seen = [data[i][1] for i in range(64)]
    assert seen == [data[i][1] for i in range(64)]                          # deterministic in the index
    assert sorted(seen[:32]) == sorted(r.question for r in data.records)   # one pass: each record once
    assert seen[:32] != seen[32:]                                           # the next pass, a new order
    plain = [data[i][3] for i in range(200)]
    hard = JsonlItems(data.records, 200, 1, {"count": 4})
    assert [hard[i][3] for i in range(200)].count("count") > 2 * plain.count("count")
    assert answer_to_learn(["2", "3", "3", "2", "3"]) == "3" and answer_to_learn(["a", "b"]) == "a"
    with pytest.raises(ValueError, match="no record .* has that type"):
        JsonlItems.split([str(split)], 10, 2, 0, {"color_of_sky": 2})


def test_train_adapter_runs_on_a_jsonl_split_and_refuses_a_missing_one(tmp_path, capsys):
    from arr_coc.__main__ import main
    from arr_coc_shapes import write_split

    split = write_split(tmp_path / "data", "train", n=12, seed=4)
    out = tmp_path / "pair"
    assert main(["train-adapter", "--data", str(split), "--steps", "2", "--batch-size", "2", "--val-items", "2",
                 "--rank", "2", "--out", str(out), "--quiet"]) == 0
    card = (out / "adapter" / "README.md").read_text()
    assert "train.jsonl" in card and "ShapesVQA items" not in card
    assert "from arr_coc import ARRCOC\n" in card and "ARRCOC.from_pretrained(" in card
    log = json.loads((out / "adapter" / "training_log_adapter.json").read_text())
    assert log["config"]["data"] == [str(split)]
    assert main(["train-adapter", "--data", str(tmp_path / "nothing.jsonl"), "--out", str(out)]) == 2
    assert "--data" in capsys.readouterr().err


def _train_adapter_refusal(argv: list[str], capsys, workbench: bool = False) -> str:
    """train-adapter's one line for argv (exit 2, no traceback), checked before any model loads; `workbench`: the
    checkout's `python -m arr_coc_shapes train-adapter` (ShapesVQA drawn on the fly)."""
    from arr_coc.__main__ import main as library
    from arr_coc.qwen import loading
    from arr_coc_shapes.cli import main as shapes

    main = shapes if workbench else library

    saved, loading.load_vlm = loading.load_vlm, lambda *a, **k: pytest.fail("the model loaded")
    try:
        rc = main(["train-adapter", *argv, "--quiet"])
    finally:
        loading.load_vlm = saved
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_train_adapter_refuses_bad_data_and_options_in_one_line_naming_the_cause(tmp_path, capsys):
    """Issue 55: a malformed line, an empty split, a split smaller than --val-items, --rank 0/-1, an --out that
    cannot be written and --steps 0 each ended in a traceback (or, --steps 0, wrote an untrained adapter)."""
    from arr_coc_shapes import write_split

    split = write_split(tmp_path / "data", "train", n=12, seed=4)
    bad = tmp_path / "data" / "bad.jsonl"
    bad.write_text(split.read_text().splitlines()[0] + "\n{not json\n")
    empty = tmp_path / "data" / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "a-file").write_text("x")
    out = ["--out", str(tmp_path / "pair")]
    data = ["--data", str(split), "--val-items", "2"]
    cases = [
        ([*out], "no --data: give JSONL splits .*`python -m arr_coc_shapes train-adapter`"),
        (["--data", str(bad), *out], "bad.jsonl.*line 2"),
        (["--data", str(empty), *out], "no records"),
        (["--data", str(split), *out], "12 records and --val-items 32 .* pass --val-items 3"),
        (["--rank", "0", *out], "--rank 0"),
        (["--rank", "-1", *out], "--rank -1"),
        (["--steps", "0", *out], "--steps 0"),
        ([*data, "--out", str(tmp_path / "a-file")], "--out .*a-file: cannot write there"),
        ([*data, "--out", str(tmp_path / "a-file" / "under")], "cannot write there"),
    ]
    for argv, words in cases:
        err = _train_adapter_refusal(argv, capsys)
        assert __import__("re").search(words, err), (argv, err)
    for argv, words in [(["--hard", "--hard-types", "colour", *out], "arr_coc_shapes train-adapter: error: hard types"),
                        (["--out", str(tmp_path / "a-file")], "--out .*a-file: cannot write there")]:
        err = _train_adapter_refusal(argv, capsys, workbench=True)
        assert __import__("re").search(words, err), (argv, err)
    assert not (tmp_path / "pair" / "adapter").exists()


def test_train_adapter_resume_without_a_state_says_it_starts_fresh(tmp_path, capsys):
    from arr_coc.__main__ import main
    from arr_coc_shapes import write_split

    split = write_split(tmp_path / "data", "train", n=12, seed=4)
    assert main(["train-adapter", "--data", str(split), "--steps", "1", "--batch-size", "2", "--val-items", "2",
                 "--rank", "2", "--out", str(tmp_path / "pair"), "--quiet", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "--resume: no saved state in" in err and "starting fresh" in err, err


def test_eval_and_ask_take_an_adapter_and_pair_rows_with_and_without_it(tmp_path, capsys):
    from arr_coc.__main__ import main
    from arr_coc.paths import EMBEDDED_MODEL
    from arr_coc_shapes import write_split

    wrapper, _, _ = _shipped()
    adapter = attach_adapter(wrapper.model, rank=4, alpha=8.0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.add_(0.05)
    adapter.save_pretrained(tmp_path / "adapter")
    split = str(write_split(tmp_path / "shapes", split="test", n=4, seed=0))
    out = tmp_path / "r.json"
    assert main(["eval", "--model", EMBEDDED_MODEL, "--data", split, "--encode", "before", "--budgets", "0.05",
                 "--methods", "none,arr_coc_trained@before-adapter,arr_coc_trained@before+adapter", "--quiet",
                 "--adapter", str(tmp_path / "adapter"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    assert report["adapter"] == str(tmp_path / "adapter")
    assert rows["none"]["adapter_flops_mean"] == rows["arr_coc_trained@before-adapter"]["adapter_flops_mean"] == 0
    plus, minus = rows["arr_coc_trained@before+adapter"], rows["arr_coc_trained@before-adapter"]
    assert plus["adapter_flops_mean"] > 0 and plus["item_kept"] == minus["item_kept"]     # the same cells
    assert plus["e2e_flops_mean"] == minus["e2e_flops_mean"] + plus["adapter_flops_mean"]
    image = next((tmp_path / "shapes" / "images").iterdir())
    capsys.readouterr()
    for method, ran in (("arr_coc", str(tmp_path / "adapter")), ("none", "")):
        assert main(["ask", "--image", str(image), "--question", "What color is the star?", "--method", method,
                     "--encode", "before", "--budget", "0.05", "--adapter", str(tmp_path / "adapter"), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["adapter"] == ran
    assert main(["ask", "--image", str(image), "--question", "Why?", "--adapter", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no adapter at" in err and "\n" not in err
    assert main(["eval", "--data", split, "--methods", "arr_coc@before+adapter", "--out", str(out)]) == 2
    assert "no --adapter FOLDER" in capsys.readouterr().err


def test_eval_runs_the_trained_layers_own_adapter_by_default_for_its_rows_only(tmp_path):
    """eval --encode before on the embedded model: the shipped before-layer's adapter/ is on by default for the
    trained layer's rows (arr_coc_trained) and for no other method's; --no-adapter turns it off (the control)."""
    from arr_coc.__main__ import main
    from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_BEFORE_LAYER, shown_path
    from arr_coc_shapes import write_split

    split = str(write_split(tmp_path / "shapes", split="test", n=2, seed=0))
    reports = {}
    for flag in ([], ["--no-adapter"]):
        out = tmp_path / f"r{len(flag)}.json"
        assert main(["eval", "--model", EMBEDDED_MODEL, "--data", split, "--encode", "before", "--budgets", "0.05",
                     "--methods", "none,random,arr_coc_trained", "--quiet", *flag, "--out", str(out)]) == 0
        report = json.loads(out.read_text())
        reports[bool(flag)] = (report["adapter"], {r["method"]: r["adapter_flops_mean"] for r in report["results"]})
    default, off = reports[False], reports[True]
    assert default[0] == shown_path(SHIPPED_BEFORE_LAYER) and off[0] is None
    assert default[1]["arr_coc_trained"] > 0 and default[1]["random"] == default[1]["none"] == 0
    assert set(off[1].values()) == {0}


def test_the_page_offers_a_layer_with_and_without_its_shipped_adapter_side_by_side():
    from arr_coc_shapes import make_item
    from arr_coc_microscope.configs import layer_for_mode
    from arr_coc_microscope.handler import ask
    from arr_coc_microscope.server import add_layers, load, parse_args, shipped_before_layer

    scope = load(None, device="cpu")
    scope.count_flops = False                                                  # not what this test is about
    add_layers(scope, shipped_before_layer(scope, parse_args([])))
    alone, adapted = [name for name in scope.layers if "arr-coc-shapes-before" in name]
    main = next(iter(scope.layers))
    assert adapted == alone + " + adapter" and scope.default_compare == (adapted, "before")   # B's default (issue 55)
    assert layer_for_mode(scope, main, "before") == adapted and layer_for_mode(scope, adapted, "after") == main
    assert layer_for_mode(scope, alone, "before") == alone                     # the user's choice of the layer alone
    image, record, _ = make_item(0, "test", 5)
    result = ask(scope, image, record["question"], budget="3%", layer=alone, encode="before", compare_layer=adapted,
                 compare_encode="before")
    row = dict((r[0], r[1:]) for r in result.stats)["adapter"]
    assert row[0] == "-" and row[1] == "-" and row[2].endswith("arr-coc-shapes-before")   # baseline, A, B


def test_the_layer_folder_s_own_adapter_is_on_by_default_and_off_when_asked(tmp_path, capsys):
    """Issue 55: the adapter beside the before-mode layer lifts accuracy at every budget, yet it ran only when asked.
    Now `from_pretrained(arr_coc=folder)` and `ask` load the folder's adapter/ when it was trained for this model;
    `adapter=False` / `--no-adapter` turn it off; a layer without one, or one for another model, runs alone."""
    from arr_coc.__main__ import main
    from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_BEFORE_LAYER, SHIPPED_LAYER
    from arr_coc.qwen.adapter import layer_adapter

    if not os.path.isdir(os.path.join(SHIPPED_BEFORE_LAYER, "adapter")):
        pytest.skip("this checkout ships no adapter")
    on = ARRCOCQwen.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_BEFORE_LAYER)
    assert on.adapter is not None and on.adapter.name.endswith("arr-coc-shapes-before")
    assert ARRCOCQwen.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_BEFORE_LAYER, adapter=False).adapter is None
    assert ARRCOCQwen.from_pretrained(EMBEDDED_MODEL, arr_coc=SHIPPED_LAYER).adapter is None      # it holds none
    model = on.model
    assert layer_adapter(SHIPPED_BEFORE_LAYER, build_tiny_qwen("qwen2_vl")[0], "tiny") is None   # another base
    other = tmp_path / "layer"
    shutil.copytree(SHIPPED_BEFORE_LAYER, other)
    base = json.loads((other / "adapter" / "arr_coc_adapter.json").read_text())
    base["card"]["vlm"] = "someone/another-finetune"                 # the same architecture, another model
    (other / "adapter" / "arr_coc_adapter.json").write_text(json.dumps(base))
    assert layer_adapter(str(other), model, EMBEDDED_MODEL) is None
    argv = ["ask", "--image", "assets/examples/shapes_letter.png", "--question", "What letter is on the blue circle?",
            "--budget", "0.05", "--encode", "before", "--max-new-tokens", "2", "--json"]
    names = []
    for extra in ([], ["--no-adapter"]):
        assert main(argv + extra) == 0
        names.append(json.loads(capsys.readouterr().out)["adapter"])
    assert names[0].endswith("arr-coc-shapes-before") and names[1] == ""
