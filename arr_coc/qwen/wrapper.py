"""ARRCOCQwen: the front door (`arr_coc.ARRCOC`) over a Qwen2-VL / Qwen2.5-VL / Qwen3-VL model and its processor.

A thin alias: `ARRCOCQwen(model, processor, ...)` builds the `QwenBackend` for you, `ARRCOCQwen.from_pretrained`
is `ARRCOC.from_pretrained` refusing other families, and the names older code reads of the model (its tokenizer,
merge size, token ids) are the backend's. Two things only Qwen's transformers models have live here: the
`model.generate`-shaped drop-in (`model_generate`) and saving the layer with its peft adapter (`save_pretrained`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from ..budget import BudgetMode, BudgetSpec
from ..encode import EncodeConfig, EncodeMode
from ..execution import Execution
from ..front import ARRCOC, Answer, Answers
from ..core.layer import LayerSpec
from ..core.persistence import LayerCard
from ..pipeline.request import Pruning
from ..pipeline.selection import Selector
from ..runtime import Runtime
from .adapter import SUBFOLDER, Adapter, AdapterCard
from .backend import QwenBackend
from .rewrite import model_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .processing import QwenProcessor


class ARRCOCQwen(ARRCOC):
    """A frozen Qwen2-VL / Qwen2.5-VL / Qwen3-VL model that answers with pruned visual tokens.

        wrapper = ARRCOCQwen.from_pretrained("Qwen/Qwen2-VL-2B-Instruct", arr_coc="checkpoints/arr_coc")
        answer, trace = wrapper.generate(image, "What colour is the circle?", budget=0.1)
    """

    backend: QwenBackend

    def __init__(self, model: PreTrainedModel | QwenBackend, processor: QwenProcessor | None = None,
                 arr_coc: LayerSpec = None, seed: int = 0, name: str = "", execution: Execution | None = None,
                 adapter: str | os.PathLike | Adapter | None = None):
        backend = model if isinstance(model, QwenBackend) else \
            QwenBackend(model.eval().requires_grad_(False), processor)     # refuses other families
        super().__init__(backend, arr_coc=arr_coc, execution=execution, seed=seed,
                         name=name or str(getattr(backend.model.config, "_name_or_path", "") or ""), adapter=adapter)

    @classmethod
    def from_pretrained(cls, model_id_or_path: str | os.PathLike, arr_coc: LayerSpec = None, **kwargs: Any
                        ) -> ARRCOCQwen:
        """`ARRCOC.from_pretrained` for the three Qwen-VL families (the backend refuses any other: `family_of`)."""
        return super().from_pretrained(model_id_or_path, arr_coc=arr_coc, **kwargs)   # type: ignore[return-value]

    # -- what the backend knows of the model, under the names older code reads -------------------------------

    model = property(lambda self: self.backend.model)
    processor = property(lambda self: self.backend.processor)
    tokenizer = property(lambda self: self.backend.tokenizer)
    tokens = property(lambda self: self.backend.tokens)
    merge = property(lambda self: self.backend.merge)
    family = property(lambda self: self.backend.family)
    pad_token_id = property(lambda self: self.backend.pad_token_id)
    image_token_id = property(lambda self: self.backend.tokens.image)
    adapter = property(lambda self: self.backend.adapter, doc="The LoRA adapters (`qwen.adapter.Adapter`), or None.")
    text_hidden_size = property(lambda self: self.backend.text_hidden_size)
    arr_coc_layer = property(lambda self: self.layer)

    def build_inputs(self, images: Any, questions: Any) -> dict[str, torch.Tensor]:
        """Processor tensors for a batch: images[b] is the list of images of question b (left padding)."""
        return self.backend.build_inputs(images, questions)

    @property
    def runtime(self) -> Runtime:
        """Where and how the VLM runs, as loaded (`runtime.describe()`: e.g. "cpu, bfloat16, sdpa")."""
        model = self.backend.model
        return Runtime(model.device, model.dtype, getattr(model.config, "_attn_implementation", None))

    def model_generate(self, budget: BudgetSpec = None, method: str | Selector = "arr_coc", return_trace: bool = False,
                       budget_mode: BudgetMode | None = None, encode: EncodeConfig | EncodeMode | None = None,
                       **kwargs: Any):
        """Drop-in for `model.generate(**processor_outputs, ...)` with pruning.

        Returns sequences laid out as the stock call returns them — the ORIGINAL (unpruned) prompt followed by
        the new tokens — so `out[:, len(input_ids[0]):]` trimming code keeps working. return_trace=True returns
        (sequences, traces).
        """
        inputs = model_tensors(kwargs)
        gen_kwargs = {k: v for k, v in kwargs.items() if k not in inputs}
        t0 = time.perf_counter()
        done = self.answer(inputs, Pruning.of(method, budget, budget_mode, encode), **gen_kwargs)
        new = done.new_tokens
        r = new.shape[0] // inputs["input_ids"].shape[0]
        prompt = inputs["input_ids"].to(new.device).repeat_interleave(r, dim=0)
        sequences = torch.cat([prompt, new], dim=1)
        for tr in done.traces:
            tr.total_s = time.perf_counter() - t0
        return (sequences, done.traces) if return_trace else sequences


__all__ = ["ARRCOCQwen", "Answer", "Answers"]
