"""ARR-COC as an lmms-eval model (arr_coc/harness/), against lmms-eval 0.7.3 itself.

lmms-eval is installed by `make install` without its dependencies (requirements-lmms.txt: its metadata asks
for torchvision); the project is installed editable, so its `lmms_eval.models` entry point exists. What a
user would notice: `--model arr_coc` not found; lmms-eval's score differing from `python -m arr_coc eval`
on the same items, method and budget; a request layout lmms-eval sends that the model misreads; a batch
answering differently from its items alone; an unsupported request answered with something instead of an
error that says what to do; several processes not sharing the work.

lmms-eval's evaluator runs in subprocesses (`python -m lmms_eval`, and under `torchrun` with two CPU
processes): it patches process-wide state (file locks, seeds, logging) that the rest of the suite must not
inherit. The embedded model (checkpoints/shapes-qwen2vl) with its shipped layer answers 10 ShapesVQA items.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("lmms_eval", reason="lmms-eval is not installed: `make install` installs it (requirements-lmms.txt)")

from arr_coc.harness import requests as rq  # noqa: E402
from arr_coc.paths import EMBEDDED_MODEL, SHIPPED_LAYER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "lmms_task"
TASK = "shapesvqa"   # not a folder's name: lmms-eval reads --tasks as a folder of tasks when one exists there
BUDGET = 0.1
N_ITEMS = 10


# -- fixtures: the items, the task folder, arr_coc eval's answers, the model -------------------------


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> Path:
    """10 ShapesVQA test items as the project's JSONL, image paths absolute (both harnesses read this file)."""
    from arr_coc.data import read_jsonl, write_jsonl
    from arr_coc_shapes import write_split

    out = tmp_path_factory.mktemp("shapes")
    split = write_split(out, split="test", n=N_ITEMS, seed=0)
    rows = [json.loads(line) for line in split.read_text().splitlines()]
    for row, rec in zip(rows, read_jsonl(split)):
        row["image"] = str(rec.image)
    return write_jsonl(rows, out / "items.jsonl")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, items) -> Path:
    """The fixture task (tests/fixtures/lmms_task) with its data_files pointing at `items`."""
    out = tmp_path_factory.mktemp("lmms_task")
    shutil.copy(FIXTURE / "utils.py", out / "utils.py")
    text = (FIXTURE / f"{TASK}.yaml").read_text()
    assert "data/shapes/test.jsonl" in text
    (out / f"{TASK}.yaml").write_text(text.replace("data/shapes/test.jsonl", str(items)))
    return out


@pytest.fixture(scope="module")
def reference(items) -> dict:
    """What `python -m arr_coc eval --methods arr_coc_trained --budgets 0.1 --batch-size 4` measures on the items
    (the function it calls), plus each item's unpruned prompt length."""
    import torch

    from arr_coc.data import read_jsonl
    from arr_coc.evaluation.loop import evaluate, load_vlm

    records = read_jsonl(items)
    vlm = load_vlm(EMBEDDED_MODEL, "cpu", 0)
    report = evaluate(vlm, records, ["arr_coc_trained"], [BUDGET], batch_size=4, max_new_tokens=8,
                      arr_coc_weights=SHIPPED_LAYER, progress=False)
    row = report["results"][0]
    assert row["status"] == "ok" and row["n"] == N_ITEMS
    with torch.no_grad():
        inputs = vlm.backend.build_inputs([[r.load_image()] for r in records], [r.question for r in records])
    return {"row": row, "unpruned_prompt": [int(m.sum()) for m in inputs["attention_mask"]], "records": records}


@pytest.fixture(scope="module")
def lm():
    """The plugin as lmms-eval builds it from `--model_args budget=0.1,batch_size=2` (the embedded model)."""
    from arr_coc.harness.lmms_eval import ARRCOCLmms

    return ARRCOCLmms.create_from_arg_string(f"budget={BUDGET},batch_size=2", {"batch_size": 1, "device": None})


@pytest.fixture(scope="module")
def tasks(task_dir, lm, tmp_path_factory):
    """The fixture task as lmms-eval builds it for a chat model and for a simple one, with its requests."""
    from lmms_eval.tasks import TaskManager, get_task_dict

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMMS_EVAL_DATASETS_CACHE", str(tmp_path_factory.mktemp("datasets_cache")))
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)
        built = {kind: get_task_dict([TASK], manager, kind)[TASK] for kind in ("chat", "simple")}
        for task in built.values():
            task.build_all_requests(rank=0, world_size=1)
    lm.task_dict[TASK] = built["chat"].dataset
    return built


def answers_of(results) -> list[str]:
    return [r.text if hasattr(r, "text") else r for r in results]


# -- registration ----------------------------------------------------------------------------------------


def test_entry_point_registers_arr_coc_as_an_lmms_eval_chat_model():
    from lmms_eval.models import MODEL_REGISTRY_V2, get_model

    from arr_coc.harness.lmms_eval import ARRCOCLmms

    found = {ep.name: ep.value for ep in entry_points(group="lmms_eval.models")}
    assert found.get("arr_coc") == "arr_coc.harness:lmms_eval_models", \
        f"no arr_coc entry point ({found}); install the project: `make install` (pip install -e . --no-deps)"
    assert get_model("arr_coc") is ARRCOCLmms
    assert MODEL_REGISTRY_V2.resolve("arr_coc").model_type == "chat"
    with pytest.raises(ValueError, match="not found"):   # negative control: the registry does refuse a name
        get_model("arr_coc_no_such_model")


SPY = """
import sys
imports, probes = [], []
class Spy:   # sees every lookup of torchvision: an import (even one a module catches), or a find_spec probe
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "torchvision":
            return None
        f = sys._getframe(1)
        while f is not None and not (f.f_code.co_name == "find_spec" and "importlib" in f.f_code.co_filename
                                     and "util" in f.f_code.co_filename):
            f = f.f_back
        (probes if f is not None else imports).append(name)
sys.meta_path.insert(0, Spy())
import lmms_eval.evaluator, lmms_eval.__main__, arr_coc.harness.lmms_eval
from lmms_eval.models import get_model
get_model("arr_coc")
print("plugin path imports:", imports)
try:
    import torchvision  # noqa: F401  (the negative control: the spy does see an import)
except ImportError:
    pass
print("control imports:", imports)
"""


def test_lmms_eval_and_the_plugin_never_try_to_import_torchvision():
    out = subprocess.run([sys.executable, "-c", SPY], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    # datasets and transformers only ask importlib.util.find_spec whether it is there (a probe, not an import)
    assert "plugin path imports: []" in lines
    assert "control imports: ['torchvision']" in lines


# -- lmms-eval's evaluator vs arr_coc eval ---------------------------------------------------------------


def run_lmms_eval(task_dir: Path, out: Path, processes: int, cache: Path) -> tuple[dict, list[dict], str]:
    """`python -m lmms_eval --model arr_coc ...` (under torchrun for 2 processes) -> (results, samples, log)."""
    cli = ["-m", "lmms_eval", "--model", "arr_coc", "--model_args", f"budget={BUDGET}", "--tasks", TASK,
           "--include_path", str(task_dir), "--batch_size", "4", "--log_samples", "--output_path", str(out)]
    if processes > 1:   # what `accelerate launch` runs on GPUs; on CPU, accelerate's processes meet over gloo
        cli = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *cli]
    env = {**os.environ, "LMMS_EVAL_DATASETS_CACHE": str(cache), "HF_DATASETS_CACHE": str(cache),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, *cli], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    # lmms-eval logs an evaluation error and still exits 0 (e.g. a dependency it cannot import): no results file
    found = {pattern: sorted(out.rglob(pattern)) for pattern in ("*_results.json", f"*_samples_{TASK}.jsonl")}
    assert all(found.values()), f"lmms-eval wrote no {[p for p, f in found.items() if not f]}; its log:\n{log[-4000:]}"
    results = json.loads(found["*_results.json"][0].read_text())
    samples = [json.loads(line) for line in found[f"*_samples_{TASK}.jsonl"][0].read_text().splitlines()]
    return results, sorted(samples, key=lambda s: s["doc_id"]), log


@pytest.mark.parametrize("processes", [1, 2], ids=["one process", "two processes (torchrun)"])
def test_lmms_eval_gives_arr_coc_evals_accuracy_and_answers(task_dir, reference, processes, tmp_path):
    results, samples, log = run_lmms_eval(task_dir, tmp_path / "out", processes, tmp_path / "cache")
    row = reference["row"]
    assert results["results"][TASK]["accuracy,none"] == pytest.approx(row["accuracy"])
    assert [s["doc_id"] for s in samples] == list(range(N_ITEMS))
    answers = [s["filtered_resps"] for s in samples]   # the samples file holds one string per doc
    assert [(a[0] if isinstance(a, list) else a).strip() for a in answers] == row["answers"]
    # the same tokens were pruned: each pruned prompt is its unpruned prompt less the visual tokens dropped
    prompts = [s["token_counts"][0]["input_tokens"] for s in samples]
    dropped = N_ITEMS * (row["total_tokens_mean"] - row["kept_tokens_mean"])
    assert sum(prompts) == pytest.approx(sum(reference["unpruned_prompt"]) - dropped)
    assert dropped > 0.5 * N_ITEMS * row["total_tokens_mean"]   # ... and a budget of 0.1 did drop most of them
    if processes > 1:   # both processes answered, each its own shard (ranks from accelerate)
        assert "2 process(es)" in log
        assert "arr_coc (rank 0)" in log and "arr_coc (rank 1)" in log


# -- requests as lmms-eval sends them ----------------------------------------------------------------------


def test_both_request_layouts_with_and_without_split_give_eval_answers(lm, tasks, reference):
    chat, simple = tasks["chat"].instances, tasks["simple"].instances
    assert len(chat[0].args) == 6 and callable(chat[0].args[1]) and isinstance(chat[0].args[2], dict)
    assert len(simple[0].args) == 6 and isinstance(simple[0].args[1], dict) and callable(simple[0].args[2])
    for layout in (chat, simple):
        got = [a.strip() for a in answers_of(lm.generate_until(layout))]
        assert got == [reference["row"]["answers"][inst.doc_id] for inst in layout]
        five = [_with_args(inst, inst.args[:5]) for inst in layout[:3]]   # the layout without its split
        assert [a.strip() for a in answers_of(lm.generate_until(five))] == got[:3]


def test_a_batch_of_two_answers_as_each_alone(lm, tasks):
    chat = tasks["chat"].instances
    a, b = chat[0], chat[5]   # different questions: different prompt lengths, so the batch is padded
    assert lm.batch_size == 2
    together = lm.generate_until([a, b])
    alone = [lm.generate_until([a])[0], lm.generate_until([b])[0]]
    assert answers_of(together) == answers_of(alone)
    assert [r.token_counts.to_dict() for r in together] == [r.token_counts.to_dict() for r in alone]
    assert len(rq.plan_batches([rq.parse_args(i, r.args) for i, r in enumerate([a, b])], lm.batch_size)) == 1


def test_gen_kwargs_max_new_tokens_and_until_are_applied(lm, tasks):
    inst = tasks["chat"].instances[1]
    full = answers_of(lm.generate_until([inst]))[0]
    assert len(full.strip()) >= 2
    gen = dict(inst.args[2])
    one = _with_args(inst, (inst.args[0], inst.args[1], {**gen, "max_new_tokens": 1}, *inst.args[3:]))
    got = lm.generate_until([one])[0]
    assert got.token_counts.output_tokens == 1 and full.startswith(got.text)
    stop = full.strip()[1]   # a character inside the answer: the answer is cut before it
    cut = _with_args(inst, (inst.args[0], inst.args[1], {**gen, "until": [stop]}, *inst.args[3:]))
    assert answers_of(lm.generate_until([cut]))[0] == full.split(stop)[0]


def test_unsupported_requests_raise_not_implemented_with_what_to_do(lm, tasks):
    inst = tasks["chat"].instances[0]
    with pytest.raises(NotImplementedError, match="generate_until task"):
        lm.loglikelihood([inst])
    with pytest.raises(NotImplementedError, match="single-turn"):
        lm.generate_until_multi_round([inst])
    seven = _with_args(inst, (inst.args[0], inst.args[2], lambda d: [], lambda d: "", *inst.args[3:]))
    with pytest.raises(NotImplementedError, match="multi-round or agentic"):
        lm.generate_until([seven])
    user = {"role": "user", "content": [{"type": "text", "text": "What color is the star?"}]}
    for messages, why in (
        ([{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, user], "system prompt"),
        ([user, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}, user], "conversation"),
        ([{"role": "user", "content": [{"type": "audio", "url": "clip.wav"}, {"type": "text", "text": "?"}]}],
         "no audio"),
    ):
        bad = _with_args(inst, (inst.args[0], lambda doc, m=messages: m, *inst.args[2:]))
        with pytest.raises(NotImplementedError, match=why):
            lm.generate_until([bad])
    with pytest.raises(ValueError, match="6 elements"):   # negative control: a malformed request is not guessed at
        lm.generate_until([_with_args(inst, inst.args[:4])])


# -- model arguments and the pure request functions --------------------------------------------------------


def test_video_requests_reach_generate_as_paths():
    """A video task's visual (a file path, or a chat part of type video) goes to `generate` as the path, which reads
    it as a clip; an audio file is still refused (negative control)."""
    from arr_coc.harness.requests import _image, prompt_from_messages

    assert _image("/data/videomme/clip.mp4") == "/data/videomme/clip.mp4"
    prompt = prompt_from_messages([{"role": "user", "content": [{"type": "video", "url": "v.webm"},
                                                                  {"type": "text", "text": "What happens?"}]}])
    assert prompt.images == ("v.webm",) and prompt.question == "What happens?"
    with pytest.raises(NotImplementedError, match="neither an image nor a video"):
        _image("/data/clip.wav")


def test_model_args_are_checked_before_the_model_loads():
    from arr_coc.harness.lmms_eval import ARRCOCLmms, merged_args

    assert merged_args("budget=64,method=grid", {"batch_size": 1, "device": None}) == \
        {"budget": "64", "method": "grid", "batch_size": 1}
    assert merged_args("budget=10%,batch_size=8", {"batch_size": 1})["batch_size"] == 8   # model_args win
    for args, error, match in (
        ("budget=1", ValueError, "ambiguous"),
        ("method=oracle", ValueError, "cannot run inside lmms-eval"),
        ("method=arr_coc_trained", ValueError, "arr_coc=FOLDER"),
        ("method=no_such_method", ValueError, "no_such_method"),
        ("budget_mode=sometimes", ValueError, "budget mode"),
        ("method=fastv,encode=before", ValueError, "encode=after"),
        ("dtype=float64", ValueError, "float64"),
        ("temperature=0.5", TypeError, "unknown model_args"),
        ("batch_size=auto", ValueError, "'auto' is not supported"),
    ):
        with pytest.raises(error, match=match):
            ARRCOCLmms.create_from_arg_string(args, {"batch_size": 1})


def test_generation_reads_gen_kwargs_as_lmms_eval_qwen_models_do():
    greedy = rq.generation({"max_new_tokens": 16, "temperature": 0, "do_sample": False, "until": "\n"}, 128)
    assert greedy.kwargs == {"max_new_tokens": 16, "do_sample": False} and greedy.until == ("\n",)
    sampled = rq.generation({"temperature": 0.7, "top_p": 0.9, "num_beams": 1, "image_aspect_ratio": "pad"}, 128)
    assert sampled.kwargs == {"max_new_tokens": 128, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert sampled.ignored == ("image_aspect_ratio",)
    with pytest.raises(ValueError, match="until"):
        rq.generation({"until": 3}, 128)
    assert rq.cut_at_stops("red.\n\nblue", ["\n\n", ""]) == "red."


def test_plan_batches_groups_by_gen_kwargs_longest_first():
    def spec(i, ctx, gen):
        return rq.RequestSpec(i, "chat", ctx, gen, lambda d: [], i, TASK, "test")

    g1, g2 = {"max_new_tokens": 8}, {"max_new_tokens": 4}
    specs = [spec(0, "ab", g1), spec(1, "abcd", g1), spec(2, "x", g2), spec(3, "abc", g1)]
    assert [[s.index for s in b] for b in rq.plan_batches(specs, 2)] == [[1, 3], [0], [2]]
    with pytest.raises(ValueError, match="batch_size"):
        rq.plan_batches(specs, 0)


def _with_args(inst, args):
    """A copy of an lmms-eval Instance with other arguments."""
    import dataclasses

    return dataclasses.replace(inst, arguments=tuple(args))
