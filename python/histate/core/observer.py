"""CacheObserver: what an executor may learn about the cache's decisions as they happen.

Diagnosis tools (`histate replay --explain`, histate.sim.explain) need to know *why* reuse was lost:
which unit was evicted, when, with which score terms, and whether a checkpoint ever existed at a
position. The cache calls an observer, when one is attached (`cache.observer`), at four points; with
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

    def on_fault(self, active: bool) -> None:
        """Between `on_fault(True)` and `on_fault(False)` every item gone was lost to a fault an
        executor reported (`report_lost`), not evicted by a policy decision."""


class ObserverGroup(CacheObserver):
    """Several observers on one cache (the cache holds one): each event goes to each, in order."""

    def __init__(self, *observers: CacheObserver):
        self.observers = tuple(o for o in observers if o is not None)

    def on_unit_evicted(self, node: Node, unit: UnitKind, tier: Tier, now_s: float, terms: tuple) -> None:
        for o in self.observers:
            o.on_unit_evicted(node, unit, tier, now_s, terms)

    def on_item_gone(self, node: Node, kind: ItemKind, now_s: float) -> None:
        for o in self.observers:
            o.on_item_gone(node, kind, now_s)

    def on_checkpoint_put(self, node: Node, tier: Tier, now_s: float) -> None:
        for o in self.observers:
            o.on_checkpoint_put(node, tier, now_s)

    def on_fault(self, active: bool) -> None:
        for o in self.observers:
            o.on_fault(active)
