"""What each run of a request cost in FLOPs: the whole prefill (vision tower, selector, language model),
counted off the clock with the evaluation's counter, after the answers, so no latency includes it.

    vision    `arr_coc.evaluation.vision_cost.vision_flops`: the tower on every patch ("after"), or the
              gist plus the tower on the encoded cells ("before"; with more than one look, every look's
              tower pass on the cells it encoded); the tower's attention counted
    selector  the run's selector once more, under the counter, on the context(s) it saw
              (`arr_coc.evaluation.flops.CountedSelector`); 0 for the baseline
    lm        the language model's prefill of a prompt of the run's length (`Trace.prompt_tokens`; with
              more than one look, one prefill per look, of that look's length: `Look.prompt_tokens`), with
              the logits of the last position only, as the evaluation counts it. Its FLOPs depend on the
              length only (tested against counting the real pruned prompt), so it is counted on a text
              prompt of that length and memoised by length, like the vision costs by grid and cell count.

On the embedded model, counting a request's three runs took 0.25-0.3 s for shapes not seen before and
0.09 s once the shapes were memoised (the selectors' re-runs, mostly; a shared 2-core CPU).
`--no-flops` turns counting off (the page then shows "-").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

    from arr_coc import ARRCOCQwen, Trace

MEMO_LIMIT = 4096           # memoised counts kept per server (grids x cell counts x prompt lengths)


@dataclass
class Flops:
    """FLOPs of one run's prefill."""

    vision: int                  # gist + tower, as the run encoded
    selector: int | None         # None: could not be counted (unknown, never 0)
    lm: int                      # language-model prefill

    @property
    def whole(self) -> int | None:
        return None if self.selector is None else self.vision + self.selector + self.lm

    def to_dict(self) -> dict[str, int | None]:
        return {"vision": self.vision, "selector": self.selector, "lm_prefill": self.lm, "whole_prefill": self.whole}


def trim(memo: dict[Any, int]) -> dict[Any, int]:
    """The server's memo of shape-only counts, emptied when it has grown past MEMO_LIMIT entries."""
    if len(memo) > MEMO_LIMIT:
        memo.clear()
    return memo


def lm_flops(wrapper: ARRCOCQwen, length: int, memo: dict[Any, int]) -> int:
    """FLOPs of the language model's prefill of `length` tokens (last position's logits only)."""
    import torch

    from arr_coc.evaluation.flops import count_flops

    key = ("lm", int(length))
    if key not in memo:
        ids = torch.full((1, int(length)), int(wrapper.pad_token_id), dtype=torch.long, device=wrapper.device)
        with torch.no_grad():
            memo[key] = count_flops(wrapper.model, input_ids=ids, attention_mask=torch.ones_like(ids),
                                    logits_to_keep=1)[1]
    return memo[key]


def count_run(wrapper: ARRCOCQwen, inputs: dict[str, Any], trace: Trace, counted: Any, memo: dict[Any, int],
              gist_share: float) -> Flops:
    """The FLOPs of one run whose trace is `trace`; `inputs` are the processor's tensors for its item."""
    from arr_coc.evaluation.vision_cost import vision_flops

    vision = vision_flops(wrapper, inputs, [trace], gist_share, memo)[0]
    selector = counted.flops() if counted is not None else 0
    lengths = [look.prompt_tokens for look in trace.looks] or [trace.prompt_tokens]   # every look's prefill
    return Flops(vision=int(vision), selector=selector, lm=sum(lm_flops(wrapper, n, memo) for n in lengths))


def build_inputs(wrapper: ARRCOCQwen, picture: Image, question: str) -> dict[str, Any]:
    """The processor's tensors for one image and question, as `generate` builds them."""
    return wrapper.build_inputs([[picture]], [question])
