"""The pipeline's entry points: a request answered, written once for every caller.

    respond   visuals + questions -> validate (the one validator) -> the processor's tensors -> `answer` -> text
    answer    the processor's tensors -> one look (`look.prepare`) or several (`looks.Looker`) -> decoding

Every entry point of the project ends here: `ARRCOC.generate` (and the Qwen alias's `model_generate`), `eval` on images and
clips, `bench`, the microscope, `ask` and the lmms-eval plugin. The number of looks is decided in `answer`
and nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from ..validation.limits import LIMITS
from ..validation.requests import check_items, check_max_new_tokens
from ..stopwatch import lap
from .backend import AnswersText, ChecksInputs, has, require
from .context import RequestContext
from .look import Prepared, prepare
from .looks import Looker, Pass
from .request import Pruning
from .trace import Trace


@dataclass
class Answered:
    """A batch answered: per returned sequence its new tokens (pad after the end), per row its trace, every look.

    new_tokens  [B * r, T] the answers' tokens only (r: num_return_sequences)
    passes      one `Pass` per look (its rows, pruned prompt and prefill time); empty for a text-only batch
    first       the first look (`Prepared`); None for a text-only batch
    sequences   one look: what decoding returned on the pruned prompt (prompt + answer), for callers that
                splice it; None with several looks (their prompts differ)
    """

    new_tokens: torch.Tensor
    traces: list[Trace]
    passes: list[Pass] = field(default_factory=list)
    first: Prepared | None = None
    sequences: torch.Tensor | None = None
    ttft_s: float = 0.0     # to the final answers' first token (one look: its preparation and prefill; several:
                            # `Looked.ttft_s`)


@dataclass
class Response:
    """`respond`'s result: per question its answer (a list of strings with num_return_sequences > 1), its trace
    and what the validator noted about its inputs; `answered` holds the tokens and every look."""

    answers: list[str | list[str]]
    traces: list[Trace]
    notes: list[list[str]]
    answered: Answered


def answer(req: RequestContext, inputs: Mapping[str, Any], **gen_kwargs: Any) -> Answered:
    """Prune the processor's tensors `inputs` and generate (greedy unless told otherwise)."""
    backend, clock = req.backend, req.clock
    if has(backend, AnswersText) and not backend.visual_kinds(inputs):
        return _text_only(backend, inputs, req.pruning, **gen_kwargs)
    if req.pruning.encode.passes > 1:      # look again where one look was not enough
        looked = Looker(req, **gen_kwargs).run(inputs)
        done = Answered(looked.new_tokens, looked.traces, looked.passes, looked.first, ttft_s=looked.ttft_s)
    else:
        t0 = time.perf_counter()
        first = prepare(req, inputs)
        seconds = time.perf_counter() - t0                   # the look up to the language model
        decoded = backend.decode(first.pruned, **gen_kwargs)
        lap(clock, "answer")                                 # the LM: prefill + decoding
        step = Pass(list(range(first.batch.rows)), first.pruned, {}, {}, decoded.new_tokens, None,
                    decoded.prefill_s, seconds)
        done = Answered(decoded.new_tokens, first.traces, [step], first, decoded.sequences,
                        ttft_s=seconds + decoded.prefill_s)
    r = int(gen_kwargs.get("num_return_sequences", 1))
    prefill_s = sum(p.prefill_s for p in done.passes)      # passes > 1: every look's prefill
    for b, tr in enumerate(done.traces):
        tr.new_tokens = count_new(done.new_tokens[b * r].tolist(), backend.eos_token_ids, backend.pad_token_id)
        tr.prefill_s = prefill_s
    return done


def _text_only(backend: AnswersText, inputs: Mapping[str, Any], pruning: Pruning, **gen_kwargs: Any) -> Answered:
    """A batch without visuals: nothing to prune, the stock generation."""
    decoded, lengths = backend.generate_text_only(inputs, **gen_kwargs)
    r = int(gen_kwargs.get("num_return_sequences", 1))
    new = decoded.new_tokens
    traces = [Trace(method=pruning.method, budget=None, kept_tokens=0, total_tokens=0, prompt_tokens=n,
                    new_tokens=new.shape[1]) for n in lengths]
    return Answered(new, traces[: new.shape[0] // r], sequences=decoded.sequences)


def respond(req: RequestContext, visuals: Sequence[Sequence[Any]], questions: Sequence[Any],
            max_new_tokens: int = 32, **gen_kwargs: Any) -> Response:
    """Answer questions[b] about visuals[b] (images and clips, in order): the one validator first (InputError),
    then `answer`. Each trace's `total_s` is the whole call."""
    t0 = time.perf_counter()
    backend = req.backend
    if len(visuals) != len(questions):
        raise ValueError(f"got {len(visuals)} image entries for {len(questions)} questions; pass one per question")
    if not any(len(v) for v in visuals):
        require(backend, AnswersText, "answer a question without a picture")
    checks = has(backend, ChecksInputs)
    items, texts, notes = check_items([list(v) for v in visuals], list(questions),
                                      backend.input_limits() if checks else LIMITS,
                                      sampling=backend.video_sampling() if checks else {})
    max_new_tokens = check_max_new_tokens(max_new_tokens)   # the validator's words, not transformers'
    inputs = backend.build_inputs(items, texts)
    done = answer(req, inputs, max_new_tokens=max_new_tokens, **gen_kwargs)
    r = int(gen_kwargs.get("num_return_sequences", 1))
    decoded = [backend.decode_text(row) for row in done.new_tokens.tolist()]
    answers: list[str | list[str]] = [decoded[i * r:(i + 1) * r] if r > 1 else decoded[i] for i in range(len(texts))]
    total = time.perf_counter() - t0
    for tr in done.traces:
        tr.total_s = total
    return Response(answers, done.traces, notes, done)


def count_new(row: list[int], eos: set[int], pad: int | None) -> int:
    """Generated tokens up to and including the first end-of-sequence token (generate pads after it)."""
    for j, t in enumerate(row):
        if t in eos:
            return j + 1
    n = len(row)
    while n > 0 and row[n - 1] == pad:
        n -= 1
    return n


__all__ = ["Answered", "Response", "answer", "count_new", "respond"]
