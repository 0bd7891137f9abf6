"""Capacity ledgers: the single source of truth for bytes used per tier.

HiState shares each tier's budget between KV and checkpoints (one pool per tier). The SGLang
baseline splits each tier statically (one pool per (tier, kind)). Both are `Ledger`s; the cache asks
`pool_of(tier, kind)` and never needs to know which one it has. Maintains invariants I1 and I2.
"""
from __future__ import annotations

from typing import Hashable, Mapping

from .types import ItemKind, Tier


class Ledger:
    """One pool per tier, shared by KV and checkpoints."""

    def __init__(self, capacity_bytes: Mapping[Tier, int]):
        self.capacity_bytes: dict = {Tier(t): int(b) for t, b in capacity_bytes.items()}
        self.used_bytes: dict = {pool: 0 for pool in self.capacity_bytes}

    def pool_of(self, tier: Tier, kind: ItemKind) -> Hashable:
        return tier

    def pools_of_tier(self, tier: Tier) -> list:
        return [tier]

    def has_tier(self, tier: Tier) -> bool:
        return tier in self.capacity_bytes

    def free_bytes(self, pool: Hashable) -> int:
        return self.capacity_bytes[pool] - self.used_bytes[pool]

    def fits_ever(self, pool: Hashable, size_bytes: int) -> bool:
        return size_bytes <= self.capacity_bytes[pool]

    def add(self, pool: Hashable, size_bytes: int) -> None:
        self.used_bytes[pool] += size_bytes

    def sub(self, pool: Hashable, size_bytes: int) -> None:
        self.used_bytes[pool] -= size_bytes


class PartitionedLedger(Ledger):
    """Static split: `state_fraction[tier]` of each tier for checkpoints, the rest for KV.

    This is SGLang 0.5.23's device split (`--mamba-full-memory-ratio`) mirrored onto the host pools
    (`--hicache-ratio`); see docs/policies.md.
    """

    def __init__(self, capacity_bytes: Mapping[Tier, int], state_fraction: Mapping[Tier, float]):
        pools = {}
        for tier, size in capacity_bytes.items():
            frac = state_fraction.get(tier, 0.5)
            state = int(size * frac)
            pools[(Tier(tier), ItemKind.CHECKPOINT)] = state
            pools[(Tier(tier), ItemKind.KV)] = int(size) - state
        self.capacity_bytes = pools
        self.used_bytes = {pool: 0 for pool in pools}
        self._tiers = {Tier(t) for t in capacity_bytes}

    def pool_of(self, tier: Tier, kind: ItemKind) -> Hashable:
        return (tier, kind)

    def pools_of_tier(self, tier: Tier) -> list:
        return [(tier, ItemKind.KV), (tier, ItemKind.CHECKPOINT)]

    def has_tier(self, tier: Tier) -> bool:
        return tier in self._tiers
