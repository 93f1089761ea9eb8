"""Data parallelism for the scorers' training: one plain process, or one process per device.

    accelerate launch --multi_gpu --num_processes 8 -m arr_coc train ...                # 8 GPUs (nccl)
    accelerate launch --multi_gpu --num_processes 2 -m arr_coc train --device cpu ...   # 2 CPU processes (gloo)
    torchrun --nproc_per_node 2 -m arr_coc train --device cpu ...                       # the same, torch's launcher

(`accelerate launch --cpu --num_processes N` starts ONE process in accelerate 1.15: it runs several
CPU processes only through mpirun. `Processes.start` refuses that launch and says what to run.)

How a step is shared. Every process holds the whole layer, the optimiser and every item's
features. All processes draw the same global batch (one seeded generator, `world x batch_size`
items); each scores its contiguous share; its loss is its share's contribution to the global
batch's mean (`weigh`: its items' mean x its items / the batch's items); after the backward pass
the gradients are summed over the processes (`sum_gradients`), so every process holds the
gradient of the global batch's mean, clips it by the same global norm and takes the same AdamW
step. Two processes with a batch of 4 each therefore follow one process with a batch of 8, up to
the order of floating-point sums (tests/test_train_ddp.py).

Why not torch's DistributedDataParallel (what `Accelerator.prepare` would wrap the layer in): the
training never calls the layer's `forward` (it runs `pad_inputs` + `score`, which DDP does not
intercept), zero-initialised branches of the layer are skipped while zero (DDP would need
`find_unused_parameters`), and the layer is small (41k parameters on the embedded model, 476k =
1.8 MiB against a 7B Qwen's 3584-wide embeddings), so bucketed all-reduce overlapping the backward
pass buys nothing. accelerate supplies the process group, this process's
device and the launchers; the one collective per step is an all-reduce of the flat gradient.

One process (no launcher) takes none of these paths: nothing is weighed, reduced or broadcast,
and training is bit for bit what it was before this module existed.

`eval` uses the same processes: each runs a contiguous share of the batches and `gather` hands
every process all of them in batch order (evaluation/loop.py), so rank 0 reports what one process would.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# World size as each launcher writes it: torchrun / accelerate (WORLD_SIZE), MPI flavours.
_WORLD_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


class LaunchError(RuntimeError):
    """The processes were launched in a way this training cannot run data-parallel; the message says what to run."""


def _env_world() -> int:
    for key in _WORLD_ENV:
        if os.environ.get(key, "").strip().isdigit():
            return int(os.environ[key])
    return 1


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def launched() -> bool:
    """True under a distributed launcher (torchrun, accelerate launch, mpirun)."""
    return _env_world() > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ


def wants_cpu(device: str | torch.device) -> bool:
    """Whether the requested --device means CPU processes (gloo) rather than one GPU each (nccl)."""
    name = str(device).strip().lower()
    return name.startswith("cpu") or (name == "auto" and not torch.cuda.is_available())


@dataclass(frozen=True)
class Processes:
    """This process's place among the training processes (rank 0 of 1 when run plainly)."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None  # under a launcher: this process's device (from accelerate); else None

    @property
    def is_main(self) -> bool:
        """The one process that writes checkpoints, logs, caches and shows progress."""
        return self.rank == 0

    @classmethod
    def start(cls, device: str | torch.device = "auto") -> Processes:
        """One plain process, or join the launcher's process group through accelerate.

        `device` is the requested --device: under a launcher, cpu (or auto on a machine without
        CUDA) makes CPU processes on gloo; otherwise each process takes the GPU accelerate gives it.
        """
        if not launched():
            return cls()
        if _truthy("ACCELERATE_USE_CPU") and "MASTER_ADDR" in os.environ and _env_world() == 1:
            raise LaunchError(
                "`accelerate launch --cpu --num_processes N` starts a single process (accelerate runs several CPU "
                "processes only through mpirun). For N CPU processes run `accelerate launch --multi_gpu "
                "--num_processes N -m arr_coc train --device cpu ...` or `torchrun --nproc_per_node N -m arr_coc "
                "train --device cpu ...`; for one process drop --num_processes")
        try:
            from accelerate import PartialState
        except ImportError:
            raise LaunchError("launched as several processes, but accelerate is not installed: "
                              "pip install accelerate==1.15.0 (it is pinned in requirements.txt)") from None
        state = PartialState(cpu=wants_cpu(device))
        dev = torch.device(state.device)
        if dev.type == "cpu":
            dev = torch.device("cpu")  # accelerate says cpu:0; one name for one CPU
        return cls(rank=state.process_index, world=state.num_processes, device=dev)

    def device_for(self, requested: str) -> str:
        """The --device this process loads the VLM on: the request, or under a launcher its own device.

        Under a launcher every process has its own device; a request that names another one is refused.
        """
        if self.device is None:
            return requested
        name = str(requested).strip().lower()
        if name == "auto":
            return str(self.device)
        try:
            want = torch.device(name)
        except (RuntimeError, ValueError):
            return requested  # not a device name: arr_coc.runtime says what is accepted
        same_index = want.index is None or want.type == "cpu" or want.index == self.device.index
        if want.type != self.device.type or not same_index:
            raise LaunchError(
                f"--device {requested} is not this process's device under the launcher ({self.device}, process "
                f"{self.rank} of {self.world}): each process takes its own device from the launcher; pass --device "
                f"auto (or {self.device.type})")
        return str(self.device)

    # -- sharing work ------------------------------------------------------------------

    def share(self, n: int) -> slice:
        """This process's contiguous share of n things (shares in rank order make up all n)."""
        return slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def weigh(self, mean: torch.Tensor, local: int, total: int) -> torch.Tensor:
        """A mean over this process's `local` items -> its contribution to the mean over all `total` items.

        Summed over the processes, the contributions are the global mean (and so are their gradients).
        One process: returned as is.
        """
        if self.world == 1:
            return mean
        return mean * (local / total) if total else mean * 0.0

    # -- collectives (no-ops for one process) -------------------------------------------

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum each parameter's .grad over the processes (one all-reduce of a flat vector).

        A parameter that no process reached keeps grad None, as it would in one process (AdamW
        then leaves it alone); one reached anywhere gets the sum, zeros standing in elsewhere.
        """
        if self.world == 1:
            return
        import torch.distributed as dist

        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                 for p in params]
        reached = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([*grads, reached])                   # [sum numel + len(params)]
        dist.all_reduce(flat)
        seen, offset = flat[-len(params):], 0
        for p, was in zip(params, seen.tolist()):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone() if was > 0 else None
            offset += n

    def sum_values(self, values: dict[str, float]) -> dict[str, float]:
        """Sum python floats over the processes (the logged losses: contributions -> global means)."""
        if self.world == 1 or not values:
            return values
        import torch.distributed as dist

        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(values, t.tolist()))

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order, in every process; one process: [obj]."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Every process starts from rank 0's parameters and buffers (a seeded init should agree; this makes sure)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t.data, src=0)

    def agree(self, flag: bool) -> bool:
        """Rank 0's answer, in every process (a decision such as 'the cache file exists' must be one decision)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        """Leave the process group (the command's last step; a no-op for one process)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
