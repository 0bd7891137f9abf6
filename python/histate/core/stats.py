"""Counters a cache keeps about itself (hits, writes per tier, evictions by unit and outcome).

Plain integers, so golden tests can pin them exactly and the SGLang plugin can export them.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .types import ItemKind, MatchResult, Tier, UnitKind


_TIER_NAMES = {t: t.name for t in Tier}  # enum .name is a property lookup on the eviction path


@dataclass
class CacheStats:
    num_requests: int = 0
    num_input_pages: int = 0
    num_kv_hit_pages: int = 0  # sum of m
    num_reused_pages: int = 0  # sum of c
    num_terminal_hits: int = 0
    reused_pages_by_checkpoint_tier: Counter = field(default_factory=Counter)
    bytes_written_by_tier: dict = field(default_factory=dict)
    checkpoints_written_by_tier: Counter = field(default_factory=Counter)
    bytes_promoted: int = 0
    evictions: Counter = field(default_factory=Counter)  # (unit, tier, outcome) -> count
    num_insert_failures: int = 0
    num_checkpoint_failures: int = 0
    num_lost_reported: int = 0  # copies an executor found missing or corrupt (report_lost)

    def on_match(self, result: MatchResult, num_pages: int) -> None:
        self.num_requests += 1
        self.num_input_pages += num_pages
        self.num_kv_hit_pages += result.num_kv_pages
        self.num_reused_pages += result.num_reused_pages
        if result.num_reused_pages:
            self.reused_pages_by_checkpoint_tier[result.checkpoint_tier] += result.num_reused_pages
            self.num_terminal_hits += result.is_terminal_hit

    def on_write(self, kind: ItemKind, tier: Tier, size_bytes: int) -> None:
        self.bytes_written_by_tier[tier] = self.bytes_written_by_tier.get(tier, 0) + size_bytes
        if kind is ItemKind.CHECKPOINT:
            self.checkpoints_written_by_tier[tier] += 1

    def on_eviction(self, unit: UnitKind, tier: Tier, outcome: str) -> None:
        self.evictions[(unit.value, _TIER_NAMES[tier], outcome)] += 1

    @property
    def page_hit_rate(self) -> float:
        return self.num_reused_pages / self.num_input_pages if self.num_input_pages else 0.0
