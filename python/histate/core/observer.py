"""CacheObserver: what an executor may learn about the cache's decisions as they happen.

Diagnosis tools (`histate replay --explain`, histate.sim.explain) need to know *why* reuse was lost:
which unit was evicted, when, with which score terms, and whether a checkpoint ever existed at a
position. The cache calls an observer, when one is attached (`cache.observer`), at three points; with
none attached the cost is one attribute test per event. Observers must not mutate the cache.
"""
from __future__ import annotations

from .tree import Node
from .types import ItemKind, Tier, UnitKind


class CacheObserver:
    """No-op base: subclass and override what you need."""

    def on_unit_evicted(self, node: Node, unit: UnitKind, tier: Tier, now_s: float, terms: tuple) -> None:
        """The evictor chose `unit` of `node` in `tier`; `terms` = (t_last_s, C_tokens, M_tokens, score)
        as eq. 7 defines them (C and M with HiState's definitions whatever the policy). Called before
        the unit leaves, so `node` still shows it."""

    def on_item_gone(self, node: Node, kind: ItemKind, now_s: float) -> None:
        """The last copy of `node`'s KV segment or checkpoint left the cache (eviction or a fault)."""

    def on_checkpoint_put(self, node: Node, tier: Tier, now_s: float) -> None:
        """A new checkpoint (not a copy of one) appeared at the end of `node`."""
