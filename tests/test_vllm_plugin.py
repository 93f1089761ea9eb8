"""The vLLM plugin (arr_coc/serving/vllm, docs/SERVING.md).

Its pure part (settings, budgets, question ids, positions) is tested here always. Served through vLLM, it runs in
vLLM's own environment (.venv-vllm, which `make test` builds when missing), so those tests run
`scripts/vllm_compare.py` there and compare with the Hugging Face path here. Outside CI they are skipped where that
environment is missing (a bare `pytest`); in CI (CI=true) a missing environment fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _vllm import ROOT, VLLM_PY, needs_vllm, run as vllm_run   # one vLLM import per session (_vllm_forks)

from arr_coc.budget import BudgetError
from arr_coc.paths import LayerNotFound
from arr_coc.serving.vllm.settings import (Placed, RequestRefused, ServeError, ServeSettings, cell_rows, check_lora,
                                           check_picture, check_rows, clip_count, clips_served, frame_group_positions,
                                           frame_group_spans, frame_units, group_counts, kept_count, kept_positions,
                                           place_kept_positions, prompt_positions, question_ids, refuse_clips,
                                           request_budget, screen_request_kwargs, server_fingerprint, unit_cells)

MODEL, LAYER = "checkpoints/shapes-qwen2vl", "checkpoints/arr-coc-shapes"
LAYERS = {"after": LAYER, "before": "checkpoints/arr-coc-shapes-before"}
BUDGETS = ("0.05", "0.1", "0.25", "1.0")
N_ITEMS = int(os.environ.get("ARR_COC_VLLM_ITEMS", "200"))   # the equality checks' items
N_SETUPS = min(N_ITEMS, 40)          # items for the setups compared with one worker (parallel, chunked prefill)


class Cfg:
    def __init__(self, arr_coc=None):
        if arr_coc is not None:
            self.arr_coc = arr_coc


# -- the pure part ------------------------------------------------------------------------------------------------

def test_server_settings_are_read_and_refused_in_one_line():
    assert ServeSettings.of(Cfg()) == ServeSettings()
    got = ServeSettings.of(Cfg({"layer": LAYER, "budget": "10%"}))
    assert got.layer == LAYER and got.budget == 0.1 and got.encode == "after"
    assert ServeSettings.of(Cfg({"budget": 64})).budget == 64               # a count, as over JSON
    for bad, match in (({"encode": "inside"}, "not served"), ({"budgets": 0.1}, "unknown keys"),
                       ({"method": "fastv"}, "not served"), ("[1]", "must be a mapping")):
        with pytest.raises(ServeError, match=match):
            ServeSettings.of(Cfg(bad))
    with pytest.raises(LayerNotFound, match="no trained ARR-COC layer"):
        ServeSettings.of(Cfg({"layer": "/nowhere/layer"}))
    with pytest.raises(BudgetError, match="ambiguous"):
        ServeSettings.of(Cfg({"budget": 1}))
    before = {"layer": LAYERS["before"], "encode": "before"}              # its folder ships a LoRA adapter
    assert ServeSettings.of(Cfg(before)).adapter == os.path.join(LAYERS["before"], "adapter")   # on by default
    assert ServeSettings.of(Cfg({**before, "adapter": True})).adapter == os.path.join(LAYERS["before"], "adapter")
    assert ServeSettings.of(Cfg({**before, "adapter": False})).adapter is None
    assert ServeSettings.of(Cfg({"layer": LAYER})).adapter is None          # ships none
    with pytest.raises(ServeError, match="ships no adapter"):
        ServeSettings.of(Cfg({"layer": LAYER, "adapter": True}))
    with pytest.raises(ServeError, match='before the tower only.*"adapter": false'):
        ServeSettings.of(Cfg({"layer": LAYERS["before"], "encode": "after"}))
    with pytest.raises(ServeError, match="write true"):
        ServeSettings.of(Cfg({**before, "adapter": "yes"}))


class Lora:
    def __init__(self, tower=True, rank=16, mm=None):
        self.enable_tower_connector_lora, self.max_lora_rank, self.default_mm_loras = tower, rank, mm


def test_the_layers_adapter_needs_vllms_lora_on_the_tower_or_is_refused_in_one_line():
    served = ServeSettings.of(Cfg({"layer": LAYERS["before"], "encode": "before"}))
    adapter = os.path.abspath(os.path.join(LAYERS["before"], "adapter"))
    for off in (None, Lora(tower=False), Lora(rank=8)):                     # LoRA off, tower LoRA off, rank too low
        with pytest.raises(ServeError, match="--enable-tower-connector-lora --max-lora-rank 16 --default-mm-loras"):
            check_lora(served, off)
    assert "every image request" in check_lora(served, Lora(mm={"image": adapter}))
    assert "only where it names it" in check_lora(served, Lora())
    assert check_lora(ServeSettings.of(Cfg({"layer": LAYER})), None) is None   # no adapter: nothing to check


def test_a_qwen3_vl_server_for_clips_after_the_tower_is_refused_in_one_line():
    """Every family's clips are served before the tower; Qwen3-VL's choose in the processor (each frame group's
    pads are counted there), so a Qwen3-VL server started for clips after the tower stops in one line."""
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        refuse_clips({"video": 1}, family, "before")
        assert clips_served(family, "before")
    for family in ("qwen2_vl", "qwen2_5_vl"):
        refuse_clips({"video": 1}, family, "after")
    assert not clips_served("qwen3_vl", "after")
    refuse_clips({"image": 1}, "qwen3_vl", "after")
    refuse_clips(None, "qwen3_vl", "after")
    refuse_clips({"video": 0}, "qwen3_vl", "after")
    with pytest.raises(ServeError, match="serves Qwen3-VL clips before the tower only") as err:
        refuse_clips({"video": 1}, "qwen3_vl", "after")
    assert "\n" not in str(err.value) and '"encode": "before"' in str(err.value)


def test_a_requests_budget_is_the_projects_budget_and_the_default_the_layers():
    server = ServeSettings.of(Cfg({"layer": LAYER}))
    assert request_budget({}, server) == 0.25                               # the layer's configured budget
    assert request_budget({"arr_coc_budget": "5%"}, server) == 0.05
    assert request_budget({"arr_coc_budget": 64}, server) == 64
    assert request_budget({}, ServeSettings(budget=0.1)) == 0.1
    for bad in ("1", 0, "-3", "lots", 1.5):
        with pytest.raises(BudgetError):
            request_budget({"arr_coc_budget": bad}, server)
    assert server.layer_mode_note() and "keeps exactly each request's budget" in server.layer_mode_note()
    # The operator's default as vLLM users give defaults (--mm-processor-kwargs), under a request's own.
    operator = {"arr_coc_budget": "5%"}
    assert request_budget({}, server, operator) == 0.05
    assert request_budget({"arr_coc_budget": 64}, server, operator) == 64
    with pytest.raises(BudgetError, match="--mm-processor-kwargs arr_coc_budget"):
        request_budget({}, server, {"arr_coc_budget": "lots"})


@pytest.mark.parametrize("key", ["min_pixels", "max_pixels", "image_mean", "do_normalize", "patch_size", "merge_size",
                                 "size", "do_resize", "temporal_patch_size"])
def test_a_request_sets_its_budget_and_nothing_that_changes_the_picture(key):
    line = None
    with pytest.raises(RequestRefused) as err:
        screen_request_kwargs({"arr_coc_budget": "5%", key: 1})
    line = str(err.value)
    assert "\n" not in line and f"'{key}'" in line and "sets 'arr_coc_budget' only" in line
    # The plugin's internal keys are dropped (a client cannot set the question, the count or the server's key).
    assert screen_request_kwargs({"arr_coc_budget": 64, "arr_coc_question": [1], "arr_coc_count": 9,
                                  "arr_coc_server": "x"}) == {"arr_coc_budget": 64}


def test_a_picture_too_large_for_every_token_is_refused_whatever_the_budget():
    check_picture((1, 64, 64), 2, 2048, 0)                                  # 1,024 cells fit
    with pytest.raises(RequestRefused, match="image 1 is 4,096 merged cells.*max-model-len 2,048"):
        check_picture((1, 128, 128), 2, 2048, 1)


def test_rows_are_checked_against_placeholders_naming_the_image():
    check_rows([13, 26], [13, 26])
    with pytest.raises(RuntimeError, match="image 1 of this encoder batch kept 13 rows for 12 placeholders"):
        check_rows([5, 13], [5, 12])


def test_the_servers_fingerprint_names_its_layer_mode_and_adapter():
    after, before = ServeSettings.of(Cfg({"layer": LAYER})), ServeSettings.of(Cfg({"layer": LAYERS["before"],
                                                                                    "encode": "before"}))
    bare = ServeSettings.of(Cfg({"layer": LAYERS["before"], "encode": "before", "adapter": False}))
    prints = {server_fingerprint(s) for s in (after, before, bare, ServeSettings())}
    assert len(prints) == 4 and server_fingerprint(after) == server_fingerprint(ServeSettings.of(Cfg({"layer": LAYER})))


def test_placeholders_are_the_budgets_count_of_merged_cells():
    assert kept_count(0.1, (1, 32, 32), 2) == 26                            # round-half-up of 25.6
    assert kept_count(64, (1, 32, 32), 2) == 64 and kept_count(999, (1, 32, 32), 2) == 256
    assert kept_count(1.0, (1, 16, 24), 2) == 96
    with pytest.raises(ServeError, match="clip"):
        kept_count(0.1, (2, 32, 32), 2)


@pytest.mark.parametrize("floor", [0, 1, 3])
def test_a_clips_placeholders_are_what_the_space_time_choice_keeps(floor):
    """`clip_count`, written before the choice runs, is the number of cells `allocate` keeps over the clip's
    t * h * w cells, for every budget (a share, a count, below the one-per-group minimum, above every cell) and the
    layer's `min_per_group`; a negative control: the image rule (`count_of` over the cells) is not."""
    from arr_coc.budget import count_of
    from arr_coc.core.temporal import allocate

    g = torch.Generator().manual_seed(0)
    differs = 0
    for t, h, w in ((4, 24, 24), (1, 12, 16), (8, 4, 4), (3, 2, 2)):
        n = (h // 2) * (w // 2)
        for budget in (0.001, 0.03, 0.05, 0.1, 0.5, 1.0, 1, 3, 64, 10 ** 6):
            score = torch.rand(t, h // 2, w // 2, generator=g)
            kept = int(allocate(score, count_of(budget, t * n), floor).sum())
            assert clip_count(budget, (t, h, w), 2, floor) == kept, (t, h, w, budget)
            differs += count_of(budget, t * n) != kept
    assert differs > 0


def test_a_clip_is_its_frame_groups_and_its_cells_are_numbered_over_space_and_time():
    units, clips, groups = frame_units([(4, 6, 8), (1, 4, 4)])
    assert units == [(1, 6, 8)] * 4 + [(1, 4, 4)] and clips == [0, 0, 0, 0, 1] and groups == [0, 1, 2, 3, 0]
    pos = kept_positions(torch.tensor([0, 13, 25, 47]), (3, 4), groups=4)             # 12 cells per group
    assert pos.tolist() == [[0, 0, 0, 4], [1, 0, 1, 4], [2, 0, 1, 4], [3, 2, 3, 4]]
    scaled = kept_positions(torch.tensor([0, 13, 25, 47]), (3, 4), groups=4, factor=2.5)   # Qwen2.5-VL's step
    assert scaled[:, 0].tolist() == [0, 2, 5, 7] and scaled[0, 3] == 8                  # int(3 * 2.5) + 1


def _stock_positions(n_tokens: int, items: list[tuple[int, int, int, int, float]]) -> torch.Tensor:
    """vLLM's Qwen2-VL / Qwen2.5-VL `get_mrope_input_positions` (qwen2_vl.py:1354-1391) for every-token items
    (offset, t, h, w, time factor), written out here as the reference the plugin's positions must meet."""
    import numpy as np

    pieces, st = [], 0
    for offset, t, h, w, factor in items:
        text_len, st_idx = offset - st, (pieces[-1].max() + 1 if pieces else 0)
        pieces.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        grid = np.indices((t, h, w))
        if factor != 1.0:
            grid[0] = (grid[0] * factor).astype(np.int64)
        pieces.append(grid.reshape(3, -1) + text_len + st_idx)
        st = offset + t * h * w
    st_idx = pieces[-1].max() + 1
    pieces.append(np.broadcast_to(np.arange(n_tokens - st), (3, n_tokens - st)) + st_idx)
    return torch.from_numpy(np.concatenate(pieces, axis=1))


@pytest.mark.parametrize("factor", [1.0, 0.5, 2.0, 2.5])
def test_a_clip_kept_whole_sits_where_stock_vllm_puts_it_and_pruned_keeps_the_texts_positions(factor):
    """An image then a clip (3 groups of 2x3 cells), text between and after: with every cell kept the placed
    positions are vLLM's own; pruned, the kept cells keep theirs and the text does not move."""
    image, video = 6, 7
    ids = torch.tensor([1, 2] + [image] * 4 + [3] + [video] * 18 + [4, 5])
    stock = _stock_positions(len(ids), [(2, 1, 2, 2, 1.0), (7, 3, 2, 3, factor)])
    items = [Placed(2, 4, 2, 2), Placed(7, 18, 2, 3, 3, factor)]
    kept = [kept_positions(torch.arange(4), (2, 2)), kept_positions(torch.arange(18), (2, 3), 3, factor)]
    positions, delta = prompt_positions(len(ids), items)
    placed, placed_delta = place_kept_positions(ids, kept, positions, 0, (image, video))
    assert torch.equal(placed, stock) and placed_delta == delta == int(stock.max()) + 1 - len(ids)
    cells = torch.tensor([1, 8, 17])                                       # one cell in each group
    short = torch.tensor([1, 2] + [image] * 4 + [3] + [video] * 3 + [4, 5])
    positions, _ = prompt_positions(len(short), [Placed(2, 4, 2, 2), Placed(7, 3, 2, 3, 3, factor)])
    pruned, _ = place_kept_positions(short, [kept[0], kept_positions(cells, (2, 3), 3, factor)], positions, 0,
                                     (image, video))
    assert torch.equal(pruned[:, 7:10], stock[:, 7 + cells]) and torch.equal(pruned[:, -2:], stock[:, -2:])
    assert not torch.equal(pruned[:, 7:10], positions[:, 7:10])          # the provisional ones were replaced


def test_a_qwen3_vl_clip_kept_whole_is_stock_vllms_and_pruned_keeps_the_hugging_face_paths_positions():
    """A Qwen3-VL clip of 3 frame groups (2x3 cells each), each group its timestamp text, <|vision_start|>, its pads
    and <|vision_end|>: kept whole, each group's pads are placed as vLLM places them (each group like an image,
    qwen3_vl.py:2888-2961); pruned to a choice's cells (a count per group, one group keeping two), every token
    keeps the position it has in the unpruned prompt, the Hugging Face path's rule (`rewrite`)."""
    video, start, end, stamp = 7, 8, 9, [20, 21]

    def prompt(per_group: list[int]) -> list[int]:
        return [1, 2] + [x for k in per_group for x in stamp + [start] + [video] * k + [end]] + [4, 5]

    full = prompt([6, 6, 6])
    spans = frame_group_spans(full, 2, len(full) - 2, start, end)
    assert spans == [(5, 6), (15, 6), (25, 6)]
    stock = _stock_positions(len(full), [(o, 1, 2, 3, 1.0) for o, _ in spans])
    positions, delta = prompt_positions(len(full), [Placed(o, k, 2, 3) for o, k in spans])
    kept = frame_group_positions(torch.arange(18), (2, 3))
    placed, placed_delta = place_kept_positions(torch.tensor(full), [kept], positions, 0, (6, video))
    assert torch.equal(placed, stock) and placed_delta == delta == int(stock.max()) + 1 - len(full)
    cells = torch.tensor([1, 8, 9, 17])                                  # groups 0, 1, 1, 2
    assert group_counts(cells, 3, 6) == [1, 2, 1]
    short = prompt([1, 2, 1])
    spans = frame_group_spans(short, 2, len(short) - 2, start, end)
    positions, _ = prompt_positions(len(short), [Placed(o, k, 2, 3) for o, k in spans])
    pruned, pruned_delta = place_kept_positions(torch.tensor(short), [frame_group_positions(cells, (2, 3))],
                                                positions, 0, (6, video))
    pads = [5 + 10 * (c // 6) + c % 6 for c in cells.tolist()]           # each kept cell's index in `full`
    kept_at = [i for i, t in enumerate(full) if t != video] + pads
    assert torch.equal(pruned, stock[:, sorted(kept_at)]) and pruned_delta == int(stock.max()) + 1 - len(short)


def test_a_clips_kept_cells_over_space_and_time_are_its_frame_groups_cells():
    """`unit_cells`: clips' kept cells numbered over (t, h, w) -> per frame group its cells, `frame_units`' order."""
    got = unit_cells(torch.tensor([1, 8, 9, 17, 0, 3]), [4, 2], [(3, 4, 6), (1, 4, 4)], 2)
    assert [g.tolist() for g in got] == [[1], [2, 3], [5], [0, 3]]


def test_the_checkpoints_embedding_rows_are_the_embedding_in_the_serving_dtype(tmp_path):
    """The processor's question embedding (Qwen3-VL clips): the checkpoint's rows, read one by one, cast as vLLM
    casts the loaded weight; a checkpoint without the tensor is refused naming what it looked for."""
    from safetensors.torch import save_file

    from arr_coc.serving.vllm.checkpoint import CheckpointEmbedding

    weight = torch.randn(10, 4)
    save_file({"model.language_model.embed_tokens.weight": weight, "lm_head.weight": weight.clone()},
              str(tmp_path / "model.safetensors"))
    ids = torch.tensor([[3, 1, 0], [0, 3, 9]])
    assert torch.equal(CheckpointEmbedding(str(tmp_path), torch.float32)(ids), weight[ids])
    assert torch.equal(CheckpointEmbedding(str(tmp_path), torch.bfloat16)(ids), weight.to(torch.bfloat16)[ids])
    (tmp_path / "other").mkdir()
    save_file({"lm_head.weight": weight}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens"):
        CheckpointEmbedding(str(tmp_path / "other"), torch.float32)


def test_the_question_is_read_as_the_hugging_face_path_reads_it():
    from arr_coc.qwen.prompt import PromptTokens

    tokens = PromptTokens(image=6, video=7, vision_end=4, im_end=2, pad=0, special=frozenset({0, 1, 2, 3, 4}),
                          user_turn=(1, 80, 81))                           # <|im_start|> user \n
    prompt = [1, 80, 81, 3, 6, 4, 60, 61, 62, 2, 1, 70]                   # ... <vision_end> q q q <im_end> ...
    assert question_ids(prompt, tokens) == [60, 61, 62]
    # A follow-up turn is asked its own question, not the first turn's; an image in it: the text after it.
    chat = prompt[:-2] + [1, 70, 81, 90, 91, 2, 1, 80, 81, 63, 64, 2, 1, 70, 81]
    assert question_ids(chat, tokens) == [63, 64]
    assert question_ids(chat[:-3] + [1, 80, 81, 65, 3, 6, 4, 66, 2], tokens) == [66]
    # A raw prompt (no turns, no <|vision_start|> / <|vision_end|>): its text.
    assert question_ids([6, 6, 60, 61], tokens) == [60, 61]


def test_the_kept_cells_patch_rows():
    rows = cell_rows([(1, 4, 4), (1, 2, 4)], [torch.tensor([1, 3]), torch.tensor([0])], 2)
    assert rows.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19]   # image 2's rows start after 16


def test_kept_positions_and_the_prompts_positions():
    pos = kept_positions(torch.tensor([0, 5, 11]), (3, 4))
    assert pos.tolist() == [[0, 0, 0, 4], [0, 1, 1, 4], [0, 2, 3, 4]]
    # Keep-all: the positions vLLM computes for a stock Qwen2-VL prompt (text, image grid, text after max(h, w)).
    full, delta = prompt_positions(2 + 12 + 3, [(2, 12, 3, 4)])
    assert full[:, :2].tolist() == [[0, 1]] * 3
    assert full[:, 2:14].tolist() == [[2] * 12, [2 + i // 4 for i in range(12)], [2 + i % 4 for i in range(12)]]
    assert full[:, 14:].tolist() == [[6, 7, 8]] * 3 and delta == 9 - 17
    # Pruned to 5 pads: the text after keeps its unpruned positions.
    pruned, delta = prompt_positions(2 + 5 + 3, [(2, 5, 3, 4)])
    assert pruned[:, 7:].tolist() == [[6, 7, 8]] * 3 and delta == 9 - 10


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_kept_positions_are_placed_the_same_whatever_the_prefill_chunks(chunk):
    """Two images (3x4 keeping cells 1, 6, 11; 2x2 keeping 3) in a prompt prefilled `chunk` tokens at a time, the
    runner's way (each chunk gets its images' slices inside it): every chunking gives the one-shot positions, the
    kept cells at their own (t, h, w) and the text where the unpruned prompt has it."""
    image, start = 6, 3
    ids = torch.tensor([1, 9, start, image, image, image, 8, 9, start, image, 8, 9, 9])
    kept = [kept_positions(torch.tensor([1, 6, 11]), (3, 4)), kept_positions(torch.tensor([3]), (2, 2))]
    spans = [(3, 3), (9, 1)]                                                  # (offset, pads) per image
    positions, delta = prompt_positions(len(ids), [(3, 3, 3, 4), (9, 1, 2, 2)])
    whole, whole_delta = place_kept_positions(ids, kept, positions, 0, image)
    assert whole[:, 3:6].tolist() == [[3, 3, 3], [3, 4, 5], [4, 5, 6]]        # base 3 + (0, h, w)
    assert whole[:, 6:9].tolist() == [[7, 8, 9]] * 3 and whole[:, 9].tolist() == [10, 11, 11]
    assert whole_delta == delta == int(whole.max()) + 1 - len(ids)
    got = positions.clone()
    for done in range(0, len(ids), chunk):
        end = min(done + chunk, len(ids))
        pieces = [k[max(done - o, 0): max(min(end - o, n), 0)] for k, (o, n) in zip(kept, spans)]
        got, _ = place_kept_positions(ids, [p for p in pieces if len(p)], got, done, image)
    assert torch.equal(got, whole)


def test_a_raw_prompt_without_vision_start_gets_its_pads_placed():
    """`<|image_pad|>` with no <|vision_start|> before it (a raw prompt; this raised IndexError in the worker and
    killed the engine): the pads take their image's first position, the text after keeps the unpruned one."""
    image = 6
    ids = torch.tensor([image, image, 8, 9])                              # two of a 2x2 image's pads, then text
    positions, delta = prompt_positions(len(ids), [(0, 2, 2, 2)])
    placed, placed_delta = place_kept_positions(ids, [kept_positions(torch.tensor([1, 2]), (2, 2))], positions, 0,
                                                image)
    assert placed.tolist() == [[0, 0, 2, 3], [0, 1, 2, 3], [1, 0, 2, 3]] and placed_delta == delta


# -- served by vLLM ----------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("engine_threads")   # the module's HF references on vLLM's threads (conftest)


def _one_process(extra: tuple[str, ...]) -> tuple[str, ...]:
    """The offline engine in the script's own process, unless it is tensor parallel (which needs its workers): the
    same engine, started without two processes that import vLLM again (the servers' tests keep vLLM's processes)."""
    return () if "--tp" in extra else ("--one-process",)


def _vllm(items: Path, out: Path, *extra: str, n: int = N_ITEMS) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}   # PYTHONPATH: the tree first (conftest)
    cmd = [str(VLLM_PY), "scripts/vllm_compare.py", "--items", str(items), "--n", str(n), "--out", str(out),
           *extra, *_one_process(extra)]
    done = vllm_run(cmd, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    subprocess.run([sys.executable, "-m", "arr_coc_shapes", "gen-data", "--out", str(tmp), "--split", "test", "--n",
                    str(N_ITEMS), "--seed", "0"], cwd=ROOT, check=True, capture_output=True)
    items = tmp / "test.jsonl"
    plugin = _vllm(items, tmp / "plugin.json", "--budgets", ",".join(BUDGETS), "--layer", LAYER, "--pairs", "3")
    stock = _vllm(items, tmp / "stock.json", "--stock")
    return items, plugin["items"], stock["items"]


@pytest.fixture(scope="module")
def served_before(served, tmp_path_factory):
    items = served[0]
    got = _vllm(items, tmp_path_factory.mktemp("before") / "before.json", "--budgets", ",".join(BUDGETS[:3]),
                "--layer", LAYERS["before"], "--encode", "before")
    return items, got["items"]


def _hf(items: Path, questions: list[tuple[dict, str]], budget: str, encode: str = "after", adapter: bool = False):
    """The Hugging Face path at the same budget, met exactly, with the layer folder's LoRA adapter or without it
    (as the plugin was served)."""
    from PIL import Image

    from arr_coc import ARRCOC
    from arr_coc.budget import parse_budget

    vlm = ARRCOC.from_pretrained(MODEL, arr_coc=LAYERS[encode], adapter=None if adapter else False)
    images = [Image.open(items.parent / it["image"]).convert("RGB") for it, _ in questions]
    return vlm.generate(images, [q for _, q in questions], budget=parse_budget(budget), budget_mode="exact",
                        max_new_tokens=16, encode=encode)


@needs_vllm
@pytest.mark.parametrize("encode", ["after", "before"])
@pytest.mark.parametrize("budget", BUDGETS[:3])
def test_vllm_keeps_the_hugging_face_paths_cells_and_answers(request, budget, encode):
    items, plugin = request.getfixturevalue("served")[:2] if encode == "after" else \
        request.getfixturevalue("served_before")
    listed = [json.loads(line) for line in items.read_text().splitlines()]
    rows = {r["id"]: r for r in plugin if r["kind"] == "item" and r["budget"] == budget}
    answers, traces = _hf(items, [(it, it["question"]) for it in listed], budget, encode)
    cells = {it["id"]: (rows[it["id"]]["kept"], tr.kept_indices[0].tolist()) for it, tr in zip(listed, traces)}
    said = {it["id"]: (rows[it["id"]]["answer"].strip(), a.strip()) for it, a in zip(listed, answers)}
    assert {i: c for i, c in cells.items() if c[0] != c[1]} == {}
    assert {i: a for i, a in said.items() if a[0] != a[1]} == {}


@pytest.fixture(scope="module")
def served_adapter(served, tmp_path_factory):
    items, adapter = served[0], os.path.join(LAYERS["before"], "adapter")
    got = _vllm(items, tmp_path_factory.mktemp("adapter") / "adapter.json", "--budgets", ",".join(BUDGETS[:3]),
                "--layer", LAYERS["before"], "--encode", "before", "--lora", adapter)
    return items, got["items"]


@needs_vllm
@pytest.mark.parametrize("budget", BUDGETS[:3])
def test_the_layers_adapter_through_vllms_lora_keeps_the_hugging_face_paths_answers(served_adapter, served_before,
                                                                                   budget):
    """The before-layer with its LoRA adapter (tower + language model), run by vLLM's LoRA (tower LoRA on), against
    the Hugging Face path's default (the adapter on): the same cells and answers; and the adapter changes answers
    (against the plugin without it), so the comparison can fail."""
    items, plugin = served_adapter
    listed = [json.loads(line) for line in items.read_text().splitlines()]
    rows = {r["id"]: r for r in plugin if r["kind"] == "item" and r["budget"] == budget}
    answers, traces = _hf(items, [(it, it["question"]) for it in listed], budget, "before", adapter=True)
    assert {it["id"]: rows[it["id"]]["kept"] for it in listed} == \
        {it["id"]: tr.kept_indices[0].tolist() for it, tr in zip(listed, traces)}
    assert {it["id"]: rows[it["id"]]["answer"].strip() for it in listed} == \
        {it["id"]: a.strip() for it, a in zip(listed, answers)}
    without = {r["id"]: r["answer"] for r in served_before[1] if r["budget"] == budget}
    assert any(rows[i]["answer"] != without[i] for i in without)


@needs_vllm
def test_keep_all_through_the_plugin_is_stock_vllm_token_for_token(served):
    _, plugin, stock = served
    keep_all = {r["id"]: (r["token_ids"], r["prompt_tokens"]) for r in plugin if r["budget"] == "1.0"}
    assert keep_all == {r["id"]: (r["token_ids"], r["prompt_tokens"]) for r in stock}


@needs_vllm
def test_two_questions_about_one_image_in_one_batch_keep_their_own_cells(served):
    items, plugin, _ = served
    pairs = [r for r in plugin if r["kind"] == "pair"]
    listed = {json.loads(line)["id"]: json.loads(line) for line in items.read_text().splitlines()}
    _, traces = _hf(items, [(listed[r["id"]], r["question"]) for r in pairs], "0.1")
    assert [r["kept"] for r in pairs] == [tr.kept_indices[0].tolist() for tr in traces]
    assert any(a["kept"] != b["kept"] for a, b in zip(pairs[::2], pairs[1::2]))   # the question moves the cells


@needs_vllm
def test_the_openai_server_answers_with_and_without_a_budget_and_refuses_a_bad_one(tmp_path):
    """`vllm serve` (its API-server entry) on 127.0.0.1 through the `openai` client: the server's budget (25%:
    64 of 256 cells), a share, a count, a bad budget (HTTP 400, the project's one line), then serving on."""
    out = tmp_path / "serve.json"
    done = vllm_run([str(VLLM_PY), "scripts/vllm_serve_check.py", "--out", str(out), "--budget", "0.25"],
                    env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["answers"] == {"server": " orange", "5%": " orange", "64": " orange", "after bad": " orange"}
    text = 27                                             # the prompt's tokens other than the image's pads
    assert {k: v["prompt_tokens"] - text for k, v in got["usage"].items()} == \
        {"server": 64, "5%": 13, "64": 64, "after bad": 26}
    assert got["errors"] == {"bad": {"status": 400, "message": "Error code: 400 - arr_coc_budget '1' is ambiguous: "
                                     "write 1.0 or 100% to keep every token, or 1tok to keep one token"}}


@needs_vllm
def test_the_server_runs_the_layers_adapter_for_image_requests(served, tmp_path):
    """`vllm serve` with the before-layer and its adapter as the server's default image LoRA (--default-mm-loras)
    answers as the Hugging Face path with its adapter, at the server's budget and a request's own; an item whose
    answer the adapter changes, so the check can fail. The same server without the LoRA flags stops at start."""
    items = served[0]
    item = json.loads(items.read_text().splitlines()[6])                  # test-000006: the adapter moves its count
    out = tmp_path / "serve.json"
    cmd = [str(VLLM_PY), "scripts/vllm_serve_check.py", "--out", str(out), "--layer", LAYERS["before"], "--encode",
           "before", "--adapter", "--budget", "0.05", "--image", str(items.parent / item["image"]), "--question",
           item["question"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = vllm_run(cmd, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())["answers"]
    pairs = [(item, item["question"])]
    with_adapter = {b: _hf(items, pairs, b, "before", adapter=True)[0][0].strip() for b in ("0.05", "0.1")}
    without = _hf(items, pairs, "0.05", "before")[0][0].strip()
    assert (got["server"].strip(), got["5%"].strip(), got["after bad"].strip()) == \
        (with_adapter["0.05"], with_adapter["0.05"], with_adapter["0.1"])
    assert without != with_adapter["0.05"]
    refused = vllm_run([a for a in cmd if a != "--adapter"], env=env, timeout=600)
    log = out.with_suffix(".log").read_text()
    assert refused.returncode != 0 and "ships a LoRA adapter (rank 16" in log and "--enable-tower-connector-lora" in log


@needs_vllm
def test_tensor_parallel_2_keeps_the_same_cells_and_answers(served, tmp_path):
    """vLLM's own parallelism, unchanged: two tensor-parallel workers on this one NUMA node (bound one core each)."""
    items, plugin, _ = served
    env_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        tp2 = _vllm(items, tmp_path / "tp2.json", "--budgets", "0.1", "--layer", LAYER, "--tp", "2",
                    n=N_SETUPS)["items"]
    finally:
        if env_bind is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = env_bind
    one = {r["id"]: (r["kept"], r["token_ids"]) for r in plugin if r["kind"] == "item" and r["budget"] == "0.1"}
    assert len(tp2) == N_SETUPS and all(r["kept"] is not None for r in tp2)
    assert {r["id"]: (r["kept"], r["token_ids"]) for r in tp2} == {i: one[i] for i in (r["id"] for r in tp2)}


@needs_vllm
def test_chunked_prefill_keeps_the_same_cells_and_answers(served, tmp_path):
    """Prefill 16 tokens at a time (max_num_batched_tokens): an image's pads span several steps, and a step can end
    between <|vision_start|> and its first pad (where vLLM's EVS helper fails): the same cells and tokens."""
    items, plugin, _ = served
    chunked = _vllm(items, tmp_path / "chunked.json", "--budgets", "0.1", "--layer", LAYER, "--chunk", "16",
                    n=N_SETUPS)["items"]
    one = {r["id"]: (r["kept"], r["token_ids"]) for r in plugin if r["kind"] == "item" and r["budget"] == "0.1"}
    assert len(chunked) == N_SETUPS and all(r["kept"] is not None for r in chunked)
    assert {r["id"]: (r["kept"], r["token_ids"]) for r in chunked} == {i: one[i] for i in (r["id"] for r in chunked)}
