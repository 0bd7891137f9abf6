"""Host (DRAM) tier sizing: KV first, a bounded staging area for states (paper §3.1).

Stock SGLang 0.5.23 mirrors the device split on the host: with `--hicache-size` the GB are
split across the KV and Mamba host pools in proportion to their device bytes
(`hybrid_pool_assembler._split_hicache_size`), otherwise each host pool is `--hicache-ratio` x
its own device pool. Either way roughly half of host DRAM holds recurrent states that a hit
reads one of. HiState keeps the same total host budget but gives it to KV, except for a small
state staging area (checkpoints pass through it on their way to SSD and back); historical
checkpoints live on the SSD tier.

Mechanism: on a SGLang with upstream/series 0011, SGLang's hybrid Mamba stack asks the cache
(`BasePrefixCache.host_pool_sizes`), and `HiStateRadixCache` answers with this module's split. On
stock 0.5.23, `HiStateMambaStackStrategy` is registered with `register_stack_strategy` (prepended)
and matches only while HiState's factory builds its cache (a context variable), so any other
cache in the process keeps SGLang's behaviour. It computes a `HostSplit` and delegates the
assembly to the strategy SGLang would have picked; two AROUND hooks on the host-pool builders
(`build_kv_host_pool`, `build_mamba_host_pool`) substitute the planned sizes while that split
is active. The sizing functions at the top are pure (the sizing report and tests use them).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

logger = logging.getLogger(__name__)

from histate.core import default_staging_slots  # one home: core.config (the simulator sizes the host the same way)

GB = 10**9  # SGLang's host sizes (--hicache-size, host_size) are decimal GB


@dataclass(frozen=True)
class HostSplit:
    """Host bytes given to KV and to states; `state_slots` states of `state_slot_bytes` each."""

    budget_bytes: int
    kv_bytes: int
    state_bytes: int
    state_slots: int
    state_slot_bytes: int

    def kv_tokens(self, kv_bytes_per_token: int) -> int:
        return self.kv_bytes // kv_bytes_per_token


def stock_host_split(budget_bytes: int, device_kv_bytes: int, device_state_bytes: int,
                     state_slot_bytes: int) -> HostSplit:
    """SGLang's `--hicache-size` rule: the budget split in proportion to device bytes."""
    state_bytes = budget_bytes * device_state_bytes // (device_kv_bytes + device_state_bytes)
    state_slots = state_bytes // state_slot_bytes
    return HostSplit(budget_bytes, budget_bytes - state_bytes, state_bytes, state_slots, state_slot_bytes)


def histate_host_split(budget_bytes: int, state_slot_bytes: int, staging_slots: int) -> HostSplit:
    """KV first: states get `staging_slots` slots, KV gets everything else."""
    if staging_slots <= 0:
        raise ValueError(f"staging_slots must be > 0, got {staging_slots}")
    state_bytes = staging_slots * state_slot_bytes
    if state_bytes >= budget_bytes:
        raise ValueError(
            f"--histate-host-state-slots: {staging_slots} state slots need {state_bytes / GB:.2f} GB, "
            f"more than the whole host budget ({budget_bytes / GB:.2f} GB); lower the slot count "
            f"or raise --hicache-size"
        )
    return HostSplit(budget_bytes, budget_bytes - state_bytes, state_bytes, staging_slots, state_slot_bytes)


# --- SGLang integration -------------------------------------------------------------------------

_building: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("histate_building", default=None)
_active_split: contextvars.ContextVar[Optional[HostSplit]] = contextvars.ContextVar(
    "histate_host_split", default=None)
_installed = False


@contextlib.contextmanager
def histate_build_scope(config: Any) -> Iterator[None]:
    """While active, HiState's stack strategy claims FULL+MAMBA host stacks (factory only)."""
    token = _building.set(config)
    try:
        yield
    finally:
        _building.reset(token)


def current_build_config() -> Optional[Any]:
    """The HiStateConfig of the cache being built by the factory (None outside the factory)."""
    return _building.get()


def _slot_bytes(tensor: Any) -> int:
    """Bytes of one checkpoint slot of a [layer, slot, ...] (or [slot, ...]) buffer."""
    if tensor.ndim >= 2:
        return int(tensor[:, 0].numel() * tensor.element_size())
    return int(tensor[0].numel() * tensor.element_size())


def mamba_slot_bytes(mamba_pool: Any) -> int:
    """Host bytes of one state slot, from the device buffers the host pool mirrors."""
    (info,) = mamba_pool.get_device_pool_infos()
    buffers = info.buffer_info
    total = _slot_bytes(buffers.temporal) + sum(_slot_bytes(c) for c in buffers.conv)
    total += sum(int(b[0].numel() * b.element_size()) for b in buffers.extra_checkpoint_buffers)
    return total


def _device_bytes(pool: Any) -> int:
    """Device bytes a host pool mirrors, as SGLang's own host sizing reads them (`_split_hicache_size`,
    hybrid_pool_assembler.py:240-250). On a hybrid KV pool the attention KV is its `full_kv_pool`, which is
    where SGLang's unified pool records `host_capacity_bytes` (unified_memory_pool.py:1773-1777) while its
    `get_kv_size_bytes()` reports 0 on purpose: read from the hybrid pool itself, the host budget left the
    KV out on the unified pool (found when a short host there held half the KV stock SGLang's did)."""
    size = getattr(pool, "host_capacity_bytes", None)
    if size is None and getattr(pool, "full_kv_pool", None) is not None:
        size = getattr(pool.full_kv_pool, "host_capacity_bytes", None)
    if size is None:
        size = pool.get_kv_size_bytes()
    return int(sum(size) if isinstance(size, tuple) else size)


def plan_for_stack(kvcache: Any, mamba_pool: Any, max_requests: int, config: Any) -> HostSplit:
    """The HiState split for this server: same total host budget as stock SGLang, KV first."""
    from sglang.srt.runtime_context import get_memory

    slot_bytes = mamba_slot_bytes(mamba_pool)
    memory = get_memory()
    if memory.hicache_size > 0:
        budget = int(memory.hicache_size * GB)
    else:  # ratio mode: what the two mirrored host pools would have taken together
        budget = int(memory.hicache_ratio * (_device_bytes(kvcache) + _device_bytes(mamba_pool)))
    slots = config.host_state_slots or default_staging_slots(max_requests)
    return histate_host_split(budget, slot_bytes, slots)


def host_pool_sizes(split: HostSplit) -> tuple:
    """(KV, Mamba) host GB for SGLang's host-pool builders. Half a state slot of slack: the Mamba host pool
    floors host_size * 1e9 / slot_bytes."""
    return split.kv_bytes / GB, (split.state_slots + 0.5) * split.state_slot_bytes / GB


def log_split(split: HostSplit) -> None:
    logger.info(
        "HiState host split: KV %.2f GB, states %.2f GB (%d staging slots of %.1f MiB) of %.2f GB",
        split.kv_bytes / GB, split.state_bytes / GB, split.state_slots, split.state_slot_bytes / 2**20,
        split.budget_bytes / GB)


def _kv_host_pool_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    split = _active_split.get()
    if split is not None and kwargs.get("pool_label", "kv") == "kv":
        kwargs["host_size"] = host_pool_sizes(split)[0]
    return original(*args, **kwargs)


def _mamba_host_pool_around(original: Any, *args: Any, **kwargs: Any) -> Any:
    split = _active_split.get()
    if split is not None:
        kwargs["host_size"] = host_pool_sizes(split)[1]
    return original(*args, **kwargs)


def _stack_strategy_class() -> type:
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    class HiStateMambaStackStrategy(assembler.StackStrategy):
        """FULL + MAMBA host stack with HiState's KV-first sizing (see module docstring)."""

        def _delegate(self, kvcache: Any, components: set) -> Any:
            # The strategy SGLang picks without us; `_STRATEGIES` is the registry that
            # `register_stack_strategy` prepends to.
            for strategy in assembler._STRATEGIES:
                if strategy is not self and strategy.matches(kvcache, components):
                    return strategy
            return None

        def matches(self, kvcache: Any, components: set) -> bool:
            from sglang.srt.mem_cache.unified_cache.components import ComponentType

            return (_building.get() is not None
                    and set(components) == {ComponentType.FULL, ComponentType.MAMBA}
                    and self._delegate(kvcache, components) is not None)

        def build(self, *, cache: Any, kvcache: Any, params: Any, **kwargs: Any) -> Any:
            config = _building.get()
            split = plan_for_stack(kvcache, params.req_to_token_pool.mamba_pool, params.req_to_token_pool.size,
                                   config)
            delegate = self._delegate(kvcache, set(cache.components))
            token = _active_split.set(split)
            try:
                result = delegate.build(cache=cache, kvcache=kvcache, params=params, **kwargs)
            finally:
                _active_split.reset(token)
            cache.histate_host_split = split
            log_split(split)
            return result

    return HiStateMambaStackStrategy


SIZED_BY_SGLANG = hasattr(BasePrefixCache, "host_pool_sizes")
"""upstream/series 0011 applied: SGLang's hybrid Mamba stack asks the cache for its host sizes
(`HiStateRadixCache.host_pool_sizes`); no stack strategy or builder hook is installed."""


def install_host_policy() -> None:
    """Register the stack strategy and the two sizing hooks (once per process; stock 0.5.23 only)."""
    global _installed
    if _installed or SIZED_BY_SGLANG:
        return
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import register_stack_strategy

    from .hooks import install_once

    module = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
    install_once("host_sizing", [(f"{module}.build_kv_host_pool", _kv_host_pool_around, "AROUND"),
                                 (f"{module}.build_mamba_host_pool", _mamba_host_pool_around, "AROUND")])
    register_stack_strategy(_stack_strategy_class()())
    _installed = True
