"""The backend conformance suite: every example checkpoint in `EXAMPLES` runs every test here, through the front door
(`arr_coc.ARRCOC`) and the backend's own methods only.

What a backend must do to be served (each test names it):
- keep-all equals the stock model: with every token kept (method "none", or ARR-COC at 1.0) in each encode mode the
  backend has, on images and on a clip where it reads clips, the language model's logits equal the stock model's
  bit for bit and greedy decoding gives the same tokens (the stock model: transformers' own class loaded from the
  same folder, or the toy model with no pipeline);
- a budget is a ceiling: in "exact" mode each image keeps exactly its budget's count (never more), and 1.0, "100%"
  or a count of every token keeps every token in every budget mode (a selector that over-spends fails the check:
  the negative control); a clip's budget is the clip's, with a floor of one token per temporal group;
- the pure choice (`ARRCOC.choose`, and `arr_coc.choose` on the backend's pixels and question tokens) keeps exactly
  the cells the pipeline keeps;
- what the backend lacks is refused before any work, in one line naming the capability (and what it has runs);
- the capabilities each entry declares are the ones its backend implements.

Adding a family = one `Example` in `EXAMPLES` (a builder from its checkpoint, its pictures, its stock model) and
passing this file. Models are built once per module (a module-scoped fixture per entry).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from _toy import WIDTH, ToyBackend, ToyBackendBefore, scene
from _toy import stock_answer as toy_stock_answer
from conftest import shapes_image

from arr_coc import ARRCOC, choose
from arr_coc.budget import count_of
from arr_coc.core.layer import build_layer
from arr_coc.execution import Execution
from arr_coc.pipeline import Pruning
from arr_coc.pipeline.backend import (
    CAPABILITIES, Adapts, AnswersText, ChecksInputs, CostsTower, EncodesBefore, FixedShapes, MissingCapability,
    Describes, LaysOutVisuals, RemembersTower, SharesWeights, TextAttention, TowerAttention, TrainsAdapters,
    TrainsThrough, has,
)

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED, BEFORE_LAYER = ROOT / "checkpoints" / "shapes-qwen2vl", ROOT / "checkpoints" / "arr-coc-shapes-before"
QUESTIONS = ["What colour is the circle?", "Is there a red square on the left?"]
NEW_TOKENS = 4
EVERYTHING = frozenset(CAPABILITIES)


# ----------------------------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Example:
    """One example checkpoint. build(tmp) -> the front door over it; pictures(seed) -> two pictures of different
    sizes (a batch of two questions, so padding is exercised); stock(vlm, inputs, n) -> (what the backend's
    `prefill` returns as logits, greedy new tokens [B, n]) from the stock model with every token, no pipeline;
    clip(seed), for a backend that reads clips."""

    id: str
    build: Callable[[Path], ARRCOC]
    pictures: Callable[[int], list[Any]]
    stock: Callable[[Any, dict, int], tuple[torch.Tensor, torch.Tensor]]
    has: frozenset = EVERYTHING                          # the capabilities its backend implements
    clip: Callable[[int], Any] | None = None             # clip(seed) -> a clip of 4 temporal groups, where it reads them
    encodes: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "encodes", ("after", "before") if EncodesBefore in self.has else ("after",))


def _qwen_pictures(seed: int) -> list[Any]:
    return [shapes_image(120, 150, seed), shapes_image(90, 200, seed + 1)]


def _qwen_clip(seed: int) -> Any:
    """8 frames (4 temporal groups) of a square moving right, 8 px a frame, in a seeded colour."""
    from arr_coc.video import load_clip

    frames = np.full((8, 84, 112, 3), 200, np.uint8)
    colour = np.random.default_rng(seed).integers(0, 256, 3)
    for k in range(8):
        frames[k, 30:50, 10 + 8 * k: 30 + 8 * k] = colour
    return load_clip(frames)


def _tiny_qwen(family: str) -> Callable[[Path], ARRCOC]:
    def build(tmp: Path) -> ARRCOC:
        from arr_coc.qwen.tiny import save_tiny_qwen

        return ARRCOC.from_pretrained(save_tiny_qwen(family, str(tmp / family)))   # picked by config.model_type
    return build


def _embedded(tmp: Path) -> ARRCOC:
    vlm = ARRCOC.from_pretrained(EMBEDDED, arr_coc=BEFORE_LAYER)        # the trained layer and its adapter
    assert vlm.backend.adapter is not None                             # on for pruned rows only: keep-all is stock
    return vlm


@torch.no_grad()
def _transformers_stock(vlm: ARRCOC, inputs: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own model class, loaded afresh from the checkpoint the backend was loaded from."""
    from transformers import AutoModelForImageTextToText

    stock = AutoModelForImageTextToText.from_pretrained(vlm.name, dtype=torch.float32).eval()
    tokens = stock.generate(**inputs, max_new_tokens=n, do_sample=False)
    return stock(**inputs).logits, tokens[:, inputs["input_ids"].shape[1]:]


def _toy(backend_class: type) -> Callable[[Path], ARRCOC]:
    return lambda tmp: ARRCOC(backend_class(), arr_coc=build_layer(None, WIDTH))


def _toy_pictures(seed: int) -> list[Any]:
    return [scene(seed), scene(seed + 1, 4, 10)]


def _design_example(tmp: Path) -> ARRCOC:
    """docs/DESIGN.md's "Adding a backend" block, run as written (tests/test_design_example.py runs it alone); its
    registration undone after, so the registry of the rest of the session is as it was."""
    from test_design_example import example

    from arr_coc.pipeline import registry

    module = types.ModuleType("design_md_example")                # its dataclasses look their module up
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
        patch.setitem(sys.modules, module.__name__, module)
        exec(compile(example(), "docs/DESIGN.md", "exec"), module.__dict__)
    return module.vlm                                            # ARRCOC.from_pretrained(its folder)


@torch.no_grad()
def _design_stock(vlm: ARRCOC, inputs: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's model over every token (its tower on every cell, then the question's words)."""
    b = vlm.backend
    rows = [torch.cat([b.tower(p) for p in pictures] + [b.words[torch.tensor(ids)]])
            for pictures, ids in zip(inputs["pictures"], inputs["ids"])]
    logits = torch.stack([r.mean(0) @ b.words.T for r in rows])
    first = logits.argmax(-1, keepdim=True)
    return logits, torch.cat([first, torch.ones_like(first)], 1)[:, :n]


def _embedded_pictures(seed: int) -> list[Any]:
    return [shapes_image(448, 448, seed), shapes_image(336, 448, seed + 1)]


def _toy_stock(vlm: ARRCOC, inputs: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return toy_stock_answer(vlm.backend, inputs, n)


def _toy_clip(seed: int) -> torch.Tensor:
    return torch.stack([scene(seed + t) for t in range(4)])          # [T, 3, H, W]: four temporal groups


def _random_pictures(seed: int) -> list[Any]:
    return [torch.rand(3, 96, 128, generator=torch.Generator().manual_seed(seed)),
            torch.rand(3, 64, 160, generator=torch.Generator().manual_seed(seed + 1))]


# One line per example checkpoint: adding a family is adding its line.
EXAMPLES = [
    Example("qwen2_vl-tiny", _tiny_qwen("qwen2_vl"), _qwen_pictures, _transformers_stock, clip=_qwen_clip),
    Example("qwen2_5_vl-tiny", _tiny_qwen("qwen2_5_vl"), _qwen_pictures, _transformers_stock, clip=_qwen_clip),
    Example("qwen3_vl-tiny", _tiny_qwen("qwen3_vl"), _qwen_pictures, _transformers_stock, clip=_qwen_clip),
    Example("embedded-shapes-qwen2vl", _embedded, _embedded_pictures, _transformers_stock),
    Example("toy", _toy(ToyBackend), _toy_pictures, _toy_stock, has=frozenset(), clip=_toy_clip),
    Example("toy-encodes-before", _toy(ToyBackendBefore), _toy_pictures, _toy_stock, has=frozenset({EncodesBefore}),
            clip=_toy_clip),
    Example("design-md-example", _design_example, _random_pictures, _design_stock, has=frozenset()),
]
BY_ID = {e.id: e for e in EXAMPLES}
IDS = [e.id for e in EXAMPLES]


@dataclass
class Built:
    example: Example
    vlm: ARRCOC
    stock: dict = field(default_factory=dict)             # memo: the stock model's answers


_BUILT: dict[str, Built] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(id) -> Built`: each example built once for this module, then shared (read-only)."""
    def get(example_id: str) -> Built:
        if example_id not in _BUILT:
            example = BY_ID[example_id]
            _BUILT[example_id] = Built(example, example.build(tmp_path_factory.mktemp(example_id)))
        return _BUILT[example_id]
    yield get
    _BUILT.clear()


def _batch(b: Built, seed: int = 0) -> dict:
    return b.vlm.backend.build_inputs([[p] for p in b.example.pictures(seed)], QUESTIONS)


def _clip_batch(b: Built, seed: int = 0) -> dict:
    return b.vlm.backend.build_inputs([[b.example.clip(seed)]], ["What moves first?"])


# ----------------------------------------------------------------------------------------------- the tests

def test_every_capability_is_refused_or_said_to_degrade():
    """A capability added to the core's list must be added here: how a backend without it is served."""
    assert set(REFUSED) | set(DEGRADES) == set(CAPABILITIES) and not set(REFUSED) & set(DEGRADES)


@pytest.mark.parametrize("example_id", IDS)
def test_the_declared_capabilities_are_the_backends(built, example_id):
    b = built(example_id)
    assert {c.__name__ for c in CAPABILITIES if has(b.vlm.backend, c)} == {c.__name__ for c in b.example.has}


KEEP_ALL = [(e.id, m, v) for e in EXAMPLES for m in e.encodes for v in ("images", "clip") if v == "images" or e.clip]


@pytest.mark.parametrize("example_id,encode,visual", KEEP_ALL, ids=["-".join(c) for c in KEEP_ALL])
def test_keep_all_equals_the_stock_model(built, example_id, encode, visual):
    b = built(example_id)
    inputs = _batch(b) if visual == "images" else _clip_batch(b)
    if visual not in b.stock:
        b.stock[visual] = b.example.stock(b.vlm, inputs, NEW_TOKENS)
    logits, tokens = b.stock[visual]
    for method, budget in (("none", None), ("arr_coc", 1.0), ("random", "100%")):
        prepared = b.vlm.prepare(inputs, Pruning.of(method, budget, encode=encode))
        assert [t.kept_tokens for t in prepared.traces] == [t.total_tokens for t in prepared.traces]
        with torch.no_grad():
            ours = b.vlm.backend.prefill(prepared.pruned).logits
        assert torch.equal(ours, logits), (method, (ours - logits).abs().max().item())
        done = b.vlm.answer(inputs, Pruning.of(method, budget, encode=encode), max_new_tokens=NEW_TOKENS)
        assert torch.equal(done.new_tokens, tokens), method
    pruned = b.vlm.prepare(inputs, Pruning.of("grid", 0.25, encode=encode))       # negative control: the
    with torch.no_grad():                                                         # comparison can fail
        assert not torch.equal(_last(b.vlm.backend.prefill(pruned.pruned).logits), _last(logits))


def _last(logits: torch.Tensor) -> torch.Tensor:
    """The last position's logits [B, V] (a backend's prefill may return every position's)."""
    return logits[:, -1] if logits.dim() == 3 else logits


def _over_budget(traces, budget) -> list[tuple[int, int]]:
    """(kept, allowed) of every image that kept more than its budget's count."""
    return [(k, count_of(budget, n)) for t in traces for k, n in zip(t.kept_per_image, t.total_per_image)
            if k > count_of(budget, n)]


@pytest.mark.parametrize("example_id", IDS)
def test_a_budget_is_a_ceiling_and_every_token_keeps_every_token(built, example_id):
    b = built(example_id)
    inputs = _batch(b, seed=3)
    methods = ("arr_coc", "random", "grid", "divprune", "cdpruner")
    for encode in b.example.encodes:
        for budget in (0.1, 0.25, 3):
            for method in methods if encode == "after" else methods[:3]:
                traces = b.vlm.prepare(inputs, Pruning.of(method, budget, "exact", encode)).traces
                assert not _over_budget(traces, budget), (encode, budget, method)
                assert all(t.kept_per_image == [count_of(budget, n) for n in t.total_per_image] for t in traces)
        modes = ("exact", "adaptive", None) + (("mean",) if b.vlm.layer.config.attending.spread_tau > 0 else ())
        for budget in (1.0, "100%", 100_000):
            for mode in modes:
                traces = b.vlm.prepare(inputs, Pruning.of("arr_coc", budget, mode, encode)).traces
                assert [t.kept_per_image for t in traces] == [t.total_per_image for t in traces], (budget, mode)

    def greedy(ctx):                  # negative control: a selector that keeps every cell whatever its budget
        return [torch.arange(h * w) for h, w in ctx.grid_hw]
    traces = b.vlm.prepare(inputs, Pruning.of(greedy, 0.25)).traces
    assert _over_budget(traces, 0.25)


CLIPS = [(e.id, m) for e in EXAMPLES if e.clip for m in e.encodes]


@pytest.mark.parametrize("example_id,encode", CLIPS, ids=["-".join(c) for c in CLIPS])
def test_a_clip_has_one_budget_over_time_and_keeps_every_group(built, example_id, encode):
    """A clip's budget is the clip's, a ceiling with one floor: one token per temporal group (docs/DESIGN.md)."""
    b = built(example_id)
    inputs = _clip_batch(b, seed=2)
    for budget in (0.1, 0.25, 2, 1.0):
        for method in ("arr_coc", "random", "grid"):
            trace = b.vlm.prepare(inputs, Pruning.of(method, budget, "exact", encode)).traces[0]
            groups, total = len(trace.kept_per_group[0]), trace.total_tokens
            assert groups == 4 and sum(trace.kept_per_group[0]) == trace.kept_tokens, (budget, method)
            assert trace.kept_tokens == max(count_of(budget, total), groups), (budget, method)
            assert min(trace.kept_per_group[0]) >= 1, (budget, method)


PURE_METHODS = ("arr_coc", "random", "grid", "divprune", "cdpruner")


@pytest.mark.parametrize("example_id,encode", [(e.id, m) for e in EXAMPLES for m in e.encodes],
                         ids=[f"{e.id}-{m}" for e in EXAMPLES for m in e.encodes])
def test_the_pure_choice_equals_the_pipelines(built, example_id, encode):
    b = built(example_id)
    vlm, backend = b.vlm, b.vlm.backend
    picture, question = b.example.pictures(7)[0], QUESTIONS[0]
    inputs = backend.build_inputs([[picture]], [question])
    prompt = backend.read_prompt(inputs, encode_all=encode == "after")
    ids = backend.question_tokens(prompt)
    for method in PURE_METHODS if encode == "after" else PURE_METHODS[:3]:
        kept = vlm.prepare(inputs, Pruning.of(method, 0.25, encode=encode)).traces[0].kept_indices[0]
        assert torch.equal(vlm.choose(picture, question, 0.25, method, encode=encode).kept[0], kept), method
        pure = choose(backend.pixels(prompt), prompt.grid_hw, ids, backend.embed_tokens, layer=vlm.layer,
                      method=method, budget=0.25, visual_tokens=None if prompt.feats is None else list(prompt.feats))
        assert torch.equal(pure.kept[0], kept), method


# What a request needing each capability does, and how the refusal reads. `DEGRADES`: served without it.
def _strict(method: str) -> Callable[[ARRCOC, Any], Any]:
    return lambda vlm, pic: vlm.answer(vlm.backend.build_inputs([[pic]], QUESTIONS[:1]),
                                       Pruning.of(method, 0.25, strict=True), max_new_tokens=1)


def _fast(vlm: ARRCOC, pic: Any) -> None:
    try:
        vlm.use(Execution.fast("cpu", compiler="eager"))
    finally:
        vlm.use(Execution.eager())


REFUSED: dict[type, tuple[str, Callable[[ARRCOC, Any], Any]]] = {
    AnswersText: ("answer a question without a picture", lambda vlm, pic: vlm.generate([], QUESTIONS[0],
                                                                                         max_new_tokens=1)),
    EncodesBefore: ("encode before the vision tower", lambda vlm, pic: vlm.generate(pic, QUESTIONS[0], 0.25,
                                                                                    encode="before",
                                                                                    max_new_tokens=1)),
    TextAttention: ("give the language model's attention to FastV", _strict("fastv")),
    TowerAttention: ("give the tower's attention", _strict("visionzip")),
    FixedShapes: ("run fixed shapes", _fast),
    Adapts: ("run LoRA adapters", lambda vlm, pic: ARRCOC(vlm.backend, adapter=BEFORE_LAYER)),
}
DEGRADES = {
    ChecksInputs: "the validator's default limits",
    RemembersTower: "a later look's cells form their own segment",
    CostsTower: "`eval` refused in one line before any work (its FLOP counts; tests/test_second_backend.py)",
    TrainsThrough: "`train` and `train-adapter` refused in one line before any work (tests/test_second_backend.py)",
    TrainsAdapters: "train-adapter refused in one line",
    LaysOutVisuals: "`downscale` refused in one line; the evaluation's counts read from the prompt",
    SharesWeights: "the app offers no other layer beside it (refused in one line)",
    Describes: "the tools name the device alone and no tokenizer",
}
# What a backend that has it runs here (Adapts and FixedShapes are run on Qwen by test_adapter.py / test_fast_path.py).
RUNS = (AnswersText, EncodesBefore, TextAttention, TowerAttention)
CASES = [(e.id, c) for e in EXAMPLES for c in REFUSED if c not in e.has or c in RUNS]


@pytest.mark.parametrize("example_id,capability", CASES, ids=[f"{e}-{c.__name__}" for e, c in CASES])
def test_a_missing_capability_is_refused_in_one_line_and_one_it_has_runs(built, example_id, capability):
    b = built(example_id)
    what, request = REFUSED[capability]
    picture = b.example.pictures(5)[0]
    if capability in b.example.has:                     # negative control: the same request runs
        request(b.vlm, picture)
        return
    with pytest.raises(MissingCapability) as refused:
        request(b.vlm, picture)
    message = str(refused.value)
    assert "\n" not in message and what in message
    assert re.search(rf"does not implement {capability.__name__} \(missing [a-z_, ]+\)$", message), message
