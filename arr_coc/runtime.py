"""Where and how a model runs: device, dtype and attention implementation, with one meaning everywhere.

`ask`, `eval`, `train`, `bench`, the app and `ARRCOC.from_pretrained` all take these three
and resolve them here, so "auto" or "bfloat16" means the same thing in every entry point:

    device               auto (cuda when available, else cpu) | cpu | cuda | cuda:N
    dtype                auto (float32 on cpu, bfloat16 on cuda when supported, else float16)
                         | float32 | bfloat16 | float16
    attn_implementation  sdpa | eager | flash_attention_2 (None: transformers' default, sdpa)

Every name is checked before a model is loaded, and a wrong one says what is accepted. The names import
no torch (torch is imported inside the functions), so `python -m arr_coc COMMAND --help` stays cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda or cuda:N"


class RuntimeChoiceError(ValueError):
    """A device, dtype or attention implementation that is not one of the accepted names."""


def _dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def __getattr__(name: str) -> Any:
    if name == "DTYPES":   # {"float32": torch.float32, ...}, built on first use (it needs torch)
        return _dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`auto` -> cuda when available, else cpu; a cuda device that is not there is refused with a reason."""
    import torch

    if isinstance(device, torch.device):
        return device
    name = str(device).strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except (RuntimeError, ValueError):
        raise RuntimeChoiceError(f"device {device!r} is not one of: {DEVICE_HELP}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise RuntimeChoiceError(f"device {device!r} is not one of: {DEVICE_HELP}")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeChoiceError(f"device {device!r}: this torch sees no CUDA device; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise RuntimeChoiceError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A torch dtype; `auto`/None -> float32 on cpu, bfloat16 on a GPU that has it, else float16."""
    import torch

    dtypes = _dtypes()
    if isinstance(dtype, torch.dtype):
        if dtype not in dtypes.values():
            raise RuntimeChoiceError(f"dtype {dtype} is not one of {list(dtypes)}")
        return dtype
    name = "auto" if dtype is None else str(dtype).strip().lower().removeprefix("torch.")
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in dtypes:
        raise RuntimeChoiceError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)}")
    return dtypes[name]


def check_attn_implementation(name: str | None) -> str | None:
    """None (transformers' default) or one of ATTN_IMPLEMENTATIONS."""
    if name is None:
        return None
    if name not in ATTN_IMPLEMENTATIONS:
        raise RuntimeChoiceError(f"attention implementation {name!r} is not one of {list(ATTN_IMPLEMENTATIONS)}")
    return name


@dataclass(frozen=True)
class Runtime:
    """A resolved (device, dtype, attention implementation): what `from_pretrained` is given."""

    device: torch.device
    dtype: torch.dtype
    attn_implementation: str | None = None

    @classmethod
    def resolve(cls, device: str | torch.device = "auto", dtype: str | torch.dtype | None = "auto",
                attn_implementation: str | None = None) -> Runtime:
        dev = resolve_device(device)
        return cls(dev, resolve_dtype(dtype, dev), check_attn_implementation(attn_implementation))

    def describe(self) -> str:
        """e.g. `cpu, float32, sdpa` (for logs and the app's status line)."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.device}, {dtype}, {self.attn_implementation or 'sdpa (default)'}"


def keep_large_buffers(limit: int = 1 << 30) -> bool:
    """Let glibc keep freed buffers of up to `limit` bytes in the process instead of unmapping them.

    By default glibc serves an allocation over its mmap threshold (at most 32 MiB) with fresh pages from the
    OS and hands them back when it is freed, so every such tensor a CPU forward makes costs a page fault per
    4 KiB the first time it is written: measured here on a batch of 8 images of 896 px, elementwise ops over
    the texture's 8 x 3 x 512 x 512 pixels took 30 ms instead of 3.7 ms. The commands that run models call
    this once (what MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ do, set at run time); the process's memory
    then stays at its peak instead of falling between batches. Not on other C libraries (returns False).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "mallopt"):
            return False
        return bool(libc.mallopt(-3, int(limit))) and bool(libc.mallopt(-1, int(limit)))   # M_MMAP / M_TRIM_THRESHOLD
    except OSError:
        return False


def add_arguments(parser: Any) -> None:
    """--device, --dtype and --attn-implementation on an argparse parser, with this module's one meaning (every
    command and the app take them)."""
    parser.add_argument("--device", default="auto", help=f"{DEVICE_HELP} (default auto)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="auto: float32 on cpu, bfloat16 on a GPU that has it, else float16 (default auto)")
    parser.add_argument("--attn-implementation", default=None, choices=ATTN_IMPLEMENTATIONS,
                        help="the VLM's attention kernels (default: transformers' own, sdpa)")


def add_fast_argument(parser: Any, buckets: bool = False) -> None:
    """--fast auto|on|off (`arr_coc.execution.read_fast_flag`): the commands' and the app's one flag for
    fixed-shape compiled execution. Here, beside --device, because `--help` must load no torch. buckets: also
    offer `--fast buckets`, the buckets' fixed shapes run eagerly (eval: what the fill alone changes)."""
    parser.add_argument("--fast", choices=("auto", "on", "off") + (("buckets",) if buckets else ()), default="auto",
                        help="run requests as fixed-shape compiled graphs (buckets, torch.compile, static KV cache): "
                             "auto = on a GPU, off on the CPU where it measured no faster" +
                             ("; buckets = the fixed shapes (each choice filled to its bucket) run eagerly, without "
                              "compiling" if buckets else "") + " (default auto)")


def check_supported(run: Runtime) -> None:
    """Refuse, before loading, a runtime transformers would refuse halfway (flash_attention_2 off a GPU, in
    float32, or without the flash-attn package), with what to pass instead."""
    if run.attn_implementation != "flash_attention_2":
        return
    import importlib.util

    import torch

    if run.device.type != "cuda":
        raise RuntimeChoiceError(f"attention implementation 'flash_attention_2' runs on CUDA devices only, not "
                                 f"{run.device}; pass --device cuda, or --attn-implementation sdpa")
    if run.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeChoiceError("attention implementation 'flash_attention_2' needs --dtype bfloat16 or float16, "
                                 f"not {str(run.dtype).removeprefix('torch.')}; or pass --attn-implementation sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise RuntimeChoiceError("attention implementation 'flash_attention_2' needs the flash-attn package, which is "
                                 "not installed; `pip install flash-attn --no-build-isolation` (on the CUDA machine), "
                                 "or pass --attn-implementation sdpa")
