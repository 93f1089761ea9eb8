"""The out-of-tree vLLM plugin (docs/SERVING.md).

vLLM calls `register` in each of its processes through the `vllm.general_plugins` entry point (pyproject.toml);
it registers ARR-COC's model classes under their own architecture names, lazily (by "module:class", so that this
package imports nothing of vLLM until vLLM asks for the class). A server picks them with
`--hf-overrides '{"architectures": ["ARRCOCQwen2VLForConditionalGeneration"], "arr_coc": {...}}'` (or
ARRCOCQwen2_5_VLForConditionalGeneration, ARRCOCQwen3VLForConditionalGeneration: `settings.FAMILY_ARCHITECTURES`);
a model served under its own architecture is stock vLLM, plugin installed or not.

`settings` (what a server and a request ask for, the question's token ids, the kept tokens' positions) is pure
Python and torch, importable and tested without vLLM; `serving` holds what the three families share on vLLM (the
processor's and the model's overrides), `qwen`, `qwen2_5` and `qwen3` one small class each (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL).
"""

from __future__ import annotations

from .settings import ARCHITECTURES

__all__ = ["ARCHITECTURES", "register"]


def register() -> None:
    """The `vllm.general_plugins` entry point: may run several times, in several processes (vLLM's rule)."""
    from vllm import ModelRegistry

    for arch, where in ARCHITECTURES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"arr_coc.serving.vllm.{where}")
    _cpu_runner_recomputes_positions()


def _cpu_runner_recomputes_positions() -> None:
    """vLLM 0.32's CPU runner never turns on the post-encoder position hook that pruning models need: the GPU
    runner sets `is_multimodal_pruning_enabled` in its `load_model` (v1/worker/gpu_model_runner.py:5156-5160),
    the CPU runner overrides `load_model` without it (v1/worker/cpu_model_runner.py:62-77), so EVS and any
    `SupportsMultiModalPruning` model get stale positions there. The same three lines, after the CPU runner's
    load, on the CPU platform only; a no-op where vLLM already did it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.models.interfaces import supports_multimodal_pruning
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load = CPUModelRunner.load_model
    if getattr(load, "arr_coc_wrapped", False):
        return

    def load_model(self, *args, **kwargs):
        load(self, *args, **kwargs)
        mm = self.model_config.multimodal_config
        if not getattr(self, "is_multimodal_pruning_enabled", False):
            self.is_multimodal_pruning_enabled = (supports_multimodal_pruning(self.get_model()) and mm is not None
                                                  and mm.is_multimodal_pruning_enabled())

    load_model.arr_coc_wrapped = True
    CPUModelRunner.load_model = load_model
