"""Capacity ledgers: the single source of truth for bytes per pool.

HiState shares each tier's budget between KV and checkpoints (one pool per tier). The SGLang
baseline splits each tier statically (one pool per (tier, kind)). Both are `Ledger`s; the cache asks
`pool_of(tier, kind)` and never needs to know which one it has.

Per pool the ledger keeps three numbers, the same three SGLang's allocator and tree keep:
  used       bytes of cached copies (I2: the sum of the copies in the pool)
  protected  the part of `used` held by pinned nodes: eviction cannot free it (I10)
  reserved   bytes promised to running requests outside the cache (their new KV and working
             state while they compute; an engine model reserves them at admission)
so free = capacity - used - reserved (I1: never negative) and what eviction can still free is
used - protected. Maintains I1, I2 and I10 together with items.ItemBook, its only writer.
"""
from __future__ import annotations

from typing import Hashable, Mapping

from .config import DEFAULT_STATE_FRACTION
from .types import ItemKind, Tier


class Ledger:
    """One pool per tier, shared by KV and checkpoints."""

    def __init__(self, capacity_bytes: Mapping[Tier, int]):
        self._init_pools({Tier(t): int(b) for t, b in capacity_bytes.items()})
        self._tiers = set(self.capacity_bytes)

    def _init_pools(self, capacity_bytes: dict) -> None:
        self.capacity_bytes: dict = capacity_bytes
        self.used_bytes: dict = {pool: 0 for pool in capacity_bytes}
        self.protected_bytes: dict = {pool: 0 for pool in capacity_bytes}
        self.reserved_bytes: dict = {pool: 0 for pool in capacity_bytes}

    def pool_of(self, tier: Tier, kind: ItemKind) -> Hashable:
        return tier

    def pools_of_tier(self, tier: Tier) -> list:
        return [tier]

    def has_tier(self, tier: Tier) -> bool:
        return tier in self._tiers

    def free_bytes(self, pool: Hashable) -> int:
        """Room for cached copies."""
        return self.capacity_bytes[pool] - self.used_bytes[pool] - self.reserved_bytes[pool]

    def evictable_bytes(self, pool: Hashable) -> int:
        return self.used_bytes[pool] - self.protected_bytes[pool]

    def working_free_bytes(self, pool: Hashable) -> int:
        """Room a running request can be promised without evicting (admission reads this)."""
        return self.free_bytes(pool)

    def working_evictable_bytes(self, pool: Hashable) -> int:
        """What eviction could add to `working_free_bytes`."""
        return self.evictable_bytes(pool)

    def fits_ever(self, pool: Hashable, size_bytes: int) -> bool:
        return size_bytes <= self.capacity_bytes[pool] - self.reserved_bytes[pool]

    def add(self, pool: Hashable, size_bytes: int) -> None:
        self.used_bytes[pool] += size_bytes

    def sub(self, pool: Hashable, size_bytes: int) -> None:
        self.used_bytes[pool] -= size_bytes

    def protect(self, pool: Hashable, size_bytes: int) -> None:
        """Move `size_bytes` (negative: back) between evictable and protected within `used`."""
        self.protected_bytes[pool] += size_bytes

    def reserve(self, pool: Hashable, size_bytes: int) -> None:
        self.reserved_bytes[pool] += size_bytes


class PartitionedLedger(Ledger):
    """Static split: `state_fraction[tier]` of each tier for checkpoints, the rest for KV.

    This is SGLang 0.5.23's device split (`--mamba-full-memory-ratio`) mirrored onto the host pools
    (`--hicache-ratio`); see docs/policies.md. A tier in `shared_tiers` keeps one pool for both kinds
    (SGLang's L3 `HiCacheFile` is one store with one LRU over KV pages and mamba objects alike,
    mem_cache/storage/file/lru_file_evictor.py:1-25).
    """

    def __init__(self, capacity_bytes: Mapping[Tier, int], state_fraction: Mapping[Tier, float],
                 shared_tiers: tuple = ()):
        pools = {}
        self._shared = {Tier(t) for t in shared_tiers}
        for tier, size in capacity_bytes.items():
            tier = Tier(tier)
            if tier in self._shared:
                pools[(tier, None)] = int(size)
                continue
            frac = state_fraction.get(tier, DEFAULT_STATE_FRACTION)
            state = int(size * frac)
            pools[(tier, ItemKind.CHECKPOINT)] = state
            pools[(tier, ItemKind.KV)] = int(size) - state
        self._init_pools(pools)
        self._tiers = {Tier(t) for t in capacity_bytes}

    def pool_of(self, tier: Tier, kind: ItemKind) -> Hashable:
        return (tier, None) if tier in self._shared else (tier, kind)

    def pools_of_tier(self, tier: Tier) -> list:
        if tier in self._shared:
            return [(tier, None)]
        return [(tier, ItemKind.KV), (tier, ItemKind.CHECKPOINT)]


class UnboundedLedger(Ledger):
    """The `unlimited` ceiling: cached copies take no room (nothing is ever evicted), but running
    requests still live in the tier's physical capacity: what they pin (their matched context, the
    protected bytes) plus what they reserve must fit in `working_bytes`, as for every other policy. So
    the ceiling gets every hit and never waits for the cache, yet waits at admission whenever the
    running work alone does not fit (a TTFT ceiling under the same engine, not only a hit-rate one)."""

    def __init__(self, capacity_bytes: Mapping[Tier, int], working_bytes: Mapping[Tier, int]):
        super().__init__(capacity_bytes)
        self.working_bytes = {Tier(t): int(b) for t, b in working_bytes.items()}

    def working_free_bytes(self, pool: Hashable) -> int:
        working = self.working_bytes.get(pool)
        if working is None:
            return super().working_free_bytes(pool)
        return working - self.protected_bytes[pool] - self.reserved_bytes[pool]

    def working_evictable_bytes(self, pool: Hashable) -> int:
        return 0  # unpinned cache occupies no working memory
