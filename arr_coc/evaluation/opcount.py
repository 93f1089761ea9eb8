"""Counting what a forward costs on a GPU: aten ops (kernel launches) and host synchronisations.

On a GPU, ARR-COC's arithmetic is nearly free; what it costs is one kernel launch per aten op (a few
microseconds each) and a pipeline stall per host synchronisation (the host waits until the GPU has
finished everything queued). `OpCounter` is a `TorchDispatchMode` that sees every aten op a block of
code issues, on any device, so both can be counted on the CPU:

    with OpCounter() as ops:
        layer(...)
    ops.total, ops.syncs, ops.sync_ops()   # 212, 0, {}

An op counts as a synchronisation when, on a GPU, it makes the host wait for the device:
- reading a value on the host: `.item()`, `int()` / `float()` / `bool()` of a tensor, a Python `if` on a
  tensor (`aten._local_scalar_dense`, `aten.is_nonzero`, `aten.equal`);
- an op whose output size depends on the data: `nonzero`, `masked_select`, `unique`, boolean-mask
  indexing (`x[mask]`, `x[mask] = v`), `repeat_interleave` without `output_size`;
- a blocking copy between devices (`.to("cpu")`, `.to("cuda")` without non_blocking).

A tensor made from host data inside the block (`torch.tensor([...])`, `aten.lift_fresh`) is host work, but
becomes a stall when it is then copied to a GPU from pageable memory; the core sends host data on purpose
through `arr_coc.core.grid.upload` (pinned, asynchronous on a GPU), counted as `uploads`, and any other is counted
as `host_tensors` (the layer's forward has none).

What it cannot see on the CPU: `.tolist()` and `.numpy()` of a CPU tensor read memory without an aten op.
`tests/test_device.py` runs the layer on the meta device as well, where any host read raises.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..core.grid import UPLOAD_WATCHERS

# Ops that read a value on the host or whose output shape depends on tensor values.
SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.nonzero", "aten.nonzero_static",
    "aten.masked_select", "aten._unique", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.unique_dim_consecutive", "aten.argwhere",
})
HOST_TENSOR_OPS = frozenset({"aten.lift_fresh", "aten.lift_fresh_copy"})   # a tensor made from host data
# Ops that only describe a tensor differently (no kernel runs on a GPU).
VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.alias", "aten.as_strided", "aten.expand",
    "aten.permute", "aten.transpose", "aten.t", "aten.unsqueeze", "aten.squeeze", "aten.select", "aten.slice",
    "aten.detach", "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.diagonal",
    "aten.view_as_real", "aten.view_as_complex", "aten.unfold", "aten.narrow", "aten.movedim",
    "aten._reshape_alias", "aten.expand_as", "aten.view_as",
})


def _name(func: Any) -> str:
    """'aten.add.Tensor' -> 'aten.add' (the overload does not change what runs)."""
    return ".".join(str(func).split(".")[:2])


def _is_sync(name: str, func: Any, args: tuple, kwargs: dict) -> bool:
    if name in SYNC_OPS:
        return True
    if name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None and any(isinstance(a, torch.Tensor) for a in args[1:2])
    if name in ("aten._to_copy", "aten.copy_", "aten._copy_from"):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        target = kwargs.get("device")
        devices = {t.device for t in tensors} | ({torch.device(target)} if target is not None else set())
        return len(devices) > 1 and not kwargs.get("non_blocking", False)
    return False


class OpCounter(TorchDispatchMode):
    """Counts aten ops (all, without views, and those that synchronise with the host) inside a `with` block.

    record_stacks: keep the Python stack of every synchronising op (for a failing test's message).
    """

    def __init__(self, record_stacks: bool = True):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sync_sites: list[tuple[str, str]] = []
        self.record_stacks = record_stacks
        self.uploads = 0  # host data sent to the device through `arr_coc.core.grid.upload` (asynchronous on a GPU)
        self.host_tensors = 0  # tensors made from host data anywhere else (`torch.tensor([...])` inside the block)
        self._in_upload = False

    def __enter__(self) -> OpCounter:
        UPLOAD_WATCHERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        UPLOAD_WATCHERS.remove(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        self.ops[name] += 1
        if name in HOST_TENSOR_OPS:
            if not self._in_upload:
                self.host_tensors += 1
        elif _is_sync(name, func, args, kwargs):
            where = ""
            if self.record_stacks:
                frames = [f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename]
                where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[-3:][::-1])
            self.sync_sites.append((name, where))
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Every aten op."""
        return sum(self.ops.values())

    @property
    def kernels(self) -> int:
        """Ops that launch work on a GPU (views and aliases excluded)."""
        return sum(n for k, n in self.ops.items() if k not in VIEW_OPS)

    @property
    def syncs(self) -> int:
        return len(self.sync_sites)

    def sync_ops(self) -> Counter[str]:
        return Counter(name for name, _ in self.sync_sites)

    def summary(self, top: int = 12) -> str:
        common = ", ".join(f"{k.removeprefix('aten.')} {n}" for k, n in self.ops.most_common(top))
        return (f"{self.total} aten ops ({self.kernels} launching kernels), {self.syncs} synchronising, {self.uploads} "
                f"uploads; most: {common}")


__all__ = ["OpCounter", "SYNC_OPS", "VIEW_OPS"]
