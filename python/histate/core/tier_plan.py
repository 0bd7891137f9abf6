"""The tiers a policy uses, in order (paper §3.1): pure lookups on the policy and the tiers present.

Both placement (where a copy goes) and eviction (where an evicted copy moves) read it, so it lives
apart from either.
"""
from __future__ import annotations

from typing import Iterable

from .ledger import Ledger
from .policies import Policy
from .types import ItemKind, Tier


class TierPlan:
    """The tiers a policy uses, in order: pure lookups on the policy and the tiers that exist (the
    ledger's, or, for an executor without a core ledger, the tiers it was given: the SGLang plugin)."""

    def __init__(self, policy: Policy, present: Iterable[Tier]):
        self.policy = policy
        self.present = frozenset(present)
        checkpoint_tiers = policy.checkpoint_tiers if policy.checkpoint_tiers is not None else policy.tiers
        self._lower = {
            kind: {t: [u for u in tiers if u > t and u in self.present] for t in Tier}
            for kind, tiers in ((ItemKind.KV, policy.tiers), (ItemKind.CHECKPOINT, checkpoint_tiers))}

    @classmethod
    def of_ledger(cls, policy: Policy, ledger: Ledger) -> "TierPlan":
        return cls(policy, [t for t in Tier if ledger.has_tier(t)])

    def lower_tiers(self, tier: Tier, kind: ItemKind = ItemKind.KV) -> list:
        """The tiers below `tier` that can hold `kind`, fastest first."""
        return self._lower[kind][tier]

    def write_through_tiers(self, kind: ItemKind) -> list:
        """The tiers a write-through policy copies a new `kind` item into (`Policy.kv_write_through_tiers`:
        HiState writes KV through to the host only; the SSD takes KV the host evicts)."""
        lower = self.lower_tiers(Tier.GPU, kind)
        if kind is ItemKind.CHECKPOINT and not self.policy.checkpoint_write_through:
            return []
        wanted = self.policy.kv_write_through_tiers
        return lower if kind is not ItemKind.KV or wanted is None else [t for t in lower if t in wanted]

    def demotion(self, kind: ItemKind) -> dict:
        """tier -> the tier a `kind` copy evicted from it moves to (None: it is dropped)."""
        return {t: (self._lower[kind][t][0] if self._lower[kind][t] else None) for t in self.policy.tiers}

    def historical_tier(self) -> Tier:
        """Where a non-terminal checkpoint lives: the policy's choice if that tier exists, else GPU."""
        wanted = self.policy.historical_tier
        if wanted is not None and wanted in self.present:
            return wanted
        return Tier.GPU
