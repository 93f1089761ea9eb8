"""The pipeline is backend-agnostic: the whole of it (ARR-COC's choice, encode before, a clip's temporal groups, a
second look, the trace) runs on a toy backend that is not Qwen at all, through the `VLMBackend` seam alone.

The toy model: a "tower" that turns each 16 px cell into a token from its mean colour (no context, so encoding
only the chosen cells is exact), and a "language model" that answers with the token whose embedding is closest to
the mean of what it reads. Its prompt is a row per question: its visuals' kept tokens, then its question's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

from arr_coc.budget import count_of
from arr_coc.encode import EncodeConfig
from arr_coc.core.grid import GridBatch
from arr_coc.core.layer import build_layer
from arr_coc import ARRCOC
from arr_coc.execution import Execution
from arr_coc.pipeline import IMAGE, VIDEO, Prompt, Pruning
from arr_coc.pipeline.backend import MissingCapability
from arr_coc.geometry import dilate
from arr_coc.pipeline.tokens import VisualRows
from arr_coc.core.texture import work_images

CELL, WIDTH, VOCAB = 16, 32, 50


@dataclass
class ToyPixels:
    pictures: list[torch.Tensor]          # per unit [3, H, W] in [0, 1]

    def work(self, px: int, grid: GridBatch | None = None):
        return work_images(self.pictures, grid, px)

    @property
    def images(self) -> list[torch.Tensor]:
        return self.pictures

    def subset(self, which):
        return ToyPixels([self.pictures[i] for i in which])


@dataclass
class ToyPruned:
    rows_tokens: list[torch.Tensor]       # per row [L, D]: kept visual tokens, then the question
    kept_indices: list[torch.Tensor]
    lengths: list[int]

    def rows(self, rows):
        return ToyPruned([self.rows_tokens[b] for b in rows], self.kept_indices, [self.lengths[b] for b in rows])

    @property
    def width(self) -> int:                # the toy never pads: its rows are read one by one
        return max(self.lengths)


@dataclass
class ToyDecoded:
    new_tokens: torch.Tensor
    sequences: torch.Tensor
    prefill_s: float
    first_logits: torch.Tensor | None = None


class ToyBackend:
    """The core of `arr_coc.pipeline.backend.VLMBackend` and nothing else, over a model a few lines long."""

    pad_token_id, eos_token_ids = 0, {1}
    device, text_hidden_size = torch.device("cpu"), WIDTH

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.colour = torch.randn(3, WIDTH, generator=g)
        self.embedding = torch.randn(VOCAB, WIDTH, generator=g)
        self.encoded_cells = 0            # cells the tower ran on (encode before encodes fewer)

    def build_inputs(self, visuals, questions):
        ids = [[2 + sum(map(ord, w)) % (VOCAB - 2) for w in q.split()] for q in questions]
        return {"visuals": [list(v) for v in visuals], "question_ids": ids}

    def read_prompt(self, inputs, encode_all, clock=None):
        pictures, rows, kinds, clips, groups, index, videos = [], [], [], [], [], [], 0
        for b, visuals in enumerate(inputs["visuals"]):
            for j, v in enumerate(visuals):
                is_clip = v.dim() == 4                           # [T, 3, H, W]: a clip of T temporal groups
                for g, frame in enumerate(list(v) if is_clip else [v]):
                    pictures.append(frame)
                    rows.append(b), index.append(j), groups.append(g)
                    kinds.append(VIDEO if is_clip else IMAGE)
                    clips.append(videos if is_clip else -1)
                videos += is_clip
        grids = [(p.shape[1] // CELL, p.shape[2] // CELL) for p in pictures]
        prompt = Prompt(len(inputs["visuals"]), rows, grids, kinds, clips, groups, index,
                        native={"pictures": pictures, "questions": inputs["question_ids"]})
        if encode_all:
            feats = tuple(self._tower(p, torch.arange(h * w)) for p, (h, w) in zip(pictures, grids))
            prompt.visual, prompt.feats = VisualRows.every_cell(feats, None), feats
        return prompt

    def _tower(self, picture, cells):
        h, w = picture.shape[1] // CELL, picture.shape[2] // CELL
        means = picture.reshape(3, h, CELL, w, CELL).mean((2, 4)).reshape(3, -1).T      # [h * w, 3]
        self.encoded_cells += len(cells)
        return torch.tanh(means[torch.as_tensor(cells)] @ self.colour)

    def pixels(self, prompt):
        return ToyPixels(prompt.native["pictures"])

    def question_tokens(self, prompt):
        return prompt.native["questions"]

    def embed_tokens(self, ids):
        return self.embedding[ids]

    def decode_text(self, ids):
        return " ".join(f"w{t}" for t in ids if t > 1)

    def rewrite(self, prompt, visual, lm_cells):
        feats, _ = visual.gather([c.numpy() for c in lm_cells])
        rows = []
        for b in range(prompt.rows):
            units = prompt.units_of(b)
            question = self.embedding[torch.tensor(prompt.native["questions"][b])]
            rows.append(torch.cat([feats[i] for i in units] + [question]))
        return ToyPruned(rows, [c.clone() for c in lm_cells], [len(r) for r in rows])

    def prefill(self, pruned, **forward):
        return SimpleOut(torch.stack([r.mean(0) @ self.embedding.T for r in pruned.rows_tokens]))

    def decode(self, pruned, first_logits=False, max_new_tokens=4, **generate):
        logits = self.prefill(pruned).logits                                  # [B, V]
        first = logits.argmax(-1, keepdim=True)
        new = torch.cat([first, torch.ones_like(first)], 1)[:, :max_new_tokens]   # the answer word, then the end
        return ToyDecoded(new, new, 0.0, logits if first_logits else None)


class ToyBackendBefore(ToyBackend):
    """The core + one capability, `EncodesBefore`: its tower on the chosen cells only (no context, so encoding only
    the chosen cells is exact)."""

    def check_encode(self, encode):
        pass

    def encode_gist(self, prompt, units, grids):
        return [self._tower(prompt.native["pictures"][i], torch.arange(g[0] * g[1] // 4)) for i, g in
                zip(units, grids)], None

    def context_cells(self, prompt, units, chosen, encode):
        return [dilate(c, prompt.grid_hw[i], encode.margin) for i, c in zip(units, chosen)]

    def encode_cells(self, prompt, units, cells, clock=None):
        return torch.cat([self._tower(prompt.native["pictures"][i], c) for i, c in zip(units, cells)]), None


@dataclass
class SimpleOut:
    logits: torch.Tensor


def _scene(seed: int, h: int = 6, w: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.full((3, h * CELL, w * CELL), 0.8)
    for _ in range(3):
        r, c = int(torch.randint(0, h - 1, (1,), generator=g)), int(torch.randint(0, w - 1, (1,), generator=g))
        x[:, r * CELL:(r + 2) * CELL, c * CELL:(c + 2) * CELL] = torch.rand(3, 1, 1, generator=g)
    return x


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
    inputs = backend.build_inputs([[_scene(0)], [_scene(1), _scene(2)]], ["what is red", "where is the star"])
    done = toy.answer(inputs, Pruning.of("arr_coc", 0.25), max_new_tokens=2)
    assert [tr.kept_per_image for tr in done.traces] == [[count_of(0.25, 48)], [count_of(0.25, 48)] * 2]
    assert done.traces[0].arr_coc is not None and done.traces[0].method == "arr_coc"
    every = toy.answer(inputs, Pruning.of("none"), max_new_tokens=2)
    assert [tr.kept_tokens for tr in every.traces] == [48, 96]
    assert done.new_tokens.shape == every.new_tokens.shape == (2, 2)
    answers, traces = toy.generate([[_scene(0)]], ["what is red"], budget=0.25, max_new_tokens=2)
    assert traces[0].kept_tokens == count_of(0.25, 48) and answers[0].startswith("w")   # the front door's answer


def test_a_core_only_backend_refuses_what_it_lacks_in_one_line(toy):
    inputs = toy.backend.build_inputs([[_scene(3)]], ["what is blue"])
    with pytest.raises(MissingCapability, match=r"cannot encode before the vision tower .*EncodesBefore \(missing "
                                                r"check_encode, context_cells, encode_cells, encode_gist\)"):
        toy.answer(inputs, Pruning.of("arr_coc", 0.25, encode="before"), max_new_tokens=1)
    with pytest.raises(MissingCapability, match="cannot give the language model's attention to FastV"):
        toy.answer(inputs, Pruning.of("fastv", 0.25, strict=True), max_new_tokens=1)
    with pytest.raises(MissingCapability, match="cannot answer a question without a picture"):
        toy.generate([[]], ["what is blue"])
    with pytest.raises(MissingCapability, match="cannot run fixed shapes"):
        toy.use(Execution.fast("cpu", compiler="eager"))


def test_encode_before_runs_the_toy_tower_on_the_chosen_cells_only(toy_before):
    vlm, backend = toy_before, toy_before.backend
    inputs = backend.build_inputs([[_scene(3)]], ["what is blue"])
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
    clip = torch.stack([_scene(4 + t) for t in range(4)])        # [T, 3, H, W]: four temporal groups
    inputs = toy.backend.build_inputs([[clip]], ["what moves first"])
    done = toy.answer(inputs, Pruning.of("arr_coc", 0.1), max_new_tokens=1)
    tr = done.traces[0]
    assert tr.clip_per_image == [0, 0, 0, 0] and tr.group_per_image == [0, 1, 2, 3]
    assert sum(tr.kept_per_group[0]) == tr.kept_tokens == count_of(0.1, 4 * 48)
    assert min(tr.kept_per_group[0]) >= 1                        # every group keeps its place


def test_a_second_look_runs_on_the_toy_backend(toy_before):
    inputs = toy_before.backend.build_inputs([[_scene(9)]], ["what is green"])
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
    vlm, picture, question = toy_before, _scene(11), "where is the red star"
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

    args = ([_scene(1)], [(6, 8)], [[3, 4]], toy.backend.embed_tokens)
    with pytest.raises(ValueError, match="method 'fastv' reads the language model's attention, so it needs the VLM"):
        choose(*args, method="fastv", budget=0.2)
    with pytest.raises(ValueError, match="method 'divprune' reads the encoded visual tokens: pass visual_tokens"):
        choose(*args, method="divprune", budget=0.2)
    with pytest.raises(ValueError, match="got 2 budgets for 1 units"):
        choose(*args, budget=[0.1, 0.2])
