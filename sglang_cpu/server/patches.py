"""Post-import patches that let SGLang 0.5.23's own server run on a CPU without sgl_kernel or Triton.

Each patch replaces one platform check or one Triton-only kernel that has no CPU path, right after
the SGLang module holding it is imported (a meta-path hook: no SGLang file is edited); one, without
CUDA, points the "triton" attention backend at its CPU stand-in (`unified_attention.py`, which reads
and writes KV through SGLang's translator, so the unified device pool runs here). Installed in
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


def _host_reserve(module: Any) -> None:
    # SGLang keeps 10 GiB of the host's available memory out of every HiCache host pool
    # (HICACHE_HOST_MEMORY_RESERVE_BYTES, pool_host/base.py:28, subtracted at :104-107), sized for a GPU
    # server. The tiny CPU servers here need a few MB of host pool each, but a 24 GiB CI machine running
    # five of them beside other tests has less than 10 GiB available, and every HiCache server then
    # refuses to start ("Not enough host memory available"). HISTATE_CPU_SERVER_HOST_RESERVE_GIB (default
    # 1) replaces the reserve; pools sized explicitly or by SGLang's auto-sizing are otherwise unchanged.
    module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(float(os.environ.get("HISTATE_CPU_SERVER_HOST_RESERVE_GIB", "1"))
                                                   * (1 << 30))


class _GridLaunch:
    """`kernel[grid](*args)` for a torch function (the grid means nothing on a CPU)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __getitem__(self, grid: Any) -> Callable:
        return self.fn


def alloc_extend_kernel(prefix_lens, seq_lens, last_loc, free_page_ptr, out_indices, bs_upper, page_size):
    """The Triton `alloc_extend_kernel` (kernels/ops/memory/allocator.py:116) as paged.py's own torch
    version, `alloc_extend_naive`, with the kernel's argument order."""
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    alloc_extend_naive(prefix_lens, seq_lens, last_loc, free_page_ptr, out_indices, page_size, out_indices.device)


def alloc_decode_kernel(seq_lens, last_loc, free_page_ptr, out_indices, bs_upper, page_size):
    """The Triton `alloc_decode_kernel` (kernels/ops/memory/allocator.py:203) as paged.py's
    `alloc_decode_naive`; the new-page count it takes is the kernel's own rule (a row whose new token
    opens a page, (seq_len - 1) % page_size == 0), which the caller's `get_num_new_pages` also counts."""
    from sglang.srt.mem_cache.allocator.paged import alloc_decode_naive

    num_new_pages = int(((seq_lens - 1) % page_size == 0).sum())
    alloc_decode_naive(seq_lens, last_loc, free_page_ptr, out_indices, page_size, num_new_pages)


def _unified_alloc_torch(module: Any) -> None:
    # The unified pool's allocator launches the Triton paged-allocation kernels unconditionally
    # (unified_sub_pool.py:1242 alloc_extend, :1299 alloc_decode), where the static paged allocator
    # falls back to torch without Triton (paged.py:246-265, :299-318). Bind the torch versions.
    module.alloc_extend_kernel = _GridLaunch(alloc_extend_kernel)
    module.alloc_decode_kernel = _GridLaunch(alloc_decode_kernel)


def _create_triton_stand_in(runner: Any) -> Any:
    from .unified_attention import create_backend

    return create_backend(runner)


def _triton_attention_stand_in(module: Any) -> None:
    # SGLang's "triton" attention backend (TritonAttnBackend) has no CPU path. Without CUDA its registry
    # entry builds the CPU stand-in `unified_attention.TranslatingTorchAttnBackend` instead: torch SDPA
    # that writes and reads KV through SGLang's KVLocPlan / KVIndexTranslator, as TritonAttnBackend does,
    # so the unified device pool (page-major layout, allow-list kv_cache_hook.py:812-826) runs on CPU
    # with SGLang's and HiState's checks unchanged. `--attention-backend torch_native` is untouched.
    import torch

    if not torch.cuda.is_available():
        module.ATTENTION_BACKENDS["triton"] = _create_triton_stand_in


def _keep_direct_io_on_cpu(module: Any) -> None:
    # With --enable-unified-memory SGLang moves a page_first_direct host tier to page_first + the
    # "kernel" io backend (hicache_hook.py:228-244, called at :86): its CUDA direct copies step device
    # rows by the row width, and the unified pool's per-layer KV views are strided (token-major
    # entries). On CPU the kernel io ops are CUDA/JIT only (pool_host/mha.py:60-73, 248-251;
    # pool_host/mamba.py:31-41), while the direct ops bound here (`_host_transfer_ops`, kernels.py) are
    # torch indexing, which follows each view's strides. Keep the direct io backend on CPU.
    import torch

    original = module.resolve_unified_memory_layout_io
    if torch.cuda.is_available() or getattr(original, "__wrapped__", None):
        return

    def resolve_unified_memory_layout_io(server_args: Any) -> None:
        return None

    resolve_unified_memory_layout_io.__wrapped__ = original
    module.resolve_unified_memory_layout_io = resolve_unified_memory_layout_io


DIRECT_IO_OPS = ("transfer_kv_per_layer_direct_pf_lf", "transfer_kv_all_layer_direct_lf_pf")


def _strided_direct_io(module: Any) -> None:
    # `_require_packed_device_rows` refuses strided device rows before the direct page-first copies
    # (pool_host/base.py:342-349, called at mha.py:527, :685): the CUDA kernels step rows by the row
    # width. The torch stand-ins bound on CPU (kernels.transfer_kv_per_layer_direct_pf_lf,
    # transfer_kv_all_layer_direct_lf_pf) index each per-layer view by its own strides, so on CPU the
    # check is waived for those two ops only; every other kernel keeps it.
    import torch

    cls = getattr(module, "HostKVCache", None)
    if cls is None or torch.cuda.is_available() or hasattr(cls._require_packed_device_rows, "__wrapped__"):
        return
    original = cls._require_packed_device_rows

    def _require_packed_device_rows(self: Any, kernel: str) -> None:
        if kernel in DIRECT_IO_OPS:
            return
        original(self, kernel)

    _require_packed_device_rows.__wrapped__ = original
    cls._require_packed_device_rows = _require_packed_device_rows


class _HostStream:
    """The current "stream" of a CPU-only process: every op already ran, in program order, on the
    calling thread, so ordering after a stream or an event is done before it is asked for."""

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event


class _CudaWithHostStreams:
    """`torch.cuda` for one module: `current_stream()` is `_HostStream`, everything else is torch's."""

    def __init__(self, cuda: Any):
        self._cuda = cuda

    def current_stream(self, device: Any = None) -> _HostStream:
        return _HostStream()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cuda, name)


class _TorchWithHostStreams:
    """`torch` as one module sees it: torch itself, but `torch.cuda.current_stream()` is `_HostStream`."""

    def __init__(self, torch_module: Any):
        self._torch = torch_module
        self.cuda = _CudaWithHostStreams(torch_module.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def _unified_allocator_streams(module: Any) -> None:
    # The unified allocator orders its frees and compaction moves after HiCache copies and the forward
    # with `torch.cuda.current_stream().wait_event(...)` / `.wait_stream(...)` / `.synchronize()`
    # (unified_sub_pool.py:1348, 1569, 1711, 1810, 1908, 2100-2104, 2158), unconditionally; without CUDA
    # the first such call raises "Torch not compiled with CUDA enabled" (seen at :2100 when a full
    # device pool flushes for an allocation). On a CPU-only host they order nothing. The module's own
    # `torch` global is swapped for a view of torch whose `cuda.current_stream()` is a no-op stream;
    # no other module sees it.
    import torch

    if torch.cuda.is_available() or isinstance(module.torch, _TorchWithHostStreams):
        return
    module.torch = _TorchWithHostStreams(torch)


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
    Patch("sglang.srt.mem_cache.pool_host.base", "host_reserve",
          "srt/mem_cache/pool_host/base.py:28 (subtracted at :104-107)", _host_reserve),
    Patch("sglang.srt.mem_cache.pool_host.mamba", "unpinned_host_pools",
          "srt/mem_cache/pool_host/mamba.py:83-118", _unpinned_host_pools),
    Patch("sglang.srt.mem_cache.allocator.unified_sub_pool", "unified_alloc_torch",
          "srt/mem_cache/allocator/unified_sub_pool.py:52-55 (launched at :1242, :1299)", _unified_alloc_torch),
    Patch("sglang.srt.mem_cache.allocator.unified_sub_pool", "unified_allocator_streams",
          "srt/mem_cache/allocator/unified_sub_pool.py:1348, 1569, 1711, 1810, 1908, 2100-2104, 2158",
          _unified_allocator_streams),
    Patch("sglang.srt.layers.attention.attention_registry", "triton_attention_stand_in",
          "srt/layers/attention/attention_registry.py:206-214 (create_triton_backend)", _triton_attention_stand_in),
    Patch("sglang.srt.arg_groups.hicache_hook", "keep_direct_io_on_cpu",
          "srt/arg_groups/hicache_hook.py:228-244 (called at :86)", _keep_direct_io_on_cpu),
    Patch("sglang.srt.mem_cache.pool_host.base", "strided_direct_io",
          "srt/mem_cache/pool_host/base.py:342-349 (called at mha.py:527, :685)", _strided_direct_io),
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
