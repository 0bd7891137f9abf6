"""Post-import patches that let SGLang 0.5.23's own server run on a CPU without sgl_kernel or Triton.

Each patch replaces one platform check or one Triton-only kernel that has no CPU path, right after
the SGLang module holding it is imported (a meta-path hook: no SGLang file is edited). Installed in
every process SGLang starts (`site/sitecustomize.py`); `PATCHES` below is the list docs/sglang.md
reproduces, each with the SGLang file:line it replaces. Test and bench support only: the plugin's
production path never imports this package.

`HISTATE_CPU_SERVER_SKIP=name,...` leaves patches out (to reproduce one blocker);
`HISTATE_CPU_SERVER_TRACE=1` logs each patch as it is applied.
"""
from __future__ import annotations

import importlib.abc
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from . import kernels


@dataclass(frozen=True)
class Patch:
    module: str  # the SGLang module the patch is applied to, right after its import
    name: str
    replaces: str  # SGLang file:line of the check or kernel replaced (docs/sglang.md)
    apply: Callable[[Any], None]


def _extra_buffer_platform(module: Any) -> None:
    # "extra_buffer requires platform support for Mamba cache state snapshots" (CPU is not in the list).
    module._platform_supports_mamba_cache_extra_buffer = lambda: True


def _gated_norm_cpu(module: Any) -> None:
    # RMSNormGated takes the CPU op only with AMX (`_use_cpu = is_cpu() and cpu_has_amx_support()`);
    # without AMX it falls to the Triton kernel, not to torch. Route it to the CPU op (kernels.py).
    module._use_cpu = True


def _track_rows(cache_indices: Any, mask: Any, track_indices: Any, batch_size: int, check_freed_slots: bool) -> tuple:
    rows = mask[:batch_size].nonzero().flatten()
    src, dst = cache_indices[rows].long(), track_indices[rows].long()
    if check_freed_slots:  # the unified pool marks freed slots -1 (the Triton kernel skips them)
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    return src, dst


def track_mamba_states_if_needed(conv_states, ssm_states, cache_indices, mamba_track_mask, mamba_track_indices,
                                 batch_size, check_freed_slots=False):
    """One layer: for every tracked row, copy slot cache_indices[i] to mamba_track_indices[i]."""
    if batch_size == 0:
        return
    src, dst = _track_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    conv_states[dst] = conv_states[src]
    ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(conv_states_pool, ssm_states_pool, cache_indices, mamba_track_mask,
                                  mamba_track_indices, batch_size, check_freed_slots=False):
    """Every layer at once: pools are [layers, slots, ...]."""
    if batch_size == 0:
        return
    src, dst = _track_rows(cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots)
    conv_states_pool[:, dst] = conv_states_pool[:, src]
    ssm_states_pool[:, dst] = ssm_states_pool[:, src]


def _track_torch(module: Any) -> None:
    # Decode-time state tracking (extra_buffer) is the Triton `track_mamba_state_if_needed_kernel`, with
    # no CPU path; the module binding is replaced where it is defined and where the backend imported it.
    for fn in (track_mamba_states_if_needed, track_mamba_states_all_layers):
        if hasattr(module, fn.__name__):
            setattr(module, fn.__name__, fn)


def _host_transfer_ops(module: Any) -> None:
    # On a platform neither CUDA/ROCm nor XPU the host pools bind no KV-transfer op: the first backup
    # raises NameError. Bind the torch versions.
    for fn in kernels.KVCACHEIO_OPS:
        if getattr(module, fn.__name__, None) is None:
            setattr(module, fn.__name__, fn)


def _unpinned(init: Callable) -> Callable:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    return __init__


def _unpinned_host_pools(module: Any) -> None:
    # Host pools are built with pin_memory=True: their buffers are registered with cudaHostRegister
    # (torch.cuda.cudart(), pool_host/common.py:143, :349) and scratch pages are allocated with
    # torch's pin_memory flag (pool_host/mha.py:728-733, the dummy page every L3 prefetch reads into),
    # both of which raise without an accelerator. Pinning means nothing on a CPU-only host.
    for name in ("HostKVCache", "MambaPoolHost"):
        cls = getattr(module, name, None)
        if cls is not None and "__init__" in vars(cls) and not hasattr(cls.__init__, "__wrapped__"):
            cls.__init__ = _unpinned(cls.__init__)


PATCHES = (
    Patch("sglang.srt.arg_groups.mamba_hook", "extra_buffer_platform",
          "srt/arg_groups/mamba_hook.py:102-112 (asserted at :120)", _extra_buffer_platform),
    Patch("sglang.kernels.ops.attention.fla.layernorm_gated", "gated_norm_cpu",
          "kernels/ops/attention/fla/layernorm_gated.py:35 (used at :517)", _gated_norm_cpu),
    Patch("sglang.kernels.ops.attention.fla.fused_norm_gate", "gated_norm_cpu",
          "kernels/ops/attention/fla/fused_norm_gate.py:20 (used at :443)", _gated_norm_cpu),
    Patch("sglang.kernels.ops.mamba.mamba_state_scatter_triton", "track_torch",
          "kernels/ops/mamba/mamba_state_scatter_triton.py:192, :914", _track_torch),
    Patch("sglang.srt.layers.attention.hybrid_linear_attn_backend", "track_torch",
          "srt/layers/attention/hybrid_linear_attn_backend.py:16-17 (called at :999, :1009, :1161)", _track_torch),
    Patch("sglang.srt.mem_cache.pool_host.mha", "host_transfer_ops",
          "srt/mem_cache/pool_host/mha.py:60-90", _host_transfer_ops),
    Patch("sglang.srt.mem_cache.pool_host.mamba", "host_transfer_ops",
          "srt/mem_cache/pool_host/mamba.py:28-53", _host_transfer_ops),
    Patch("sglang.srt.mem_cache.pool_host.base", "unpinned_host_pools",
          "srt/mem_cache/pool_host/base.py:171-204 (pin_memory used at common.py:349, mha.py:728-733)",
          _unpinned_host_pools),
    Patch("sglang.srt.mem_cache.pool_host.mamba", "unpinned_host_pools",
          "srt/mem_cache/pool_host/mamba.py:83-118", _unpinned_host_pools),
)


def _pin_memory_is_identity() -> None:
    """`ScheduleBatch.prepare_for_decode` pins the extra_buffer track mask unconditionally
    (managers/schedule_batch.py:3830); with no accelerator torch raises "Cannot access accelerator
    device when none is available". Pinning means nothing on a CPU-only host."""
    import torch

    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "__wrapped__", None):
        return
    original = torch.Tensor.pin_memory

    def pin_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self

    pin_memory.__wrapped__ = original
    torch.Tensor.pin_memory = pin_memory


PIN_MEMORY_REPLACES = "srt/managers/schedule_batch.py:3830"


def _skipped() -> set:
    return set(filter(None, os.environ.get("HISTATE_CPU_SERVER_SKIP", "").split(",")))


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, patches: list):
        self.inner = inner
        self.patches = patches

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        for patch in self.patches:
            patch.apply(module)
            if os.environ.get("HISTATE_CPU_SERVER_TRACE") == "1":
                print(f"[cpu-server] patched {module.__name__}: {patch.name}", file=sys.stderr, flush=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the target modules with the other finders and wraps their loaders."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _PatchingLoader):
                    spec.loader = _PatchingLoader(spec.loader, self.patches[fullname])
                return spec
        return None


def install() -> None:
    """Apply every patch now for modules already imported, and on import for the others (idempotent)."""
    if any(isinstance(finder, _PatchingFinder) for finder in sys.meta_path):
        return
    skip = _skipped()
    by_module: dict = {}
    for patch in PATCHES:
        if patch.name in skip:
            continue
        by_module.setdefault(patch.module, []).append(patch)
        if patch.module in sys.modules:
            patch.apply(sys.modules[patch.module])
    if "pin_memory" not in skip:
        _pin_memory_is_identity()
    sys.meta_path.insert(0, _PatchingFinder(by_module))
