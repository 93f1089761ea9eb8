"""How a request executes: eagerly with its own shapes, or fast (fixed shapes, compiled and captured).

    Execution.eager()                      every request its own shapes, eager PyTorch (the reference)
    Execution.fast(device)                 buckets + torch.compile: CUDA graphs ("reduce-overhead") on a GPU,
                                           inductor on the CPU
    Execution.fast(device, compiler="eager")  the same graphs captured, run without code generation (tests)

A fast execution rounds each request up to a bucket (`arr_coc.buckets`) and runs three stages through
`torch.compile(fullgraph=True, dynamic=False)`: the layer's device pass (`ARRCOCLayer.compile_device_pass`), the
vision tower on the chosen cells and the language model's forward over transformers' static KV cache (the Qwen
backend, `arr_coc/qwen/compiled.py`). One graph per bucket: a second request of the same bucket replays it, a new
bucket compiles once. What is not captured, and why: docs/GPU.md, "Fast path".

`default_execution(device)`: fast on a GPU, where launch overhead is what a batch-1 request pays; eager on the
CPU, where the measured gain does not pay for the compile (docs/GPU.md, "Fast path": the CPU table).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .buckets import Buckets

Compiler = Any   # a torch.compile backend: its name ("inductor", "eager", "aot_eager") or a callable backend
RECOMPILE_LIMIT = 64
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Execution:
    """buckets: fixed shapes (None: every request its own); compiled: stages run through torch.compile with
    `compiler` as its backend and `mode` ("reduce-overhead": CUDA graphs; None: the backend's default)."""

    buckets: Buckets | None = None
    compiled: bool = False
    compiler: Compiler = "inductor"
    mode: str | None = None
    label: str = field(default="eager")
    fallback: bool = True     # a stage that cannot be captured runs eagerly (logged once) instead of failing

    @classmethod
    def eager(cls) -> Execution:
        return cls()

    @classmethod
    def fast(cls, device: torch.device | str = "cpu", compiler: Compiler = "inductor",
             buckets: Buckets | None = None, fallback: bool = True) -> Execution:
        gpu = torch.device(device).type == "cuda"
        mode = "reduce-overhead" if gpu and compiler == "inductor" else None
        return cls(buckets or Buckets(), True, compiler, mode, "fast", fallback)

    def compile(self, fn: Callable, stage: str = "") -> Callable:
        """`fn` through torch.compile: one whole graph (a graph break raises), static shapes (one graph per
        bucket; a new shape compiles anew rather than going dynamic). Under a dispatch mode (the FLOP and op
        counters) `fn` runs eagerly instead, on the same shapes: a compiled graph hides its ops from them.
        Each new shape is announced before it compiles (`compile_note`: `stage` names what compiles)."""
        if not self.compiled:
            return fn
        import torch._dynamo

        # one graph per bucket and per model or layer of a kind: more than dynamo's default of 8 per function
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.compiler, mode=self.mode)
        failed: list[str] = []
        seen: set[tuple] = set()
        stage = stage or getattr(fn, "__qualname__", "a stage")

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if _get_current_dispatch_mode() is not None or failed:
                return fn(*args, **kwargs)
            shapes = _shapes(args, kwargs)
            if shapes not in seen:
                seen.add(shapes)
                logger.warning("%s", compile_note(stage, shapes))
            try:
                return compiled(*args, **kwargs)
            except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
                if not self.fallback:
                    raise
                failed.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                logger.warning("%s could not be captured as one graph (%s); it runs eagerly from now on",
                               getattr(fn, "__qualname__", fn), failed[0])
                return fn(*args, **kwargs)
        return run


def _shapes(args: tuple, kwargs: dict) -> tuple:
    """The shapes a compiled graph is specialised on: every tensor's among the arguments (nested ones too)."""
    from torch.utils._pytree import tree_leaves

    return tuple(tuple(x.shape) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor))


def compile_note(stage: str, shapes: tuple) -> str:
    """The line said before a stage compiles for a new shape (its bucket)."""
    first = "x".join(map(str, shapes[0])) if shapes and shapes[0] else "scalars"
    return (f"--fast: compiling {stage} for a new bucket (first input {first}); this happens once per shape, "
            "and later requests of the same bucket reuse it")


CPU_NOTE = ("--fast on: on the CPU the compiled path is slower than eager (docs/GPU.md, \"Fast path\"), and each "
            "new bucket compiles for about 25-90 s per stage; --fast auto (the default) runs eagerly here")


def default_execution(device: torch.device | str) -> Execution:
    """Fast on a GPU, eager on the CPU (module docstring)."""
    return Execution.fast(device) if torch.device(device).type == "cuda" else Execution.eager()


def read_fast_flag(value: bool | str | None, device: torch.device | str) -> Execution:
    """A user's --fast / fast= value: True / "on", False / "off", None / "auto" (`default_execution`)."""
    if value in (None, "auto"):
        return default_execution(device)
    if value in (True, "on", "true", "1"):
        if torch.device(device).type == "cpu":
            logger.warning("%s", CPU_NOTE)
        return Execution.fast(device)
    if value in (False, "off", "false", "0"):
        return Execution.eager()
    raise ValueError(f"fast must be on, off or auto, got {value!r}")


__all__ = ["CPU_NOTE", "Execution", "compile_note", "default_execution", "read_fast_flag"]
