"""Builders for SGLang's real FULL + MAMBA pools and unified radix caches on device="cpu".

Follows SGLang's public constructors (research/sglang-0.5.23.md §5.2): a published ServerArgs
(MambaComponent reads the checkpoint grid through the runtime context), HybridReqToTokenPool
(with its MambaPool), HybridLinearKVPool, a paged token allocator, CacheInitParams, the cache.
Also a small request driver (`Driver`) that does what SGLang's scheduler does to the cache for
one request: match, lock, insert at each checkpoint position, re-adopt the tree's indices,
unlock, evicting on allocation failure the way SGLang's allocators do.
"""
from __future__ import annotations

import types
from array import array
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

PAGE = 16  # tokens per page; the checkpoint grid is lcm(page, chunk) = 16 in these tests
FULL_LAYERS = (1, 3)
MAMBA_LAYERS = [0, 2]


def publish_server_args(page_size: int = PAGE, chunk_tokens: int = PAGE, **fields: Any) -> Any:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    server_args = ServerArgs(model_path="dummy", page_size=page_size, **fields)
    server_args._mamba_cache_chunk_size = chunk_tokens  # a dummy model has no HF config to read it from
    set_global_server_args_for_scheduler(server_args)
    return server_args


@dataclass
class Pools:
    req_to_token_pool: Any
    kvcache: Any
    allocator: Any
    page_size: int

    @property
    def mamba_allocator(self) -> Any:
        return self.req_to_token_pool.mamba_allocator

    @property
    def mamba_pool(self) -> Any:
        return self.req_to_token_pool.mamba_pool


TINY_STATE = dict(intermediate_size=16, num_heads=2, head_dim=8, state_size=4)
# A state of ~1,540 KV-token equivalents, like Qwen3.5-9B (49 MiB state vs 32 KiB/token of KV).
QWEN35_LIKE_STATE = dict(intermediate_size=256, num_heads=4, head_dim=64, state_size=48)


def _mamba_cache_params(state_shape: Optional[dict]) -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.environ import envs

    with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
        shape = Mamba2StateShape.create(tp_world_size=1, n_groups=1, conv_kernel=4,
                                        **(state_shape or TINY_STATE))
        return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)


def build_pools(kv_tokens: int, mamba_slots: int, page_size: int = PAGE, max_reqs: int = 8,
                max_context: int = 8192, state_shape: Optional[dict] = None) -> Pools:
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    cache_params = _mamba_cache_params(state_shape)
    req_to_token_pool = HybridReqToTokenPool(
        size=max_reqs, mamba_size=mamba_slots, mamba_spec_state_size=max_reqs, max_context_len=max_context,
        device="cpu", enable_memory_saver=False, cache_params=cache_params, mamba_layer_ids=MAMBA_LAYERS,
        enable_mamba_extra_buffer=page_size > 1)
    kvcache = HybridLinearKVPool(
        size=kv_tokens, dtype=torch.bfloat16, page_size=page_size, head_num=1, head_dim=4,
        full_attention_layer_ids=list(FULL_LAYERS), device="cpu", enable_memory_saver=False,
        mamba_pool=req_to_token_pool.mamba_pool)
    allocator = PagedTokenToKVPoolAllocator(size=kv_tokens, page_size=page_size, dtype=torch.bfloat16,
                                            device="cpu", kvcache=kvcache, need_sort=False)
    return Pools(req_to_token_pool, kvcache, allocator, page_size)


def build_unified_pools(kv_tokens: int, mamba_slots: int, max_reqs: int = 8, max_context: int = 4096,
                        state_shape: Optional[dict] = None) -> Pools:
    """SGLang's unified device pool (`--enable-unified-memory`, HiState's default): KV and states
    in one byte buffer, built by `init_unified_mamba_pools` (unified_memory_pool.py:1593) with
    the sizes the KV-cache configurator would pass. Page size 1 (no extra buffer); the KV rows
    are 16 bytes (head_dim 8, bf16), the pool's alignment requirement."""
    from sglang.srt.mem_cache.unified_memory_pool import init_unified_mamba_pools

    bundle = init_unified_mamba_pools(
        device="cpu", kv_cache_dtype=torch.bfloat16, head_num=1, head_dim=8, page_size=1, start_layer=0,
        end_layer=len(MAMBA_LAYERS) + len(FULL_LAYERS), is_draft_worker=False, use_mla_backend=False,
        mamba_layer_ids=MAMBA_LAYERS, full_attention_layer_ids=list(FULL_LAYERS),
        mamba2_cache_params=_mamba_cache_params(state_shape), model_context_len=max_context, extra_max_context_len=0, max_total_num_tokens=kv_tokens,
        max_mamba_cache_size=mamba_slots, max_num_reqs=max_reqs, enable_memory_saver=False,
        enable_mamba_extra_buffer=False, enable_mamba_extra_buffer_lazy=False, speculative_num_draft_tokens=None,
        disable_overlap_schedule=True, need_sort=False)
    return Pools(bundle.req_to_token_pool, bundle.token_to_kv_pool, bundle.token_to_kv_pool_allocator, 1)


def cache_params(pools: Pools, tree_core: str = "python", enable_metrics: bool = False, **fields: Any) -> Any:
    """`CacheInitParams` for `pools`; `fields`: further CacheInitParams fields (e.g.
    enable_session_radix_cache=True, as `kv_cache_builder` sets it from the flag)."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    return CacheInitParams(
        disable=False, req_to_token_pool=pools.req_to_token_pool, token_to_kv_pool_allocator=pools.allocator,
        page_size=pools.page_size, tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        enable_mamba_extra_buffer=pools.page_size > 1, tree_core_backend=tree_core, enable_metrics=enable_metrics,
        **fields)


def build_cache(kind: str, pools: Pools, *, params_fields: Optional[dict] = None, **histate_kwargs: Any) -> Any:
    """kind: 'histate' (HiStateRadixCache) or 'stock' (SGLang's UnifiedRadixCache, Python core);
    `params_fields`: further CacheInitParams fields."""
    params = cache_params(pools, **(params_fields or {}))
    if kind == "stock":
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        return UnifiedRadixCache(params)
    from histate.sglang_plugin.tree_cache import HiStateRadixCache

    return HiStateRadixCache(params, **histate_kwargs)


def key(tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(array("q", tokens))


class ManualClock:
    """A logical clock in seconds: tests set `now` before each operation."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class RequestOutcome:
    reused_tokens: int
    kv_hit_tokens: int
    checkpoints: list = field(default_factory=list)


class Driver:
    """One request at a time through a cache, as SGLang's scheduler drives it (see module doc)."""

    def __init__(self, cache: Any, pools: Pools):
        self.cache = cache
        self.pools = pools
        self.num_requests = 0

    def match(self, tokens: list[int], req: Any = None) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=key(tokens), req=req))

    def _alloc_kv(self, num_tokens: int) -> torch.Tensor:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        if num_tokens == 0:
            return torch.empty((0,), dtype=torch.int64)
        indices = self.pools.allocator.alloc(num_tokens)
        if indices is None:
            shortfall = num_tokens - self.pools.allocator.available_size()
            self.cache.evict_for_alloc(EvictParams(num_tokens=shortfall))
            indices = self.pools.allocator.alloc(num_tokens)
        assert indices is not None, f"cannot allocate {num_tokens} KV tokens"
        return indices.to(torch.int64)

    def _alloc_state(self) -> torch.Tensor:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        slot = self.pools.mamba_allocator.alloc(1)
        if slot is None:
            self.cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            slot = self.pools.mamba_allocator.alloc(1)
        assert slot is not None, "cannot allocate a state slot"
        return slot.view(-1)

    def step(self) -> None:
        """What the scheduler does between two forward passes (nothing without HiCache)."""

    def serve(self, tokens: list[int], checkpoints: Optional[list[int]] = None,
              plan: Optional[Callable[[int, int, int], list[int]]] = None,
              state_fill: Optional[Callable[[int], float]] = None) -> RequestOutcome:
        """Match `tokens`, then insert a checkpoint at every position of `checkpoints` (token
        counts, page-aligned) or of `plan(reused, len, kv_match)`; the last page-aligned position is the
        terminal state. `state_fill(position)` writes a recognisable value into each state. One insert
        per forward pass, as SGLang's scheduler does (`step` runs between them)."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        self.num_requests += 1
        req = types.SimpleNamespace(rid=f"r{self.num_requests}", session=None)
        result = self.match(tokens, req=req)
        reused = result.device_prefix_len + result.host_hit_length
        lock = self.cache.lock(result.last_device_node)
        positions = checkpoints if checkpoints is not None else plan(reused, len(tokens),
                                                                     result.full_kv_hit_length)
        owned = self.cache.tree_core.collect_full_device_indices(
            result.last_device_node, self.cache.root_node_handle()) if result.device_prefix_len else \
            torch.empty((0,), dtype=torch.int64)
        owned = owned[:result.device_prefix_len]
        done = []
        for pos in sorted(p for p in set(positions) if reused < p <= len(tokens)):
            fresh = self._alloc_kv(pos - len(owned))
            value = torch.cat([owned.to(torch.int64), fresh])
            slot = self._alloc_state()
            if state_fill is not None:
                self.pools.mamba_pool.mamba_cache.temporal[:, slot] = state_fill(pos)
            res = self.cache.insert(InsertParams(key=key(tokens[:pos]), value=value, mamba_value=slot,
                                                 prev_prefix_len=len(owned)))
            if res.mamba_exist:
                self.pools.mamba_allocator.free(slot)
            again = self.match(tokens[:pos])
            assert again.device_prefix_len == pos, (again.device_prefix_len, pos)
            self.cache.unlock(lock)
            lock = self.cache.lock(again.last_device_node)
            owned = self.cache.tree_core.collect_full_device_indices(
                again.last_device_node, self.cache.root_node_handle())
            done.append(pos)
            self.step()
        self.cache.unlock(lock)
        return RequestOutcome(reused, result.full_kv_hit_length, done)
