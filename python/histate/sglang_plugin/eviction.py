"""Unified eviction (paper §3.3) on SGLang's tree: one ranking for checkpoints and bundles.

Stock SGLang walks a KV leaf heap for token requests and a separate state LRU for state
requests. HiState ranks both kinds of eviction unit with the core's score
H = t_last + tau * C / M (`histate.core` Policy.score over a `NodeView`):
  BUNDLE      a device leaf (`tree_core.evictable_device_leaves`): its KV segment and, when it
              holds one, its terminal checkpoint; SGLang evicts it atomically (demote or delete);
  CHECKPOINT  a device state on an interior node: tombstoned alone, its KV stays.
Token requests (FULL walk) pick among bundles; state requests (MAMBA walk) pick the lowest of
the bundles that hold a state and the interior checkpoints.

Heaps use the same lazy scheme as `histate.core.cache`: a node that changes is "touched" (its
version bumps and it is re-offered with a lower bound of its score, its last access time); an
entry reaching the top is re-scored and pushed back if its true score is higher. Touches come
from the tree core (every evictable-leaf-set update: insert, split, lock release, eviction) and
from new checkpoints (whose neighbours' costs drop). No walk scans the tree.

A node met while a lock keeps it from being a unit (its entry at the top of a heap, or its touch
flushed) is set aside and re-offered at the first walk after it forms a unit again. Lock
release does not always reach us as a change: SGLang lowers
`lock_ref` before it calls `_update_evictable_leaf_sets` (components/mamba.py:523-525,
components/full.py:373-375), so an interior checkpoint looks evictable both before and after
that call, and a scheduler admission pops it while it is locked (copy-on-write of the matched
state: lock, evict_for_alloc, unlock; components/mamba.py:215-221).
"""
from __future__ import annotations

import heapq
from itertools import count
from typing import Any, Callable, Optional

from histate.core import PolicyState, UnitKind

from .node_view import GPU_BIT, MAMBA, NodeView, ScoringContext, has_device_state

_COMPACT_FACTOR = 4


def _version(node: Any) -> int:
    return getattr(node, "_hs_version", 0)


def _locked(node: Any) -> bool:
    return any(data.lock_ref > 0 for data in node.component_data)


class UnifiedEvictionRanker:
    """Candidate heaps over one SGLang tree; owned by `HiStateRadixCache`."""

    def __init__(self, policy: Any, make_context: Callable[[], ScoringContext]):
        self.policy = policy
        self.make_context = make_context
        self.tree_core: Any = None
        self._seq = count()
        self.reset()

    def reset(self) -> None:
        self.bundles: list = []
        self.checkpoints: list = []
        self._dirty: dict[int, Any] = {}
        self._locked: dict[int, Any] = {}  # met while locked: re-offered once they form a unit
        self._ctx: Optional[ScoringContext] = None

    # --- change notifications -------------------------------------------------------------------

    def touch(self, node: Any) -> None:
        """`node`'s units or costs may have changed: re-offer it at the next walk step."""
        node._hs_version = _version(node) + 1
        self._dirty[id(node)] = node

    def touch_checkpoint_neighbourhood(self, node: Any) -> None:
        """A checkpoint appeared at `node`: the interior checkpoint above it (shorter span) and
        the units below it (shorter gap) now cost less to lose."""
        self.touch(node)
        parent = node.parent
        while parent is not None and parent.parent is not None:
            self.touch(parent)
            if parent.component_data[MAMBA].value is not None or parent.component_data[MAMBA].host_value is not None:
                break
            parent = parent.parent
        for child in node.children.values():
            self.touch(child)

    # --- classification and scoring -------------------------------------------------------------

    def unit_of(self, node: Any) -> Optional[UnitKind]:
        """The device eviction unit `node` forms now, or None (locked, dead, root, no device data)."""
        tree_core = self.tree_core
        if getattr(node, "_hs_dead", False) or node is tree_core.root_node:
            return None
        if node in tree_core.evictable_device_leaves:
            return UnitKind.BUNDLE
        data = node.component_data[MAMBA]
        if data.value is not None and data.lock_ref == 0:
            return UnitKind.CHECKPOINT
        return None

    def _context(self) -> ScoringContext:
        if self._ctx is None:
            self._ctx = self.make_context()
        return self._ctx

    def score(self, node: Any, unit: UnitKind) -> float:
        ctx = self._context()
        return self.policy.score(ctx, NodeView(node, ctx), unit, GPU_BIT)

    def _push(self, node: Any, unit: UnitKind, score: Optional[float] = None) -> None:
        if score is None:  # a lower bound of every policy's score (core Policy.score contract)
            score = PolicyState.bound(NodeView(node, self._context()), unit, GPU_BIT)
        heap = self.bundles if unit is UnitKind.BUNDLE else self.checkpoints
        heapq.heappush(heap, (score, next(self._seq), node, unit, _version(node)))

    def flush(self) -> None:
        """Offer every touched node under its current unit."""
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, {}
        for node in dirty.values():
            self._offer(node)
        for heap in (self.bundles, self.checkpoints):
            if len(heap) > _COMPACT_FACTOR * (len(self.tree_core._node_arena) + 1024):
                heap[:] = [e for e in heap if not getattr(e[2], "_hs_dead", False) and _version(e[2]) == e[4]]
                heapq.heapify(heap)

    def _offer(self, node: Any) -> None:
        """Push `node` under the unit it forms now; set it aside if only a lock stops it forming
        one. A node with no device unit and no lock is dropped: a touch re-offers it when device
        data comes back (insert, split, load-back)."""
        unit = self.unit_of(node)
        if unit is not None:
            self._push(node, unit)
        elif _locked(node):
            self._locked[id(node)] = node

    def _reoffer_unlocked(self) -> None:
        """Offer again the nodes set aside while locked that form a unit now (walk start only:
        nothing unlocks during a walk, which runs inside one `evict` call). A node stays set
        aside while a lock still keeps it from being a unit."""
        for key, node in list(self._locked.items()):
            if getattr(node, "_hs_dead", False):
                del self._locked[key]
            elif self.unit_of(node) is not None or not _locked(node):
                del self._locked[key]
                self._offer(node)

    def _top(self, heap: list, unit: UnitKind, need_state: bool, parked: list) -> Optional[tuple]:
        """The lowest valid entry of `heap` (left on the heap), re-ranking stale scores."""
        while heap:
            score, _, node, entry_unit, version = heap[0]
            if getattr(node, "_hs_dead", False) or version != _version(node):
                heapq.heappop(heap)
                continue
            if self.unit_of(node) is not unit:  # reclassified without a notification, or locked
                heapq.heappop(heap)
                self._dirty[id(node)] = node  # offered (or set aside) by the next flush
                continue
            if need_state and not has_device_state(node):
                parked.append(heapq.heappop(heap))  # frees no state slot; valid for token walks
                continue
            current = self.score(node, unit)
            if current > score + 1e-9:
                heapq.heapreplace(heap, (current, next(self._seq), node, unit, version))
                continue
            return heap[0]
        return None

    def check_offered(self) -> None:
        """Invariant H4: after a flush, every current device unit has a live heap entry."""
        self._reoffer_unlocked()
        self.flush()
        live = {(id(e[2]), e[3]) for heap in (self.bundles, self.checkpoints) for e in heap
                if not getattr(e[2], "_hs_dead", False) and e[4] == _version(e[2])}
        for node in self.tree_core._node_arena.values():
            unit = self.unit_of(node)
            if unit is not None and (id(node), unit) not in live:
                raise AssertionError(f"H4: node {node.id} forms a {unit.value} unit but is not offered")

    # --- walks -----------------------------------------------------------------------------------

    def begin_walk(self) -> None:
        self._ctx = None  # snapshot the terminal-hit probability for this walk
        self._reoffer_unlocked()
        self.flush()

    def next_victim(self, want_state: bool) -> Optional[tuple[Any, UnitKind]]:
        """Pop the lowest-scored unit that frees KV (`want_state=False`) or a state slot."""
        while True:
            self.flush()
            parked: list = []
            try:
                best_bundle = self._top(self.bundles, UnitKind.BUNDLE, want_state, parked)
                best_ckpt = self._top(self.checkpoints, UnitKind.CHECKPOINT, False, parked) if want_state else None
                if self._dirty:  # a top was reclassified: offer it under its unit and look again
                    continue
                candidates = [e for e in (best_bundle, best_ckpt) if e is not None]
                if not candidates:
                    return None
                entry = min(candidates)
                # Both tops are still at heap[0]; pop the winner before the parked entries return.
                heapq.heappop(self.bundles if entry[3] is UnitKind.BUNDLE else self.checkpoints)
                return entry[2], entry[3]
            finally:
                for parked_entry in parked:
                    heapq.heappush(self.bundles, parked_entry)
