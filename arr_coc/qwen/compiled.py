"""The Qwen backend's compiled stages: the vision tower on a bucket of cells and the language model over a
static KV cache, each one `torch.compile(fullgraph=True)` graph per shape (`arr_coc.execution`).

- **Tower.** The stock forward of `model.model.visual`, compiled, called with everything it would compute on
  the host precomputed (`encode_packed`: positions, `cu_seqlens`, windows, `max_seqlen`) and its attention over
  the packed images done without reading their lengths back (`packed_attention.PACKED`). Full encodings (the
  every-token reference, encode="after", the gist) go through the same call with every cell chosen, which
  reproduces the stock encoding (tests/test_encoding.py).
- **Language model.** The stock `model.forward`, compiled, for the prefill and for each decoding step, with
  transformers' static cache (`cache_implementation="static"`): the decoding steps have one shape for the whole
  answer, the prefill one per prompt bucket. transformers' own auto-compile of decoding is turned off
  (`disable_compile`): it would compile only the steps, and on a GPU only.

The compiled callables are installed on the model only inside `tower()` / `language_model()`, so a request
run eagerly beside them (the other half of a side-by-side comparison) runs the stock code.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from ..execution import Execution
from .packed_attention import packed_tower

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextmanager
def _installed(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """`module.forward` replaced by `forward` inside the block (hooks still run: they live on __call__)."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward          # the class's own forward again


class CompiledQwen:
    """One model's compiled tower and language model under one `Execution` (graphs cached per shape)."""

    def __init__(self, model: PreTrainedModel, execution: Execution):
        self.model = model
        self.execution = execution
        visual = model.model.visual
        self._tower = execution.compile(type(visual).forward.__get__(visual), "the vision tower")
        self._forward = execution.compile(type(model).forward.__get__(model), "the language model")

    @contextmanager
    def tower(self) -> Iterator[None]:
        """The vision tower compiled, its attention packed (see the module docstring)."""
        with packed_tower(self.model), _installed(self.model.model.visual, self._tower):
            yield

    @contextmanager
    def language_model(self) -> Iterator[None]:
        """The language model's forward compiled (prefill and decoding steps)."""
        with _installed(self.model, self._forward):
            yield

    @staticmethod
    def generate_kwargs() -> dict[str, Any]:
        """What `generate` needs for fixed-shape decoding: transformers' static cache, its own compile off."""
        return {"cache_implementation": "static", "disable_compile": True}


__all__ = ["CompiledQwen"]
