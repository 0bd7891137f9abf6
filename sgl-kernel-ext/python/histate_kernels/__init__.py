"""HiState state-capture kernels: one prefill, several checkpoints, one I/O per checkpoint.

A chunked GDN prefill computes the recurrent state at every 64-token chunk boundary (fla keeps them
in `h[:, i]`; `histate.reference.gdr` returns the requested ones). HiState's interval controller
plans which boundaries become checkpoints. These ops move them where they belong:

  gather_states(src, src_index, dst, dst_index)
      dst[l, dst_index[i]] = src[l, src_index[i]].to(dst.dtype) -- per-chunk states (or conv windows)
      of every layer into state-pool slots, converting dtype (e.g. fp32 states into a bf16 pool).
  pack_slot(pools, slot, layout) -> uint8 buffer
      one checkpoint (one slot of each pool) laid out contiguously for a single SSD write.
  unpack_slot(packed, layout, pools, slot)
      the restore path: a packed checkpoint back into a pool slot.

Backends: "triton" (CUDA tensors, triton importable) and "torch" (the reference; any device).
`backend="auto"` picks triton for CUDA tensors when it can, else torch. triton is imported lazily,
only on that path, so CPU-only installs (where triton must not be installed) work unchanged.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from histate_kernels import reference
from histate_kernels.layout import REGION_ALIGN_BYTES, CheckpointLayout, Region

__all__ = [
    "CheckpointLayout",
    "REGION_ALIGN_BYTES",
    "Region",
    "gather_states",
    "pack_slot",
    "triton_available",
    "unpack_slot",
]

_BACKENDS = ("auto", "torch", "triton")


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when a CUDA device is present and triton is importable (nothing is imported here).

    CUDA is checked first: CPU test bootstraps may put a triton *stub* in sys.modules (SGLang imports
    triton unconditionally), whose module spec can be missing or meaningless.
    """
    if not torch.cuda.is_available():
        return False
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _impl(backend: str, is_cuda: bool):
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {_BACKENDS}")
    if backend == "auto":
        backend = "triton" if is_cuda and triton_available() else "torch"
    if backend == "torch":
        return reference
    if not triton_available():
        raise RuntimeError("backend='triton' needs the triton package and a CUDA device")
    from histate_kernels import triton_ops

    return triton_ops


def gather_states(src: torch.Tensor, src_index: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor,
                  *, backend: str = "auto") -> None:
    """Copy rows `src[:, src_index[i]]` into `dst[:, dst_index[i]]` for all layers, casting to dst's dtype.
    src `[L, N_src, *row]`, dst `[L, N_dst, *row]`; dst rows must be contiguous; dst_index unique."""
    _impl(backend, dst.is_cuda).gather_states(src, src_index, dst, dst_index)


def pack_slot(pools: dict[str, torch.Tensor], slot: int, layout: CheckpointLayout,
              out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Slot `slot` of each pool `[L, N_slots, *row]`, laid out by `layout`, in one uint8 buffer."""
    is_cuda = next(iter(pools.values())).is_cuda
    return _impl(backend, is_cuda).pack_slot(pools, slot, layout, out)


def unpack_slot(packed: torch.Tensor, layout: CheckpointLayout, pools: dict[str, torch.Tensor], slot: int,
                *, backend: str = "auto") -> None:
    """Inverse of `pack_slot`: write a packed checkpoint into slot `slot` of each pool."""
    _impl(backend, packed.is_cuda).unpack_slot(packed, layout, pools, slot)
