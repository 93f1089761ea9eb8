"""The vLLM plugin under the requests deployments send (docs/SERVING.md, "What is served, what is refused").

One engine per configuration, many requests each (`scripts/vllm_requests.py`): bf16 serving on 100 pictures of
mixed canvas sizes at three budgets, sent together (the scheduler batches them as under load), against the Hugging
Face path in bf16 with its layer in float32, each picture chosen alone; float32 serving of chats of two and three
turns, two-image prompts, raw prompts and hostile clients' kwargs, against the Hugging Face front door given the
same conversations. The Hugging Face side's own batch invariance is checked here too (batches of 1, 2, 8 and 32
with different neighbours). Like tests/test_vllm_plugin.py: skipped where vLLM's environment is missing, except
in CI (CI=true), where that fails them.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from _vllm import ROOT, VLLM_PY, needs_vllm, run as vllm_run   # one vLLM import per session (_vllm_forks)
import torch
from _ties import beyond_ties, relevance_rows

MODEL, LAYER = "checkpoints/shapes-qwen2vl", "checkpoints/arr-coc-shapes-before"
BUDGETS = ("0.05", "0.1", "0.25")
N_ITEMS = int(os.environ.get("ARR_COC_VLLM_DEPLOY_ITEMS", "100"))
SIDES = (224, 280, 336, 392, 448, 504, 560, 616)       # canvas sides: 64 mixed sizes

pytestmark = pytest.mark.usefixtures("engine_threads")   # the module's HF references on vLLM's threads (conftest)


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> list[dict]:
    """Generated test items, each picture resized to a random canvas (seeded): mixed sizes in every batch."""
    from PIL import Image

    tmp = tmp_path_factory.mktemp("deploy")
    subprocess.run([sys.executable, "-m", "arr_coc_shapes", "gen-data", "--out", str(tmp), "--split", "test", "--n",
                    str(N_ITEMS), "--seed", "0"], cwd=ROOT, check=True, capture_output=True)
    rng = random.Random(0)
    out = []
    for line in (tmp / "test.jsonl").read_text().splitlines():
        it = json.loads(line)
        size = (rng.choice(SIDES), rng.choice(SIDES))
        path = tmp / f"{it['id']}-{size[0]}x{size[1]}.png"
        Image.open(tmp / it["image"]).convert("RGB").resize(size, Image.BICUBIC).save(path)
        out.append({**it, "path": str(path)})
    return out


def _user(images: int, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def _serve(reqs: list[dict], tmp: Path, *extra: str) -> dict[str, dict]:
    (tmp / "reqs.json").write_text(json.dumps(reqs))
    cmd = [str(VLLM_PY), "scripts/vllm_requests.py", "--requests", str(tmp / "reqs.json"), "--out",
           str(tmp / "got.json"), "--layer", LAYER, "--encode", "before", "--one-process", *extra]
    # --one-process: no spawned engine processes (the data-parallel server test below has vLLM's processes)
    done = vllm_run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in json.loads((tmp / "got.json").read_text())["requests"]}


def _hf(dtype: torch.dtype = torch.float32):
    from arr_coc import ARRCOC

    return ARRCOC.from_pretrained(MODEL, arr_coc=LAYER, adapter=False, dtype=dtype)


def _ask(vlm, visuals: list[list], questions: list, budget: str
         ) -> tuple[list[str], list[list[list[int]]], list[list[list[float]]]]:
    """Per item: its answer, and per picture its kept cells and its relevance row (`_ties.relevance_rows`)."""
    from PIL import Image

    from arr_coc.budget import parse_budget

    answers, kept, relevance = [], [], []
    for s in range(0, len(visuals), 8):
        pictures = [[Image.open(p).convert("RGB") for p in ps] for ps in visuals[s:s + 8]]
        said, traces = vlm.generate(pictures, list(questions[s:s + 8]), budget=parse_budget(budget),
                                    budget_mode="exact", max_new_tokens=16, encode="before")
        answers += [a.strip() for a in said]
        kept += [[k.tolist() for k in tr.kept_indices] for tr in traces]
        relevance += [relevance_rows(tr) for tr in traces]
    return answers, kept, relevance


# -- the Hugging Face path: a picture's cells whatever shares its batch -----------------------------------------

def test_each_picture_keeps_its_cells_alone_and_in_batches_of_2_8_and_32(items):
    """Before the tower the choice reads only the picture and the question: each of the mixed-size pictures keeps
    the same cells alone and beside any neighbours (run_selector chooses each image alone)."""
    from PIL import Image

    from arr_coc.pipeline.request import Pruning

    vlm = _hf()
    backend = vlm.backend
    pictures = [Image.open(it["path"]).convert("RGB") for it in items]

    def kept(which: list[int]) -> list[list[int]]:
        inputs = backend.build_inputs([[pictures[i]] for i in which], [items[i]["question"] for i in which])
        state = vlm.prepare(inputs, Pruning.of("arr_coc", 0.1, "exact", "before"))
        return [tr.kept_indices[0].tolist() for tr in state.traces]

    alone = [kept([i])[0] for i in range(len(items))]
    order = list(range(len(items)))
    for size, seed in ((2, 1), (8, 2), (32, 3)):
        random.Random(seed).shuffle(order)
        batched = {}
        for s in range(0, len(order), size):
            batch = order[s:s + size]
            batched.update(zip(batch, kept(batch)))
        assert {i: k for i, k in batched.items() if k != alone[i]} == {}, size
    assert len({len(k) for k in alone}) > 3              # mixed sizes: many different counts at 10%


def test_the_layer_rounded_to_bf16_changes_cells(items):
    """The negative control for bf16 serving: the same layer with its weights rounded to bf16 (what vLLM's default
    dtype did to it) keeps other cells on some pictures, so an exact comparison can fail."""
    from PIL import Image

    vlm = _hf()
    pictures = [Image.open(it["path"]).convert("RGB") for it in items[:40]]
    exact = [vlm.choose(p, it["question"], budget=0.1, budget_mode="exact", encode="before").kept[0].tolist()
             for p, it in zip(pictures, items)]
    with torch.no_grad():
        for p in vlm.layer.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    rounded = [vlm.choose(p, it["question"], budget=0.1, budget_mode="exact", encode="before").kept[0].tolist()
               for p, it in zip(pictures, items)]
    assert sum(a != b for a, b in zip(exact, rounded)) >= 1


# -- bf16 serving ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16(items, tmp_path_factory):
    reqs = [{"name": f"{it['id']}@{b}", "images": [it["path"]], "budget": b,
             "messages": [_user(1, it["question"])]} for b in BUDGETS for it in items]
    return _serve(reqs, tmp_path_factory.mktemp("bf16"), "--dtype", "bfloat16")


@needs_vllm
@pytest.mark.parametrize("budget", BUDGETS)
def test_bf16_serving_keeps_the_hugging_face_paths_cells(items, bf16, budget):
    """vLLM in bf16 (the model built under bf16, as deployments serve) keeps the cells of the Hugging Face path in
    bf16 with its layer in float32, on every picture, sent together, up to float32 ties at the budget's edge
    (`_ties`: two cells' relevances within 1e-5, on at most 1 picture in 20). Answers: the tower and language model
    run vLLM's bf16 kernels, not transformers', so an answer may differ only where a token's margin is a near-tie."""
    vlm = _hf(torch.bfloat16)
    answers, kept, relevance = _ask(vlm, [[it["path"]] for it in items], [it["question"] for it in items], budget)
    got = [bf16[f"{it['id']}@{budget}"] for it in items]
    assert {it["id"]: (g["kept"], k) for it, g, k, rel in zip(items, got, kept, relevance)
            if any(beyond_ties(a, b, r) for a, b, r in zip(g["kept"], k, rel))} == {}
    ties = sum(g["kept"] != k for g, k in zip(got, kept))
    assert ties <= len(items) // 20, ties
    differ = [(g["answer"].strip(), a, min(g["margins"])) for g, a in zip(got, answers) if g["answer"].strip() != a]
    assert len(differ) <= len(items) // 10, differ
    assert all(margin < 1.0 for _, _, margin in differ), differ


# -- chats, several images, raw prompts, hostile clients (float32) ---------------------------------------------

def _chats(items: list[dict]) -> list[dict]:
    n = len(items)
    reqs = []
    for i, it in enumerate(items[:40]):                 # two turns: the second asks another item's question
        other = items[(i + 7) % n]["question"]
        messages = [_user(1, it["question"]), {"role": "assistant", "content": it["answers"][0]},
                    {"role": "user", "content": other}]
        reqs.append({"name": f"two-{i}", "images": [it["path"]], "budget": "0.05", "messages": messages})
        reqs.append({"name": f"two-{i}-again", "images": [it["path"]], "budget": "5%", "messages": messages})
    for i, it in enumerate(items[40:60]):               # three turns, the image in the first
        a, b = items[(i + 3) % n], items[(i + 11) % n]
        messages = [_user(1, it["question"]), {"role": "assistant", "content": it["answers"][0]},
                    {"role": "user", "content": a["question"]}, {"role": "assistant", "content": a["answers"][0]},
                    {"role": "user", "content": b["question"]}]
        reqs.append({"name": f"three-{i}", "images": [it["path"]], "budget": "0.1", "messages": messages})
    for i, it in enumerate(items[:40]):                 # two images in one message
        other = items[(i + 13) % n]
        reqs.append({"name": f"pair-{i}", "images": [it["path"], other["path"]], "budget": "0.1",
                     "messages": [_user(2, it["question"])]})
    return reqs


ODD = [
    # (name, request fields, what it must get: "answer" or the error's words)
    ("raw", {"prompt": "<|image_pad|>What color is the circle?", "budget": "5%"}, "answer"),
    ("raw all", {"prompt": "<|image_pad|>What color is the circle?", "budget": "1.0"}, "answer"),
    ("raw vision", {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What color is the circle?",
                    "budget": "5%"}, "answer"),
    ("tiny share", {"budget": 1e-300}, "answer"),
    ("tiny text", {"budget": "0.0000000000001"}, "answer"),
    ("odd share", {"budget": 0.048828124999999}, "answer"),
    ("min_pixels", {"budget": "64tok", "mm_kwargs": {"min_pixels": 40000000}}, "'min_pixels'"),
    ("max_pixels", {"budget": "5%", "mm_kwargs": {"max_pixels": 100000000}}, "'max_pixels'"),
    ("image_mean", {"budget": "5%", "mm_kwargs": {"image_mean": [0.1, 0.2, 0.3]}}, "'image_mean'"),
    ("do_normalize", {"budget": "5%", "mm_kwargs": {"do_normalize": False}}, "'do_normalize'"),
    ("merge_size", {"budget": "5%", "mm_kwargs": {"merge_size": 1}}, "'merge_size'"),
    ("internal", {"budget": "5%", "mm_kwargs": {"arr_coc_question": [1, 2], "arr_coc_count": 200}}, "answer"),
    ("bad budget", {"budget": "lots"}, "is not a budget"),
    ("huge picture", {"budget": "5%", "size": (3584, 3584)}, "answer"),   # resized within the server's max_pixels
]


@pytest.fixture(scope="module")
def conversations(items, tmp_path_factory):
    from PIL import Image

    tmp = tmp_path_factory.mktemp("f32")
    reqs = _chats(items)
    for name, fields, _ in ODD:
        req = {"name": name, "images": [items[0]["path"]], "alone": True, **fields}
        if "size" in req:
            path = tmp / "huge.png"
            Image.open(items[0]["path"]).convert("RGB").resize(req.pop("size")).save(path)
            req["images"] = [str(path)]
        if "prompt" not in req:
            req["messages"] = [_user(1, "What color is the circle?")]
        reqs.append(req)
    return reqs, _serve(reqs, tmp, "--dtype", "float32", "--prefix-caching")


@needs_vllm
@pytest.mark.parametrize("kind", ["two", "three", "pair"])
def test_chats_and_two_image_prompts_are_answered_as_the_front_door_answers_them(items, conversations, kind):
    """A follow-up turn is asked its own question (the cells follow it), in the plugin and the Hugging Face front
    door alike; two images in one message each get their own count; the same cells and greedy answers."""
    from arr_coc.conversation import Conversation

    reqs, got = conversations
    mine = [r for r in reqs if r["name"].startswith(kind + "-") and not r["name"].endswith("again")]
    answers, kept, _ = _ask(_hf(), [r["images"] for r in mine], [Conversation.of(r["messages"]) for r in mine],
                            mine[0]["budget"])
    assert {r["name"]: (got[r["name"]]["kept"], k) for r, k in zip(mine, kept) if got[r["name"]]["kept"] != k} == {}
    assert {r["name"]: (got[r["name"]]["answer"].strip(), a) for r, a in zip(mine, answers)
            if got[r["name"]]["answer"].strip() != a} == {}
    if kind == "two":     # the turn's question moves the cells: asked with turn 1's, they differ
        first = _ask(_hf(), [r["images"] for r in mine], [r["messages"][0]["content"][-1]["text"] for r in mine],
                     "0.05")[1]
        assert sum(a != b for a, b in zip(first, kept)) >= len(mine) // 4
        again = {r["name"]: got[r["name"] + "-again"]["token_ids"] == got[r["name"]]["token_ids"] for r in mine}
        assert all(again.values()), again          # the same chat again (prefix caching on): the same answer


@needs_vllm
@pytest.mark.parametrize("name,fields,expect", ODD, ids=[o[0] for o in ODD])
def test_odd_prompts_and_hostile_kwargs_are_answered_or_refused_in_one_line(conversations, name, fields, expect):
    """Each is answered, or refused with one line naming what to do; the engine answers the next request."""
    got = conversations[1][name]
    assert got["next_ok"] is True, got
    if expect == "answer":
        assert got["error"] is None and got["token_ids"], got      # a raw prompt may end at once: still served
        assert got.get("kept") and all(k is not None and len(k) >= 1 for k in got["kept"]), got
        if fields.get("budget") != "1.0":             # the text and at most 5% of 1,024 cells (the largest picture)
            assert got["prompt_tokens"] <= 40 + 52
    else:
        assert got["error"] is not None and expect in got["error"]["message"], got
        assert "\n" not in got["error"]["message"]


# -- the OpenAI server: data parallel, the operator's default, hostile clients ---------------------------------

HOSTILE = ("min_pixels", "max_pixels", "image_mean", "do_normalize", "merge_size", "bad budget")


@pytest.fixture(scope="module")
def server(items, conversations, tmp_path_factory):
    """`vllm serve` with --data-parallel-size 2 and the operator's default budget (--mm-processor-kwargs 5%),
    asked through the openai client, 8 requests in flight: the 40 two-turn chats (without a budget: the
    operator's), two-image prompts, and the hostile kwargs."""
    reqs, _ = conversations
    sent = [{**r, "budget": None} for r in reqs if r["name"].startswith("two-") and not r["name"].endswith("again")]
    sent += [r for r in reqs if r["name"].startswith("pair-")][:8]
    sent += [{**r, "alone": False} for r in reqs if r["name"] in HOSTILE]
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "reqs.json").write_text(json.dumps(sent))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    cmd = [str(VLLM_PY), "scripts/vllm_serve_check.py", "--layer", LAYER, "--encode", "before", "--dp", "2",
           "--operator-budget", "5%", "--requests", str(tmp / "reqs.json"), "--out", str(tmp / "serve.json")]
    done = vllm_run(cmd, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp / "serve.log").read_text()[-3000:]
    return json.loads((tmp / "serve.json").read_text())["requests"]


@needs_vllm
def test_data_parallel_2_with_the_operators_budget_answers_as_one_worker(conversations, server):
    """Two data-parallel engines (8 requests in flight), each chat without a budget at the operator's 5%: the same
    answers and prompt tokens as one worker asked for 5% itself (the operator's default is honoured)."""
    _, one = conversations
    two = {n: r for n, r in server.items() if n.startswith("two-")}
    assert len(two) == 40
    assert {n: (r["answer"], r["prompt_tokens"]) for n, r in two.items()} == \
        {n: (one[n]["answer"], one[n]["prompt_tokens"]) for n in two}
    pairs = {n: r for n, r in server.items() if n.startswith("pair-")}
    assert {n: r["answer"] for n, r in pairs.items()} == {n: one[n]["answer"] for n in pairs}
    assert server["__after"]["error"] is None


@needs_vllm
def test_a_bad_operator_budget_stops_the_server_at_start_in_one_line(items, tmp_path):
    reqs = [{"name": "one", "images": [items[0]["path"]], "budget": None, "messages": [_user(1, "What color?")]}]
    (tmp_path / "reqs.json").write_text(json.dumps(reqs))
    cmd = [str(VLLM_PY), "scripts/vllm_requests.py", "--requests", str(tmp_path / "reqs.json"), "--out",
           str(tmp_path / "got.json"), "--layer", LAYER, "--encode", "before", "--server-budget", "lots", "--one-process"]
    done = vllm_run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    said = done.stdout + done.stderr                    # the worker logs its error on stdout
    assert done.returncode != 0 and "--mm-processor-kwargs arr_coc_budget 'lots' is not a budget" in said


@needs_vllm
@pytest.mark.parametrize("name", HOSTILE)
def test_the_server_refuses_hostile_kwargs_with_400_and_one_line(server, name):
    got = server[name]["error"]
    assert got is not None and got["status"] == 400 and "\n" not in got["message"], server[name]
    expect = "is not a budget" if name == "bad budget" else f"'{name}'"
    assert expect in got["message"]


def test_only_a_swap_of_tied_cells_at_the_budgets_edge_passes_as_a_tie():
    """The tie rule's negative controls: cells swapped at the edge within 1e-5 pass; a swap 1e-3 apart, a swap
    away from the edge and another count of cells do not."""
    relevance = [0.9, 0.5, 0.3, 0.3000001, 0.299, 0.1]
    theirs = [0, 1, 2]                                     # the reference's top 3; its edge is cell 2 (0.3)
    assert not beyond_ties([0, 1, 2], theirs, relevance)
    assert not beyond_ties([0, 1, 3], theirs, relevance)   # 3 ties 2
    assert beyond_ties([0, 1, 4], theirs, relevance)       # 4 is 1e-3 below the edge
    assert beyond_ties([0, 2, 3], theirs, relevance)       # 1 (0.5) dropped: not at the edge
    assert beyond_ties([0, 1], theirs, relevance)
