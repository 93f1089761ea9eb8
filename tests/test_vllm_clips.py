"""Clips served by the vLLM plugin, pruned over space and time before the tower (docs/SERVING.md, "Clips").

The embedded clip model (`checkpoints/shapes-qwen2vl-video`, the one `ask --video` and the app use) answers
generated ShapesVQA-video clips through vLLM + ARR-COC and through the Hugging Face path: the same cells and the same
greedy answers at three budgets, a clip beside an image, keep-all equal to stock vLLM token for token, and chunked
prefill keeping the same cells. The tiny random Qwen2.5-VL (its M-RoPE time step) and Qwen3-VL (each frame group's
timestamp in the prompt, its cells chosen in the processor) the same against their Hugging Face paths. One engine per
configuration, many requests each (`scripts/vllm_requests.py`).
Like tests/test_vllm_plugin.py: skipped where vLLM's environment is missing, except in CI (CI=true).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _vllm import ROOT, VLLM_PY, needs_vllm, run as vllm_run   # one vLLM import per session (_vllm_forks)
from test_vllm_families import _answer   # an answer's tokens up to its end, as the families compare them

MODEL, LAYER = "checkpoints/shapes-qwen2vl-video", "checkpoints/arr-coc-shapes-before"
BUDGETS = ("0.05", "0.1", "0.25")
N_CLIPS = int(os.environ.get("ARR_COC_VLLM_CLIPS", "100"))
N_MIXED = 10           # requests with an image and a clip
N_STOCK = 24           # clips asked of stock vLLM and of the plugin at 1.0
N_TINY = 16            # clips asked of the tiny random Qwen2.5-VL
OTHER = ("mixed-", "all-", "other-")

pytestmark = pytest.mark.usefixtures("engine_threads")   # the module's HF references on vLLM's threads (conftest)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> list[dict]:
    """Generated test clips (336 px, 4, 6 or 8 frames: 2 to 4 frame groups), saved as .npy frames."""
    from arr_coc_shapes.video import make_clip_item
    from arr_coc_shapes.video.spec import options

    tmp = tmp_path_factory.mktemp("clips")
    out = []
    for i in range(N_CLIPS):
        frames, rec, _ = make_clip_item(0, "test", i, "336x336", options(lengths=(4, 6, 8)))
        path = tmp / f"{rec['id']}.npy"
        np.save(path, frames)
        out.append({"id": rec["id"], "path": str(path), "question": rec["question"], "answer": rec["answer"]})
    return out


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("picture")
    subprocess.run([sys.executable, "-m", "arr_coc_shapes", "gen-data", "--out", str(tmp), "--split", "test",
                    "--n", "1", "--seed", "0"], cwd=ROOT, check=True, capture_output=True)
    return str(tmp / json.loads((tmp / "test.jsonl").read_text().splitlines()[0])["image"])


def _user(parts: list[str], text: str) -> dict:
    return {"role": "user", "content": [{"type": p} for p in parts] + [{"type": "text", "text": text}]}


def _requests(clips: list[dict], picture: str) -> list[dict]:
    reqs = [{"name": f"{c['id']}@{b}", "images": [], "clips": [c["path"]], "budget": b,
             "messages": [_user(["video"], c["question"])]} for b in BUDGETS for c in clips]
    reqs += [{"name": f"mixed-{c['id']}", "images": [picture], "clips": [c["path"]], "budget": "0.1",
              "messages": [_user(["image", "video"], c["question"])]} for c in clips[:N_MIXED]]
    asked = [c for c in clips if c["question"] != clips[0]["question"]][:N_MIXED]   # another clip's question
    reqs += [{"name": f"other-{c['id']}", "images": [], "clips": [c["path"]], "budget": "0.05",
              "messages": [_user(["video"], clips[0]["question"])]} for c in asked]
    reqs += [{"name": f"all-{c['id']}", "images": [], "clips": [c["path"]], "budget": "1.0",
              "messages": [_user(["video"], c["question"])]} for c in clips[:N_STOCK]]
    return reqs


def _serve(reqs: list[dict], tmp: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """The requests through one engine (`scripts/vllm_requests.py`); `extra` flags override the defaults."""
    (tmp / "reqs.json").write_text(json.dumps(reqs))
    cmd = [str(VLLM_PY), "scripts/vllm_requests.py", "--model", MODEL, "--requests", str(tmp / "reqs.json"), "--out",
           str(tmp / "got.json"), "--layer", LAYER, "--encode", "before", "--max-model-len", "4096", *extra,
           *(() if "--tp" in extra else ("--one-process",))]   # no spawned engine processes (the server test has them)
    done = vllm_run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["name"]: r for r in json.loads((tmp / "got.json").read_text())["requests"]}


@pytest.fixture(scope="module")
def served(clips, picture, tmp_path_factory) -> tuple[list[dict], dict[str, dict]]:
    reqs = _requests(clips, picture)
    return reqs, _serve(reqs, tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def hf(served) -> dict[str, tuple[str, list[list[int]]]]:
    """The Hugging Face path on the same requests but keep-all's (compared with stock vLLM instead): (answer, per
    visual its kept cells, a clip's over (t, h, w))."""
    from arr_coc import ARRCOC

    compared = [r for r in served[0] if not r["name"].startswith("all-")]
    return _hf_answers(ARRCOC.from_pretrained(MODEL, arr_coc=LAYER, adapter=False), compared, MODEL)


def _hf_answers(vlm, reqs: list[dict], model: str) -> dict[str, tuple[list[int], list[list[int]]]]:
    """The Hugging Face path on `reqs` (8 at a time, each at its budget met exactly, before the tower):
    (the answer's token ids up to its end, per visual its kept cells)."""
    from PIL import Image

    from arr_coc.budget import parse_budget
    from arr_coc.pipeline.request import Pruning
    from arr_coc.video import load_clip

    eos = _eos(model)
    out = {}
    for budget in sorted({r["budget"] for r in reqs}):
        mine = [r for r in reqs if r["budget"] == budget]
        for s in range(0, len(mine), 8):
            batch = mine[s:s + 8]
            visuals = [[Image.open(p).convert("RGB") for p in r["images"]] + [load_clip(np.load(p)) for p in r["clips"]]
                       for r in batch]
            got = vlm.respond(visuals, [r["messages"][0]["content"][-1]["text"] for r in batch],
                              Pruning.of("arr_coc", parse_budget(budget), "exact", "before"), max_new_tokens=16)
            for r, tr, toks in zip(batch, got.traces, got.answered.new_tokens):
                out[r["name"]] = (_answer(toks.tolist(), eos), _per_visual(tr))
    return out


def _eos(model: str) -> set[int]:
    text = json.loads((ROOT / model / "config.json").read_text())["text_config"]
    return {int(text["eos_token_id"]), int(text.get("pad_token_id") or 0)}


def _differ(got: dict[str, dict], hf: dict, names: list[str], model: str) -> dict[str, tuple]:
    """The requests whose greedy tokens (up to the end token) differ between vLLM and the Hugging Face path."""
    eos = _eos(model)
    return {n: (_answer(got[n]["token_ids"], eos), hf[n][0]) for n in names
            if _answer(got[n]["token_ids"], eos) != hf[n][0]}


def _margins_where_they_differ(got: dict[str, dict], differ: dict[str, tuple]) -> dict[str, float | None]:
    """Per request whose answers differ (`_differ`): `got`'s logit margin over the runner-up at the first differing
    token (None where that step is past `got`'s answer: one answer ended, the other went on)."""
    steps = {n: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
             for n, (a, b) in differ.items()}
    return {n: got[n]["margins"][i] if i < len(got[n]["margins"]) else None for n, i in steps.items()}


def _per_visual(trace) -> list[list[int]]:
    """A trace's kept cells per visual: an image's as they are, a clip's groups numbered over (t, h, w)."""
    out: list[list[int]] = []
    for i, (k, (h, w)) in enumerate(zip(trace.kept_indices, trace.grid_hw)):
        clip, group = trace.clip_per_image[i], trace.group_per_image[i]
        if clip < 0 or group == 0:
            out.append([])
        out[-1] += (k + group * h * w).tolist()
    return out


@needs_vllm
@pytest.mark.parametrize("budget", BUDGETS)
def test_vllm_keeps_the_hugging_face_paths_cells_and_answers_on_clips(served, hf, budget):
    """Every clip at this budget: the same kept cells over space and time and the same greedy answer."""
    reqs, got = served
    mine = [r["name"] for r in reqs if r["budget"] == budget and not r["name"].startswith(OTHER)]
    assert len(mine) == N_CLIPS
    assert {n: got[n]["error"] for n in mine if got[n]["error"]} == {}
    assert {n: (got[n]["kept"], hf[n][1]) for n in mine if got[n]["kept"] != hf[n][1]} == {}
    assert _differ(got, hf, mine, MODEL) == {}
    counts = {len(got[n]["kept"][0]) for n in mine}
    assert len(counts) > 1                   # 2, 3 and 4 frame groups: several counts at one budget


@needs_vllm
def test_a_clip_beside_an_image_keeps_both_as_the_hugging_face_path(served, hf):
    reqs, got = served
    mine = [r["name"] for r in reqs if r["name"].startswith("mixed-")]
    assert len(mine) == min(N_MIXED, N_CLIPS)
    assert {n: (got[n]["kept"], hf[n][1]) for n in mine if got[n]["kept"] != hf[n][1]} == {}
    assert _differ(got, hf, mine, MODEL) == {}


@needs_vllm
def test_the_question_moves_a_clips_cells(served, hf):
    """The negative control for the equality above: a clip asked another question at the same budget keeps other
    cells on most clips, in vLLM as in the Hugging Face path."""
    reqs, got = served
    other = [r for r in reqs if r["name"].startswith("other-")]
    assert len(other) >= 5
    own = {r["name"]: got[r["name"].replace("other-", "") + "@0.05"]["kept"] for r in other}
    assert sum(got[n]["kept"] != k for n, k in own.items()) >= len(other) // 2
    assert {r["name"]: (got[r["name"]]["kept"], hf[r["name"]][1]) for r in other
            if got[r["name"]]["kept"] != hf[r["name"]][1]} == {}


@needs_vllm
def test_keep_all_through_the_plugin_is_stock_vllms_clip_answers_token_for_token(served, tmp_path):
    reqs, got = served
    every = [r for r in reqs if r["name"].startswith("all-")]
    stock = _serve(every, tmp_path, "--stock")
    assert {r["name"]: (got[r["name"]]["token_ids"], stock[r["name"]]["token_ids"]) for r in every
            if got[r["name"]]["token_ids"] != stock[r["name"]]["token_ids"]} == {}
    assert {got[r["name"]]["prompt_tokens"] - stock[r["name"]]["prompt_tokens"] for r in every} == {0}


@needs_vllm
def test_chunked_prefill_keeps_a_clips_cells_and_answers(served, tmp_path):
    """Prefill in chunks of 64 tokens: a clip's kept cells split across steps land at the same positions."""
    reqs, got = served
    some = [r for r in reqs if r["budget"] == "0.25"][:12] + [r for r in reqs if r["name"].startswith("mixed-")][:4]
    chunked = _serve(some, tmp_path, "--max-batched-tokens", "64")
    assert {r["name"]: (got[r["name"]]["kept"], chunked[r["name"]]["kept"]) for r in some
            if got[r["name"]]["kept"] != chunked[r["name"]]["kept"]} == {}
    assert {r["name"]: got[r["name"]]["token_ids"] == chunked[r["name"]]["token_ids"] for r in some} == \
        {r["name"]: True for r in some}


@needs_vllm
def test_tensor_parallel_2_keeps_a_clips_cells_and_answers(served, tmp_path):
    """Two tensor-parallel workers on this one NUMA node (bound one core each): the same cells and tokens."""
    reqs, got = served
    some = [r for r in reqs if r["budget"] == "0.1"][:8] + [r for r in reqs if r["name"].startswith("mixed-")][:2]
    tp2 = _serve(some, tmp_path, "--tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert {r["name"]: (tp2[r["name"]]["kept"], tp2[r["name"]]["token_ids"]) for r in some} == \
        {r["name"]: (got[r["name"]]["kept"], got[r["name"]]["token_ids"]) for r in some}


# -- Qwen2.5-VL: the time step of its M-RoPE (second_per_grid_ts * tokens_per_second) ------------------------------

@pytest.fixture(scope="module")
def tiny_qwen2_5(clips, tmp_path_factory) -> tuple[str, list[dict], dict, dict, dict]:
    """The tiny random Qwen2.5-VL (tokens_per_second 4: a group's time step is 4) with the untrained layer (built
    after torch.manual_seed(0) on both sides): N_TINY clips at three budgets and at 1.0, stock vLLM at 1.0, and the
    Hugging Face path."""
    import torch

    from arr_coc import ARRCOC
    from arr_coc.qwen.tiny import save_tiny_qwen

    tmp = tmp_path_factory.mktemp("tiny-qwen2_5")
    model = save_tiny_qwen("qwen2_5_vl", str(tmp / "model"))
    some = clips[:N_TINY]
    reqs = [{"name": f"{c['id']}@{b}", "images": [], "clips": [c["path"]], "budget": b,
             "messages": [_user(["video"], c["question"])]} for b in BUDGETS + ("1.0",) for c in some]
    got = _serve(reqs, tmp, "--model", model, "--layer", "untrained", "--max-model-len", "4096")
    every = [r for r in reqs if r["budget"] == "1.0"]
    stock = _serve(every, tmp_path_factory.mktemp("tiny-stock"), "--model", model, "--stock")
    vlm = ARRCOC.from_pretrained(model, arr_coc=None, adapter=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vlm.layer                                           # built now, from seed 0, as the plugin builds it
    return model, reqs, got, stock, _hf_answers(vlm, [r for r in reqs if r["budget"] != "1.0"], model)


@needs_vllm
def test_qwen2_5_vl_clips_keep_the_hugging_face_paths_cells_and_answers(tiny_qwen2_5):
    model, reqs, got, stock, hf = tiny_qwen2_5
    pruned = [r["name"] for r in reqs if r["budget"] != "1.0"]
    assert len(pruned) == len(BUDGETS) * N_TINY
    assert {n: (got[n]["kept"], hf[n][1]) for n in pruned if got[n]["kept"] != hf[n][1]} == {}
    assert _differ(got, hf, pruned, model) == {}
    every = [r["name"] for r in reqs if r["budget"] == "1.0"]
    assert {n: (got[n]["token_ids"], stock[n]["token_ids"]) for n in every
            if got[n]["token_ids"] != stock[n]["token_ids"]} == {}


# -- Qwen3-VL: each frame group's timestamp and its own pads, chosen in the processor ----------------------------

N_CHAT = 8             # Qwen3-VL clips asked through the chat template (the outer <|vision_start|> pair kept)


def _bare_clip_prompt(model: str, question: str, parts: tuple[str, ...] | list[str] = ("video",)) -> str:
    """The chat prompt of `parts` (one clip, or an image and a clip) and a question, the clip's placeholder written as
    one bare <|video_pad|>. The
    Hugging Face path's processor replaces the template's whole <|vision_start|><|video_pad|><|vision_end|> by the
    clip's groups (as Qwen's reference processor does); vLLM, under transformers >= 5.10, expands the pad alone and
    keeps the outer pair (qwen3_vl.py:1408-1415). Written bare, both paths read the same tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = tok.apply_chat_template([_user(list(parts), question)], tokenize=False, add_generation_prompt=True,
                                   chat_template=(Path(model) / "chat_template.jinja").read_text())
    return text.replace("<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")


@pytest.fixture(scope="module")
def tiny_qwen3(clips, picture, tmp_path_factory) -> tuple[str, list[dict], dict, dict, dict, dict]:
    """The tiny random Qwen3-VL with the untrained layer (built after torch.manual_seed(0) in the processor, the
    model and the Hugging Face path), one plugin engine: N_TINY clips (each frame group's "<t seconds>" in the
    prompt) at three budgets and at 1.0, another clip's question at 5 %, a picture beside a clip at 10 %, and
    N_CHAT through the chat template at 1.0 and at 5 % (the OpenAI server's reference); stock vLLM at 1.0; the
    Hugging Face path on the pruned bare-placeholder ones. Also: the engine's seconds and each clip's grid."""
    import time

    import torch

    from arr_coc import ARRCOC
    from arr_coc.qwen.processing import load_processor
    from arr_coc.qwen.tiny import save_tiny_qwen
    from arr_coc.video import load_clip

    tmp = tmp_path_factory.mktemp("tiny-qwen3")
    model = save_tiny_qwen("qwen3_vl", str(tmp / "model"))
    some = clips[:N_TINY]

    def ask(name: str, clip: dict, question: str, budget: str, bare: bool = True) -> dict:
        req = {"name": name, "images": [], "clips": [clip["path"]], "budget": budget,
               "messages": [_user(["video"], question)]}
        return {**req, "prompt": _bare_clip_prompt(model, question)} if bare else req

    reqs = [ask(f"{c['id']}@{b}", c, c["question"], b) for b in BUDGETS + ("1.0",) for c in some]
    asked = [c for c in some if c["question"] != some[0]["question"]][:N_MIXED]      # another clip's question
    reqs += [ask(f"other-{c['id']}", c, some[0]["question"], "0.05") for c in asked]
    reqs += [ask(f"chat-{c['id']}", c, c["question"], "1.0", bare=False) for c in some[:N_CHAT]]
    reqs += [{**ask(f"mixed-{c['id']}", c, c["question"], "0.1"), "images": [picture],
              "messages": [_user(["image", "video"], c["question"])],
              "prompt": _bare_clip_prompt(model, c["question"], ["image", "video"])} for c in some[:N_MIXED // 2]]
    reqs += [ask(f"chat5-{c['id']}", c, c["question"], "0.05", bare=False) for c in some[:N_CHAT]]
    t0 = time.perf_counter()
    got = _serve(reqs, tmp, "--model", model, "--layer", "untrained")
    seconds = time.perf_counter() - t0
    every = [r for r in reqs if r["budget"] == "1.0"]
    stock = _serve(every, tmp_path_factory.mktemp("tiny-qwen3-stock"), "--model", model, "--stock")
    vlm = ARRCOC.from_pretrained(model, arr_coc=None, adapter=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vlm.layer                                           # built now, from seed 0, as the plugin builds it
    videos = load_processor(model).video_processor
    grids = {c["path"]: videos([load_clip(np.load(c["path"]))])["video_grid_thw"][0].tolist() for c in some}
    hf = _hf_answers(vlm, [r for r in reqs if r["budget"] != "1.0" and not r["name"].startswith("chat5-")], model)
    return model, reqs, got, stock, hf, {"seconds": seconds, "grids": grids}


@needs_vllm
def test_qwen3_vl_clips_keep_the_hugging_face_paths_cells_and_answers(tiny_qwen3):
    """Every clip at every budget, under another clip's question and beside a picture: the same kept cells over
    space and time (each frame group keeping what the space-time choice gives it) and the same greedy tokens."""
    import torch

    from arr_coc.serving.vllm.settings import group_counts

    model, reqs, got, _, hf, seen = tiny_qwen3
    pruned = [r["name"] for r in reqs if r["budget"] != "1.0" and not r["name"].startswith("chat5-")]
    assert len(pruned) >= len(BUDGETS) * N_TINY + 5
    assert {n: got[n]["error"] for n in pruned if got[n]["error"]} == {}
    assert {n: (got[n]["kept"], hf[n][1]) for n in pruned if got[n]["kept"] != hf[n][1]} == {}
    assert _differ(got, hf, pruned, model) == {}
    pads = {n: sum(len(k) for k in got[n]["kept"]) for n in pruned}
    assert {n: (got[n]["visual_tokens"], pads[n]) for n in pruned if got[n]["visual_tokens"] != pads[n]} == {}
    split = {}                               # (grid, budget) -> the per-group counts the choice gave
    for r in reqs:
        if r["name"] in pruned:
            t, h, w = seen["grids"][r["clips"][0]]
            counts = tuple(group_counts(torch.tensor(got[r["name"]]["kept"][-1]), t, h * w // 4))
            split.setdefault((t, h, w, r["budget"]), set()).add(counts)
    assert any(len(c) > 1 for c in split.values())   # one grid and budget, other splits: the content decides
    print(f"tiny Qwen3-VL clips: {len(pruned)} pruned requests equal to the HF path; "
          f"{sum(len(c) for c in split.values())} per-group splits over {len(split)} grid-budget pairs; "
          f"plugin engine {seen['seconds']:.0f} s")


@needs_vllm
def test_qwen3_vl_clips_kept_whole_are_stock_vllms_token_for_token(tiny_qwen3):
    """Budget 1.0 through the plugin (the choice in the processor keeps every cell) and stock vLLM: the same
    prompt and the same tokens, the clip's placeholder written bare and through the chat template."""
    _, reqs, got, stock, _, _ = tiny_qwen3
    every = [r["name"] for r in reqs if r["budget"] == "1.0"]
    assert len(every) == N_TINY + N_CHAT
    assert {n: (got[n]["token_ids"], stock[n]["token_ids"]) for n in every
            if got[n]["token_ids"] != stock[n]["token_ids"]} == {}
    assert {got[n]["prompt_tokens"] - stock[n]["prompt_tokens"] for n in every} == {0}


@needs_vllm
def test_the_question_moves_a_qwen3_vl_clips_cells(tiny_qwen3):
    """The negative control: the same clip under another question keeps other cells on most clips."""
    _, reqs, got, _, _, _ = tiny_qwen3
    other = [r["name"] for r in reqs if r["name"].startswith("other-")]
    assert len(other) >= 5
    own = {n: got[n.replace("other-", "") + "@0.05"]["kept"] for n in other}
    moved = sum(got[n]["kept"] != k for n, k in own.items())
    print(f"tiny Qwen3-VL clips: another question moved the cells of {moved} of {len(other)}")
    assert moved >= len(other) // 2


@needs_vllm
def test_chunked_prefill_keeps_a_qwen3_vl_clips_cells_and_answers(tiny_qwen3, tmp_path):
    """Prefill in chunks of 32 tokens: a chunk ends inside a frame group's pads, between groups and inside a
    timestamp; each group's kept cells land at the same positions (the same cells and tokens as one chunk)."""
    model, reqs, got, _, _, _ = tiny_qwen3
    some = [r for r in reqs if r["budget"] in ("0.25", "1.0") and not r["name"].startswith(("other-", "chat-"))][::2]
    chunked = _serve(some, tmp_path, "--model", model, "--layer", "untrained", "--max-batched-tokens", "32")
    assert {r["name"]: (chunked[r["name"]]["kept"], chunked[r["name"]]["token_ids"]) for r in some} == \
        {r["name"]: (got[r["name"]]["kept"], got[r["name"]]["token_ids"]) for r in some}


@needs_vllm
def test_tensor_parallel_2_keeps_a_qwen3_vl_clips_cells(tiny_qwen3, tmp_path):
    """Two tensor-parallel workers (one core each) behind Qwen3-VL's processor-side choice: every frame group keeps
    one worker's cells and pads. The random model's answers are near-ties everywhere and tensor parallelism sums its
    matmuls in another order, so an answer may differ only where one worker's first differing token was a float32
    near-tie (margin under 1e-3)."""
    model, reqs, got, _, _, _ = tiny_qwen3
    some = [r for r in reqs if r["budget"] == "0.1" and not r["name"].startswith(OTHER)][:8]
    some += [r for r in reqs if r["name"].startswith("mixed-")][:2]
    tp2 = _serve(some, tmp_path, "--model", model, "--layer", "untrained", "--tp", "2",
                 env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert {r["name"]: (tp2[r["name"]]["kept"], tp2[r["name"]]["prompt_tokens"]) for r in some} == \
        {r["name"]: (got[r["name"]]["kept"], got[r["name"]]["prompt_tokens"]) for r in some}
    eos = _eos(model)
    margins = _margins_where_they_differ(got, _differ(got, {n: (_answer(tp2[n]["token_ids"], eos), None)
                                                            for n in tp2}, [r["name"] for r in some], model))
    print(f"tiny Qwen3-VL clips, tensor parallel 2: {len(some)} of {len(some)} cells, {len(some) - len(margins)} "
          f"answers equal; margins where not: {margins}")
    assert all(m is not None and m < 1e-3 for m in margins.values()), margins


def _serve_check(model: str, layer: str, sent: list[dict], offline: dict[str, dict], tmp: Path) -> None:
    """`vllm serve` (scripts/vllm_serve_check.py, the openai client, clips as `video_url` data URLs) asked `sent`,
    whose last request ("bad") has a bad budget: every other answer and prompt length is the offline engine's, "bad"
    is refused 400 in the project's words, and the server answers after it."""
    (tmp / "reqs.json").write_text(json.dumps(sent))
    cmd = [str(VLLM_PY), "scripts/vllm_serve_check.py", "--model", model, "--layer", layer, "--encode", "before",
           "--requests", str(tmp / "reqs.json"), "--out", str(tmp / "serve.json")]
    done = vllm_run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:] + (tmp / "serve.log").read_text()[-3000:]
    server = json.loads((tmp / "serve.json").read_text())["requests"]
    asked = [r["name"] for r in sent if r["name"] != "bad"]
    assert {n: (server[n]["answer"], server[n]["prompt_tokens"]) for n in asked} == \
        {n: (offline[n]["answer"], offline[n]["prompt_tokens"]) for n in asked}
    assert server["bad"]["error"]["status"] == 400 and "is not a budget" in server["bad"]["error"]["message"]
    assert server["__after"]["error"] is None


@needs_vllm
def test_the_openai_server_answers_qwen3_vl_clips_as_the_offline_engine(tiny_qwen3, tmp_path):
    """`vllm serve` with the tiny Qwen3-VL, clips as `video_url` data URLs read at 2 fps (--media-io-kwargs, so each
    group's timestamp is the offline requests'): the offline engine's answers and prompt tokens at 5 % (the choice
    in the API server's processor) and at 1.0; a bad budget 400, and the server serves on."""
    model, reqs, got, _, _, _ = tiny_qwen3
    sent = [r for r in reqs if r["name"].startswith(("chat5-", "chat-"))]
    sent += [{**sent[0], "name": "bad", "budget": "lots"}]
    _serve_check(model, "untrained", sent, got, tmp_path)


@needs_vllm
def test_qwen3_vl_clips_in_bf16_keep_the_hugging_face_paths_cells(tiny_qwen3, tmp_path):
    """Served in bf16: the processor's choice reads the clips' float32 patches (their bits, which Qwen3-VL's per-clip
    processor calls would drop, `_CLIP_BITS`) and the question's rows cast to bf16, as the Hugging Face path in bf16
    (its layer in float32) reads them: every cell equal; answers through bf16 kernels differ only at near-ties."""
    import torch

    from arr_coc import ARRCOC

    model, reqs, _, _, _, _ = tiny_qwen3
    some = [r for r in reqs if r["budget"] == "0.05" and "prompt" in r and not r["name"].startswith(OTHER)]
    got = _serve(some, tmp_path, "--model", model, "--layer", "untrained", "--dtype", "bfloat16")
    vlm = ARRCOC.from_pretrained(model, arr_coc=None, adapter=False, dtype=torch.bfloat16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vlm.layer
    hf = _hf_answers(vlm, some, model)
    assert {r["name"]: (got[r["name"]]["kept"], hf[r["name"]][1]) for r in some
            if got[r["name"]]["kept"] != hf[r["name"]][1]} == {}
    margins = _margins_where_they_differ(got, _differ(got, hf, [r["name"] for r in some], model))
    print(f"tiny Qwen3-VL clips in bf16: {len(some)} of {len(some)} cells, {len(some) - len(margins)} answers equal; "
          f"margins where not: {sorted(m for m in margins.values() if m is not None)}")
    assert all(m is not None and m < 1.0 for m in margins.values()), margins


# -- the OpenAI server: video_url parts ------------------------------------------------------------------------------

@needs_vllm
def test_the_openai_server_answers_clips_as_the_offline_engine(served, tmp_path):
    """`vllm serve` asked through the openai client, clips as `video_url` data URLs (frames decoded without loss):
    the same answers and prompt tokens as the offline engine; a bad budget is refused 400 and the server serves on."""
    reqs, got = served
    sent = [r for r in reqs if r["budget"] == "0.05" and not r["name"].startswith(OTHER)][:8]
    sent += [r for r in reqs if r["name"].startswith("mixed-")][:4]
    sent += [{**sent[0], "name": "bad", "budget": "lots"}]
    _serve_check(MODEL, LAYER, sent, got, tmp_path)


# -- bf16 serving ---------------------------------------------------------------------------------------------------

N_BF16 = 30


@needs_vllm
def test_bf16_serving_keeps_a_clips_cells(served, tmp_path):
    """The model served in bf16 (as deployments serve it): the choice reads the video processor's float32 patches
    (handed on as their bits), so every clip keeps the Hugging Face path's cells in bf16 (its layer in float32);
    greedy answers through bf16 kernels: at least 90% the same."""
    import torch

    from arr_coc import ARRCOC

    reqs, _ = served
    some = [r for r in reqs if r["budget"] == "0.05" and not r["name"].startswith(OTHER)][:N_BF16]
    got = _serve(some, tmp_path, "--dtype", "bfloat16")
    hf = _hf_answers(ARRCOC.from_pretrained(MODEL, arr_coc=LAYER, adapter=False, dtype=torch.bfloat16), some, MODEL)
    assert {r["name"]: (got[r["name"]]["kept"], hf[r["name"]][1]) for r in some
            if got[r["name"]]["kept"] != hf[r["name"]][1]} == {}
    assert len(_differ(got, hf, [r["name"] for r in some], MODEL)) <= len(some) // 10
