"""ARR-COC as an lmms-eval (0.7.x) chat model: `python -m lmms_eval --model arr_coc --model_args ...`.

    python -m lmms_eval --model arr_coc \\
        --model_args pretrained=Qwen/Qwen2.5-VL-7B-Instruct,method=arr_coc,budget=0.1 \\
        --tasks textvqa_val,gqa,pope --batch_size 8
    accelerate launch --num_processes 8 -m lmms_eval --model arr_coc --model_args ... # one process per GPU

Model arguments (`--model_args k=v,...`; `--batch_size` and `--device` of lmms-eval's command line too):

    pretrained           Qwen2-VL / Qwen2.5-VL / Qwen3-VL hub id or folder (default: the embedded model)
    method               a selector name (arr_coc, arr_coc_adaptive, none, random, grid, fastv, visionzip,
                         divprune, cdpruner, or one registered with register_selector; default arr_coc)
    budget               0.1 / 10% (a share of each image's tokens) or 64 / 64tok (a count), arr_coc.budget's
                         one parser; "1" is refused as ambiguous (default 0.25)
    budget_mode          exact | mean | adaptive (default: the layer's own)
    arr_coc              folder of a trained ARR-COC layer, or "untrained" (default: arr_coc.paths.resolve_layer,
                         the shipped layer for the embedded model and this encoding, else untrained)
    encode               after | before (gist, margin, periphery, whole_windows: as `eval --gist/--margin/
                         --periphery/--whole-windows`; whole_windows=true is Qwen2.5-VL only)
    device, dtype, attn_implementation   arr_coc.runtime's names (default auto, auto, transformers' default)
    batch_size           questions per generate() call, per process (default 1; lmms-eval's "auto" and
                         max_batch_size are not used)
    max_new_tokens       answer length when the task's gen_kwargs do not say (default 128)
    seed                 seed of random selections (default 0)

Every request runs through `ARRCOC.respond`, the library's own path (prompt, pruning, greedy decoding,
answer trimming), so an item gets the answer `python -m arr_coc eval` gives it at the same method and budget.
Under `accelerate launch` each process holds the model on its own device (cpu with --cpu) and lmms-eval
gives each its shard of the requests by rank; rank and world size come from `Accelerator`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from accelerate import Accelerator
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.utils import simple_parse_args_string
from loguru import logger
from tqdm import tqdm

from ..budget import DEFAULT_BUDGET, BudgetError
from ..errors import InputError
from ..paths import default_model_path, resolve_layer
from ..runtime import Runtime, check_attn_implementation, resolve_dtype
from . import requests as rq

DEFAULT_MAX_NEW_TOKENS = 128    # lmms-eval's Qwen chat models' default


class ARRCOCLmms(lmms):
    """lmms-eval's `lmms` around the front door (`ARRCOC`, any registered backend): generate_until, batched;
    loglikelihood and multi-round refused."""

    is_simple = False   # a chat model: lmms-eval sends the chat layout (ctx, doc_to_messages, gen_kwargs, ...)

    def __init__(self, pretrained: str | None = None, method: str = "arr_coc", budget: Any = DEFAULT_BUDGET,
                 budget_mode: str | None = None, arr_coc: str | None = None, encode: str = "after",
                 gist: float = 0.0, margin: int = 0, periphery: bool = False, whole_windows: bool = False,
                 device: str | None = "auto",
                 dtype: str | None = "auto", attn_implementation: str | None = None, batch_size: int | str = 1,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, seed: int = 0, max_batch_size: int | None = None,
                 **unknown: Any) -> None:
        super().__init__()
        if unknown:
            raise TypeError(f"arr_coc model got unknown model_args {sorted(unknown)}; it takes pretrained, method, "
                            "budget, budget_mode, arr_coc, encode, gist, margin, periphery, whole_windows, device, "
                            "dtype, "
                            "attn_implementation, batch_size, max_new_tokens, seed")
        from ..encode import EncodeConfig
        from ..pipeline.request import Pruning
        from ..front import ARRCOC

        # everything is checked before the model loads: a wrong argument fails in a second, not after a download
        pretrained = str(pretrained) if pretrained else default_model_path()
        if not pretrained:
            raise ValueError("no pretrained=... given and this checkout ships no embedded model; pass "
                             "pretrained=HUB_ID_OR_FOLDER")
        self.method = check_method(str(method))
        if str(encode) == "before":
            from ..pipeline.selection import method_info

            if not method_info(self.method).before:
                raise ValueError(f"method {self.method!r} reads the encoded visual tokens, so it cannot choose "
                                 "before the vision tower; use encode=after")
        try:   # the one read of the pruning settings (arr_coc.pipeline.Pruning), before the model loads
            self.pruning = Pruning.of(self.method, budget, budget_mode or None,
                                      EncodeConfig(mode=str(encode), gist=float(gist), margin=int(margin),
                                                   periphery=bool(periphery), windows=bool(whole_windows)))
        except BudgetError as exc:
            raise ValueError(f"model_args budget: {exc}") from None
        self.budget, self.budget_mode, self.encode = self.pruning.budget, self.pruning.budget_mode, self.pruning.encode
        try:
            self.batch_size_per_process = int(batch_size)
        except (TypeError, ValueError):
            self.batch_size_per_process = 0
        if self.batch_size_per_process < 1:
            raise ValueError(f"batch_size must be a whole number of at least 1, got {batch_size!r} (lmms-eval's "
                             "'auto' is not supported)")
        self.max_new_tokens = int(max_new_tokens)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        resolve_dtype(dtype or "auto", torch.device("cpu"))   # the names, now; the device is known below
        check_attn_implementation(attn_implementation or None)

        # On a machine without CUDA (or with device=cpu) the processes of `torchrun` / `accelerate launch` meet over
        # gloo (accelerate's MULTI_CPU); on GPUs each process takes cuda:LOCAL_RANK (MULTI_GPU).
        on_cpu = str(device or "auto").startswith("cpu") or not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=on_cpu)
        if self.accelerator.num_processes > 1:   # accelerate launch: this process's device, its shard of the requests
            if device not in (None, "auto") and str(device) != str(self.accelerator.device):
                logger.warning(f"arr_coc: device={device} ignored under accelerate launch; process "
                               f"{self.accelerator.process_index} runs on {self.accelerator.device}")
            device = str(self.accelerator.device)
            self._rank, self._world_size = self.accelerator.process_index, self.accelerator.num_processes
        self.runtime = Runtime.resolve(device or "auto", dtype or "auto", attn_implementation or None)
        layer = resolve_layer(pretrained, None if arr_coc in (None, "") else str(arr_coc), self.encode)
        self.vlm = ARRCOC.from_pretrained(pretrained, arr_coc=layer, device=self.runtime.device,
                                          dtype=self.runtime.dtype,
                                          attn_implementation=self.runtime.attn_implementation)
        self.vlm.seed = int(seed)
        self.vlm.check_encode(self.encode)   # whole_windows on a tower without windows: now, not per request
        self.pretrained, self.layer = pretrained, layer
        self.usage = {"requests": 0, "kept_tokens": 0, "total_tokens": 0, "keep_all": 0}
        if self.rank == 0:
            logger.info(f"arr_coc: {pretrained} ({self.runtime.describe()}), method={self.method}, "
                        f"budget={self.budget}, layer={layer or 'untrained'}, encode={self.encode.mode}, "
                        f"{self.world_size} process(es)")

    @classmethod
    def create_from_arg_string(cls, arg_string: str | dict, additional_config: dict | None = None) -> ARRCOCLmms:
        """lmms-eval's constructor path, with two differences: `budget` reaches arr_coc.budget's parser as
        written ("64" is a count, "0.1" a share, "1" is refused), and an argument given in --model_args wins
        over the command line's default (lmms-eval always passes batch_size, 1 unless told)."""
        return cls(**merged_args(arg_string, additional_config))

    # -- what lmms-eval reads -----------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.batch_size_per_process

    @property
    def device(self):
        return self.vlm.device

    @property
    def model(self):
        """The backend behind the front door (what serves the model)."""
        return self.vlm.backend

    @property
    def tokenizer(self):
        return self.vlm.tokenizer

    # -- requests -----------------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError(
            "arr_coc does not score loglikelihood requests (multiple choice by likelihood, perplexity): it prunes "
            "the visual tokens of generated answers. Choose a generate_until task (textvqa_val, gqa, pope, mme, "
            "ocrbench, chartqa, docvqa_val, ...)")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError(
            "arr_coc does not run multi-round requests: it answers one user turn per request. Choose a "
            "single-turn generate_until task")

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Answers in the order of `requests`; batched by gen_kwargs, longest context first."""
        specs = [rq.parse_args(i, req.args) for i, req in enumerate(requests)]
        out: list[GenerationResult | None] = [None] * len(specs)
        bar = tqdm(total=len(specs), disable=self.rank != 0, desc="arr_coc responding")
        warned: set[str] = set()
        for batch in rq.plan_batches(specs, self.batch_size):
            gen = rq.generation(batch[0].gen_kwargs, self.max_new_tokens)
            for key in set(gen.ignored) - warned:
                logger.warning(f"arr_coc: gen_kwargs[{key!r}] is not used by this model")
                warned.add(key)
            prompts = [rq.read_prompt(spec, rq.find_doc(self.task_dict, spec)) for spec in batch]
            try:
                got = self.vlm.respond([list(p.images) for p in prompts], [p.question for p in prompts],
                                       self.pruning, **gen.kwargs)
                answers, traces = got.answers, got.traces
            except InputError as exc:
                docs = ", ".join(f"{s.task}/{s.split}/{s.doc_id}" for s in batch)
                raise ValueError(f"arr_coc cannot ask one of the docs {docs}: {exc}") from exc
            for spec, answer, trace in zip(batch, answers, traces):
                text = rq.cut_at_stops(answer, gen.until)
                out[spec.index] = GenerationResult(text=text, token_counts=TokenCounts(
                    input_tokens=int(trace.prompt_tokens), output_tokens=int(trace.new_tokens)))
                self.cache_hook.add_partial("generate_until", (spec.context, spec.gen_kwargs), text)
                self._count(trace)
            bar.update(len(batch))
        bar.close()
        u = self.usage
        if u["total_tokens"]:
            logger.info(f"arr_coc (rank {self.rank}): kept {u['kept_tokens']:,} of {u['total_tokens']:,} visual "
                        f"tokens ({u['kept_tokens'] / u['total_tokens']:.1%}) over {u['requests']} requests; "
                        f"{u['keep_all']} image(s) kept every token because selection failed")
        return out  # type: ignore[return-value]

    def _count(self, trace: Any) -> None:
        self.usage["requests"] += 1
        self.usage["kept_tokens"] += int(trace.kept_tokens)
        self.usage["total_tokens"] += int(trace.total_tokens)
        self.usage["keep_all"] += sum(fb == "keep_all" for fb in trace.fallback)


NEEDS = {"input": "changes the input image", "boxes": "needs the answer's boxes",
         "weights": "needs a weights folder"}


def check_method(method: str) -> str:
    """A method `ARRCOC.respond` can run from a request alone; the evaluation-only ones say what to do."""
    from ..pipeline.selection import get_selector, method_info

    if method == "arr_coc_trained":
        raise ValueError("method=arr_coc_trained is the evaluation's name for a trained layer; pass method=arr_coc "
                         "with arr_coc=FOLDER (the shipped layer is the default for the embedded model)")
    info = method_info(method)   # an unknown name raises, listing the known ones
    if info.needs:
        raise ValueError(f"method={method} cannot run inside lmms-eval: it {NEEDS[info.needs]}, "
                         "which a benchmark request does not carry; use `python -m arr_coc eval` for it")
    get_selector(method)
    return method


def merged_args(arg_string: str | dict, additional_config: dict | None = None) -> dict[str, Any]:
    """`--model_args` + the command line's batch_size/device -> keyword arguments of ARRCOCLmms.

    lmms-eval's parser, except that `budget` stays the string written (so "64" is a count, "1" refused), and that
    a key given in `--model_args` wins over the command line's value (lmms-eval passes batch_size=1 unless told).
    """
    if isinstance(arg_string, dict):
        args = dict(arg_string)
    else:
        args = simple_parse_args_string(arg_string or "")
        raw = re.search(r"(?:^|,)\s*budget\s*=\s*([^,]*)", arg_string or "")
        if raw is not None:
            args["budget"] = raw.group(1).strip()
    extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
    return {**args, **extra}
