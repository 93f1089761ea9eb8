"""--device / --dtype / --attn-implementation: one meaning on every entry point (`arr_coc.runtime`), and a
bfloat16 VLM that answers through ARR-COC on all three families (CPU bf16 is real bf16 arithmetic).

What a user would notice: `--dtype bfloat16` silently running in float32, a method or an encoding mode
that breaks (or quietly keeps every token) in bf16, activations upcast behind their back, a wrong name or
`--device cuda` without a GPU answered with a traceback, a hub id forced offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arr_coc.__main__ import main
from arr_coc.runtime import ATTN_IMPLEMENTATIONS, DTYPE_CHOICES, Runtime, RuntimeChoiceError

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
HUB_ID = "some-org/an-uncached-vl-model"   # made up: never fetched
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what happens on a machine without a GPU")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """Each family's tiny random model saved (float32) like a checkpoint folder: what --model is given."""
    from arr_coc.qwen.tiny import build_tiny_qwen

    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model, processor = build_tiny_qwen(family, seed=0)
        model.save_pretrained(folder)
        processor.save_pretrained(str(folder))
        out[family] = str(folder)
    return out


@pytest.fixture(scope="module")
def image_file(tmp_path_factory, make_image) -> str:
    path = tmp_path_factory.mktemp("img") / "shapes.png"
    make_image(140, 168, seed=3).save(path)
    return str(path)


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> str:
    from arr_coc_shapes import write_split

    return str(write_split(tmp_path_factory.mktemp("shapes"), split="test", n=4, seed=0))


# ------------------------------------------------------------------------------------- resolving the names


@no_gpu
def test_auto_resolves_to_cpu_float32_here_and_names_mean_one_thing():
    assert Runtime.resolve() == Runtime(torch.device("cpu"), torch.float32, None)
    assert Runtime.resolve("auto", "auto").describe() == "cpu, float32, sdpa (default)"
    assert Runtime.resolve("cpu", "bfloat16", "eager") == Runtime(torch.device("cpu"), torch.bfloat16, "eager")
    assert Runtime.resolve(" CPU ", "torch.float16").dtype == torch.float16       # as torch prints it
    assert Runtime.resolve(torch.device("cpu"), torch.bfloat16).dtype == torch.bfloat16
    assert Runtime.resolve("cpu", None).dtype == torch.float32                    # None means auto


@pytest.mark.parametrize("kwargs, words", [
    ({"device": "tpu"}, "is not one of: auto (cuda when available, else cpu), cpu, cuda or cuda:N"),
    ({"device": "gpu"}, "is not one of: auto"),
    ({"device": "cuda:x"}, "is not one of: auto"),
    ({"dtype": "fp8"}, "dtype 'fp8' is not one of ['auto', 'float32', 'bfloat16', 'float16']"),
    ({"dtype": torch.int8}, "is not one of ['float32', 'bfloat16', 'float16']"),
    ({"attn_implementation": "flash"}, "attention implementation 'flash' is not one of ['sdpa', 'eager', "
                                       "'flash_attention_2']"),
])
def test_a_wrong_name_says_what_is_accepted(kwargs, words):
    with pytest.raises(RuntimeChoiceError) as info:
        Runtime.resolve(**kwargs)
    assert words in str(info.value)


def test_the_python_api_refuses_a_wrong_name_before_loading(model_dirs, tmp_path):
    from arr_coc.evaluation.loop import load_vlm
    from arr_coc.qwen import ARRCOCQwen

    missing = str(tmp_path / "not-a-model")   # nothing there: a name check that ran after loading would say so
    with pytest.raises(RuntimeChoiceError, match="dtype 'fp8' is not one of"):
        ARRCOCQwen.from_pretrained(missing, dtype="fp8")
    with pytest.raises(RuntimeChoiceError, match="device 'tpu' is not one of"):
        load_vlm(model_dirs["qwen2_vl"], device="tpu")
    with pytest.raises(RuntimeChoiceError, match="'flash_attention_2' runs on CUDA devices only"):
        load_vlm(model_dirs["qwen2_vl"], device="cpu", attn_implementation="flash_attention_2")
    with pytest.raises(RuntimeChoiceError, match="'flash_attention_2' runs on CUDA devices only"):
        ARRCOCQwen.from_pretrained(missing, device="cpu", attn_implementation="flash_attention_2")


@pytest.mark.parametrize("command", ["ask", "eval"])
def test_the_commands_refuse_wrong_names_with_runtimes_words(command, model_dirs, image_file, split, tmp_path,
                                                              capsys):
    base = {"ask": ["ask", "--model", model_dirs["qwen2_vl"], "--image", image_file, "--question", "What colour?"],
            "eval": ["eval", "--model", model_dirs["qwen2_vl"], "--data", split, "--out", str(tmp_path / "r.json"),
                     "--quiet"]}[command]
    with pytest.raises(SystemExit) as info:
        main([*base, "--device", "tpu"])
    assert str(info.value) == f"error: device 'tpu' is not one of: {'auto (cuda when available, else cpu), cpu, cuda or cuda:N'}"
    for option, wrong, accepted in (("--dtype", "fp8", DTYPE_CHOICES), ("--attn-implementation", "flash",
                                                                          ATTN_IMPLEMENTATIONS)):
        with pytest.raises(SystemExit) as info:
            main([*base, option, wrong])
        assert info.value.code == 2      # argparse: the choices are runtime.py's names
        err = capsys.readouterr().err
        assert f"invalid choice: '{wrong}'" in err and all(name in err for name in accepted)


@no_gpu
def test_cuda_without_a_gpu_is_one_clear_line_not_a_traceback(model_dirs, image_file, split, tmp_path):
    """Through the real command line (a subprocess), the way a user meets it."""
    done = subprocess.run([sys.executable, "-m", "arr_coc", "ask", "--model", model_dirs["qwen2_vl"], "--image",
                           image_file, "--question", "What colour?", "--device", "cuda"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "device 'cuda': this torch sees no CUDA device; use --device cpu (or auto)" in done.stderr
    with pytest.raises(SystemExit, match="this torch sees no CUDA device"):
        main(["eval", "--model", model_dirs["qwen2_vl"], "--data", split, "--out", str(tmp_path / "r.json"),
              "--device", "cuda:1"])
    with pytest.raises(SystemExit, match="'flash_attention_2' runs on CUDA devices only, not cpu; pass --device "
                                         "cuda, or --attn-implementation sdpa"):
        main(["ask", "--model", model_dirs["qwen2_vl"], "--image", image_file, "--question", "What colour?",
              "--attn-implementation", "flash_attention_2"])
    import app

    with pytest.raises(SystemExit, match="this torch sees no CUDA device"):
        app.main(["--model", model_dirs["qwen2_vl"], "--device", "cuda"])


# ------------------------------------------------------------------------------------- bfloat16 through ask


@pytest.mark.parametrize("encode", ["after", "before"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ask_in_bfloat16_answers_with_a_complete_trace(family, encode, model_dirs, image_file, capsys):
    code = main(["ask", "--model", model_dirs[family], "--image", image_file, "--question", "What colour is the "
                 "circle?", "--budget", "0.25", "--dtype", "bfloat16", "--encode", encode, "--max-new-tokens", "4",
                 "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runtime"] == "cpu, bfloat16, sdpa"         # as loaded, not as asked
    assert isinstance(out["answer"], str) and out["method"] == "arr_coc" and out["encode"] == encode
    assert 0 < out["kept_tokens"] < out["total_tokens"]
    # after: the tower encodes every cell; before: only the chosen ones
    assert (out["encoded_tokens"] == out["total_tokens"]) == (encode == "after")
    assert out["latency_s"] > 0 and out["vision_s"] > 0


def test_ask_stays_float32_on_the_cpu_by_default(model_dirs, image_file, capsys):
    """The control: without --dtype the same command runs in float32, as it always did on a CPU."""
    assert main(["ask", "--model", model_dirs["qwen2_vl"], "--image", image_file, "--question", "What colour?",
                 "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime"] == "cpu, float32, sdpa"


# ------------------------------------------------------------------------------------- bfloat16 through eval


@pytest.mark.parametrize("encode", ["after", "before"])
@pytest.mark.parametrize("family", FAMILIES)
def test_eval_in_bfloat16_reports_every_method(family, encode, model_dirs, split, tmp_path):
    out = tmp_path / "results.json"
    methods = "none,arr_coc,random,grid,downscale,oracle,fastv,visionzip,divprune,cdpruner"
    code = main(["eval", "--model", model_dirs[family], "--data", split, "--methods", methods, "--budgets", "0.25",
                 "--batch-size", "2", "--max-new-tokens", "2", "--dtype", "bfloat16", "--encode", encode,
                 "--out", str(out), "--quiet"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["runtime"] == "cpu, bfloat16, sdpa" and report["encode"]["mode"] == encode
    rows = {r["method"]: r for r in report["results"]}
    assert set(rows) == set(methods.split(","))
    before = {"arr_coc", "random", "grid", "oracle"}       # the methods that can choose before the tower
    for name, r in rows.items():
        assert r["status"] == "ok", (name, r.get("error"))    # strict: a keep-all fallback would fail the row
        assert r["n"] == 4 and 0.0 <= r["accuracy"] <= 1.0 and len(r["answers"]) == 4
        assert r["latency_s_median"] > 0 and r["prefill_flops_mean"] > 0 and r["vision_flops_mean"] > 0
        assert r["encode"] == (encode if name in before else "after")
        if name != "none":
            assert r["kept_tokens_mean"] < r["total_tokens_mean"]
    if encode == "before":   # the tower encoded only the chosen cells
        assert rows["arr_coc"]["vision_flops_mean"] < rows["none"]["vision_flops_mean"]


# ------------------------------------------------------------------------------------- the Python API in bf16


@pytest.mark.parametrize("family, dtype", [(f, "bfloat16") for f in FAMILIES] + [("qwen2_vl", "float16")])
def test_every_method_keeps_the_vlms_dtype(family, dtype, model_dirs, make_image):
    """The layer scores in float32 (its maps say so) while every token the language model reads, and every
    activation of its layers, stays in the VLM's dtype; no method fails or falls back in half precision."""
    from arr_coc.qwen import ARRCOCQwen
    from arr_coc.encode import EncodeConfig
    from arr_coc.pipeline.selection import available_methods

    wrapper = ARRCOCQwen.from_pretrained(model_dirs[family], dtype=dtype)
    want = getattr(torch, dtype)
    assert wrapper.runtime.dtype == want and wrapper.model.dtype == want
    seen: set[torch.dtype] = set()
    hooks = [layer.register_forward_hook(lambda m, a, o: seen.add((o[0] if isinstance(o, tuple) else o).dtype))
             for layer in wrapper.model.model.language_model.layers]
    image = make_image(112, 140, seed=1)
    inputs = wrapper.build_inputs([[image]], ["What colour is the circle?"])
    runs = [(m, "after") for m in available_methods() if m != "none"]
    runs += [(m, EncodeConfig("before", gist=0.25, margin=1, periphery=True)) for m in ("arr_coc", "random", "grid")]
    try:
        for method, encode in runs:
            pruned, (trace,) = wrapper.prepare(inputs, budget=0.3, method=method, encode=encode, strict=True).outputs
            assert {f.dtype for f in pruned.image_features} == {want}, method
            if pruned.deepstack_features is not None:
                assert {f.dtype for layer in pruned.deepstack_features for f in layer} == {want}
            assert trace.fallback == [None] and trace.error is None and trace.kept_tokens < trace.total_tokens
            if trace.arr_coc is not None:
                assert trace.arr_coc.relevance.dtype == torch.float32 and torch.isfinite(trace.arr_coc.relevance).all()
            logits = wrapper.backend.prefill(pruned).logits
            assert logits.dtype == want and torch.isfinite(logits.float()).all()
    finally:
        for h in hooks:
            h.remove()
    assert seen == {want}


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_in_bfloat16_fills_every_trace_field(family, model_dirs, make_image):
    from arr_coc.qwen import ARRCOCQwen

    wrapper = ARRCOCQwen.from_pretrained(model_dirs[family], device="cpu", dtype="bfloat16")
    for encode in ("after", "before"):
        answer, trace = wrapper.generate(make_image(112, 140, seed=2), "How many shapes?", budget=0.25,
                                         encode=encode, max_new_tokens=3)
        assert isinstance(answer, str) and trace.new_tokens >= 1 and trace.encode == encode
        assert 0 < trace.kept_tokens < trace.total_tokens and trace.kept_per_image == [trace.kept_tokens]
        assert trace.kept_indices[0].numel() == trace.kept_tokens and trace.grid_hw
        assert min(trace.vision_s, trace.select_s, trace.prefill_s, trace.total_s) > 0
        encoded = int(trace.encoded_cells[0].numel())
        assert encoded == (trace.total_tokens if encode == "after" else trace.kept_tokens)
        assert trace.arr_coc is not None and trace.fallback == [None] and trace.error is None


# ------------------------------------------------------------------------------------- the app and train-vlm


def test_the_app_takes_the_same_options_and_loads_in_bfloat16(model_dirs):
    from arr_coc_microscope import server

    args = server.parse_args(["--dtype", "bfloat16", "--attn-implementation", "eager", "--device", "cpu"])
    assert (args.device, args.dtype, args.attn_implementation) == ("cpu", "bfloat16", "eager")
    assert (server.parse_args([]).device, server.parse_args([]).dtype) == ("auto", "auto")
    scope = server.load(model_dirs["qwen3_vl"], device="cpu", dtype="bfloat16", attn_implementation="eager")
    assert scope.vlm.runtime.describe() == "cpu, bfloat16, eager"
    with pytest.raises(server.LoadError, match="dtype 'fp8' is not one of"):
        server.load(model_dirs["qwen3_vl"], dtype="fp8")


def test_train_vlm_keeps_its_cpu_float32_recipe(tmp_path):
    """It takes the options with the same names, but its recipe is CPU float32: anything else is refused
    before a step runs (nothing is written)."""
    from arr_coc_shapes.cli import main

    with pytest.raises(SystemExit, match="train-vlm trains the embedded toy model on the CPU in float32"):
        main(["train-vlm", "--out", str(tmp_path / "m"), "--state", str(tmp_path / "s.pt"), "--dtype", "bfloat16"])
    with pytest.raises(SystemExit, match="device 'tpu' is not one of"):
        main(["train-vlm", "--out", str(tmp_path / "m"), "--device", "tpu"])
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- the hub stays online


def test_nothing_forces_the_hub_offline_for_a_hub_id(monkeypatch, image_file, split, tmp_path):
    """ask, eval, the Python API and the app ask transformers for a hub id with HF_HUB_OFFLINE as the user left
    it (here: unset). The control: the app does set it for a local folder, and the recorder sees that."""
    import transformers

    from arr_coc.qwen import ARRCOCQwen, HubUnreachable
    from arr_coc_microscope import server

    seen: list[str | None] = []

    def record(path, *args, **kwargs):   # stands in for the hub: records the environment, fetches nothing
        seen.append(os.environ.get("HF_HUB_OFFLINE"))
        raise OSError("no route to the hub in the tests")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", record)
    with pytest.raises(SystemExit, match="could not load"):
        main(["ask", "--model", HUB_ID, "--image", image_file, "--question", "What colour?"])
    assert main(["eval", "--model", HUB_ID, "--data", split, "--out", str(tmp_path / "r.json"), "--quiet"]) == 2
    with pytest.raises(HubUnreachable, match="the Hugging Face hub could not be reached"):
        ARRCOCQwen.from_pretrained(HUB_ID)
    with pytest.raises(server.LoadError):
        server.load(HUB_ID, device="cpu")
    assert seen == [None, None, None, None] and "HF_HUB_OFFLINE" not in os.environ
    local = tmp_path / "a-local-folder"                 # a Qwen2-VL folder: its model loads through transformers
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "qwen2_vl"}')
    monkeypatch.setattr(transformers.Qwen2VLForConditionalGeneration, "from_pretrained", record)
    with pytest.raises(server.LoadError):
        server.load(str(local), device="cpu", retries=1)
    assert seen[-1] == "1"
