"""The pipeline is backend-agnostic: the whole of it (ARR-COC's choice, encode before, a clip's temporal groups, a
second look, the trace) runs on a toy backend that is not Qwen at all, through the `VLMBackend` seam alone.

The toy model and its backends are in tests/_toy.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _toy import WIDTH, ToyBackend, ToyBackendBefore, scene

from arr_coc import ARRCOC
from arr_coc.budget import count_of
from arr_coc.core.layer import build_layer
from arr_coc.encode import EncodeConfig
from arr_coc.execution import Execution
from arr_coc.pipeline import Pruning
from arr_coc.pipeline.backend import MissingCapability


@pytest.fixture(scope="module")
def toy():
    """The core-only toy behind the front door, with an untrained layer at its width."""
    return ARRCOC(ToyBackend(), arr_coc=build_layer(None, WIDTH))


@pytest.fixture(scope="module")
def toy_before():
    """The toy with the `EncodesBefore` capability."""
    return ARRCOC(ToyBackendBefore(), arr_coc=build_layer(None, WIDTH))


def test_the_pipeline_runs_arr_coc_on_a_backend_that_is_not_qwen(toy):
    from arr_coc.pipeline.backend import CAPABILITIES, VLMBackend

    backend = toy.backend
    assert isinstance(backend, VLMBackend)                      # the core is all it implements
    assert not any(isinstance(backend, c) for c in CAPABILITIES)
    inputs = backend.build_inputs([[scene(0)], [scene(1), scene(2)]], ["what is red", "where is the star"])
    done = toy.answer(inputs, Pruning.of("arr_coc", 0.25), max_new_tokens=2)
    assert [tr.kept_per_image for tr in done.traces] == [[count_of(0.25, 48)], [count_of(0.25, 48)] * 2]
    assert done.traces[0].arr_coc is not None and done.traces[0].method == "arr_coc"
    every = toy.answer(inputs, Pruning.of("none"), max_new_tokens=2)
    assert [tr.kept_tokens for tr in every.traces] == [48, 96]
    assert done.new_tokens.shape == every.new_tokens.shape == (2, 2)
    answers, traces = toy.generate([[scene(0)]], ["what is red"], budget=0.25, max_new_tokens=2)
    assert traces[0].kept_tokens == count_of(0.25, 48) and answers[0].startswith("w")   # the front door's answer


def test_a_core_only_backend_refuses_what_it_lacks_in_one_line(toy):
    inputs = toy.backend.build_inputs([[scene(3)]], ["what is blue"])
    with pytest.raises(MissingCapability, match=r"cannot encode before the vision tower .*EncodesBefore \(missing "
                                                r"check_encode, context_cells, cost_by_count, encode_cells, "
                                                r"encode_gist\)"):
        toy.answer(inputs, Pruning.of("arr_coc", 0.25, encode="before"), max_new_tokens=1)
    with pytest.raises(MissingCapability, match="cannot give the language model's attention to FastV"):
        toy.answer(inputs, Pruning.of("fastv", 0.25, strict=True), max_new_tokens=1)
    with pytest.raises(MissingCapability, match="cannot answer a question without a picture"):
        toy.generate([[]], ["what is blue"])
    with pytest.raises(MissingCapability, match="cannot run fixed shapes"):
        toy.use(Execution.fast("cpu", compiler="eager"))


def test_encode_before_runs_the_toy_tower_on_the_chosen_cells_only(toy_before):
    vlm, backend = toy_before, toy_before.backend
    inputs = backend.build_inputs([[scene(3)]], ["what is blue"])
    backend.encoded_cells = 0
    after = vlm.answer(inputs, Pruning.of("arr_coc", 0.25), max_new_tokens=1)
    assert backend.encoded_cells == 48                           # every cell, then select
    backend.encoded_cells = 0
    before = vlm.answer(inputs, Pruning.of("arr_coc", 0.25, encode="before"), max_new_tokens=1)
    assert backend.encoded_cells == before.traces[0].kept_tokens == count_of(0.25, 48)
    assert before.traces[0].encode == "before" and after.traces[0].encode == "after"
    # the toy tower has no context, so the chosen cells' tokens are the same whichever mode encoded them
    kept = after.traces[0].kept_indices[0]
    same = Pruning.of("arr_coc", encode="before", kept_indices=[kept])
    assert torch.equal(vlm.answer(inputs, same, max_new_tokens=1).first.pruned.rows_tokens[0],
                       after.first.pruned.rows_tokens[0])


def test_a_clip_is_pruned_as_its_temporal_groups_with_one_budget(toy):
    clip = torch.stack([scene(4 + t) for t in range(4)])        # [T, 3, H, W]: four temporal groups
    inputs = toy.backend.build_inputs([[clip]], ["what moves first"])
    done = toy.answer(inputs, Pruning.of("arr_coc", 0.1), max_new_tokens=1)
    tr = done.traces[0]
    assert tr.clip_per_image == [0, 0, 0, 0] and tr.group_per_image == [0, 1, 2, 3]
    assert sum(tr.kept_per_group[0]) == tr.kept_tokens == count_of(0.1, 4 * 48)
    assert min(tr.kept_per_group[0]) >= 1                        # every group keeps its place


def test_a_second_look_runs_on_the_toy_backend(toy_before):
    inputs = toy_before.backend.build_inputs([[scene(9)]], ["what is green"])
    looks = EncodeConfig("before", saccade={"passes": 2, "threshold": -1.0, "budget": 0.05})
    done = toy_before.answer(inputs, Pruning.of("arr_coc", 0.1, encode=looks), max_new_tokens=1)
    tr = done.traces[0]
    assert len(tr.looks) == 2 and tr.looks[0].saccade and len(done.passes) == 2
    assert tr.kept_tokens == count_of(0.1, 48) + count_of(0.05, 48)
    one = toy_before.answer(inputs, Pruning.of("arr_coc", 0.1, encode=replace(looks, saccade={"passes": 1})),
                            max_new_tokens=1)
    assert one.traces[0].looks == [] and one.traces[0].kept_tokens == count_of(0.1, 48)


@pytest.mark.parametrize("method", ["arr_coc", "random", "grid", "divprune", "cdpruner"])
@pytest.mark.parametrize("encode", ["after", "before"])
def test_the_pure_choice_keeps_the_cells_the_pipeline_keeps(toy_before, method, encode):
    """`ARRCOC.choose` and `arr_coc.choose` with no model object at all keep exactly the pipeline's cells."""
    from arr_coc import choose

    if encode == "before" and method in ("divprune", "cdpruner"):
        pytest.skip("reads the encoded tokens: after the tower only")
    vlm, picture, question = toy_before, scene(11), "where is the red star"
    done = vlm.answer(vlm.backend.build_inputs([[picture]], [question]), Pruning.of(method, 0.2, encode=encode),
                      max_new_tokens=1)
    kept = done.traces[0].kept_indices[0]
    assert torch.equal(vlm.choose(picture, question, 0.2, method, encode=encode).kept[0], kept)
    ids = vlm.backend.build_inputs([[picture]], [question])["question_ids"]
    tokens = [vlm.backend._tower(picture, torch.arange(48))] if encode == "after" else None
    pure = choose([picture], [(6, 8)], ids, vlm.backend.embed_tokens, layer=vlm.layer, method=method, budget=0.2,
                  visual_tokens=tokens)
    assert torch.equal(pure.kept[0], kept) and pure.counts == [count_of(0.2, 48)]
    other = choose([picture], [(6, 8)], [ids[0][:1]], vlm.backend.embed_tokens, layer=vlm.layer, method=method,
                   budget=0.2, visual_tokens=tokens)
    if method == "arr_coc" and encode == "after":   # negative control: the question changes what is kept (the
        # untrained layer couples the question through the encoded tokens, so after the tower)
        assert not torch.equal(other.kept[0], kept)


def test_the_pure_choice_refuses_what_needs_the_vlm_in_one_line(toy):
    from arr_coc import choose

    args = ([scene(1)], [(6, 8)], [[3, 4]], toy.backend.embed_tokens)
    with pytest.raises(ValueError, match="method 'fastv' reads the language model's attention, so it needs the VLM"):
        choose(*args, method="fastv", budget=0.2)
    with pytest.raises(ValueError, match="method 'divprune' reads the encoded visual tokens: pass visual_tokens"):
        choose(*args, method="divprune", budget=0.2)
    with pytest.raises(ValueError, match="got 2 budgets for 1 units"):
        choose(*args, budget=[0.1, 0.2])
