"""Victim selection: a lazy min-heap of eviction units per pool, shared by every executor.

Why lazy: eq. 7 scores depend on the tree around a unit (the gap to the previous checkpoint, the span
below it) and on access times that change on every hit. Re-scoring every affected unit on every change
would cost a walk per hit. Instead a unit is pushed with a *lower bound* of its score (its last access
time: every policy's score is t_last + a non-negative term, `Policy.score` contract) and is scored only
when it reaches the top; an entry whose true score is higher goes back at its true rank. A change that
can *lower* a score (a new checkpoint nearby, a new unit, a structural change) must re-offer the node
(`reoffer`), which invalidates its old entries by bumping `node.version`.

Node protocol (the core's `tree.Node`, or an executor's adapter such as the SGLang plugin's):
  version: int       bumped by `reoffer`; entries carrying an older version are stale
  is_alive: bool     False once the node left its tree (its entries are stale)
  is_parked: bool    set when the top entry could not be evicted (pinned); the executor re-offers
                     the node when the pin goes (I7: nothing escapes eviction for good)
"""
from __future__ import annotations

import heapq
from itertools import count
from typing import Callable, Iterable, Optional

from .types import UnitKind

Rank = Callable[[object, UnitKind, int], Optional[float]]
"""rank(node, unit, tier_index) -> current score, or None when the unit cannot be evicted now."""

Accept = Callable[[object, UnitKind, int], bool]
"""accept(node, unit, tier_index) -> whether this walk can use the unit (others stay on the heap)."""

Bound = Callable[[object, UnitKind, int], float]
"""bound(node, unit, tier bit) -> a lower bound of the unit's score (cheap: no tree walk)."""

_EPS = 1e-9
_SEQ = count()  # tie-breaker shared by every heap: entries never compare nodes


class DeferredReoffers:
    """Re-offers that wait for the end of an eviction pass (walk): the checkpoints above a removed leaf
    lose part of their C, and one pass that removes several leaves re-ranks each of them once, with the
    tree as the pass left it. Shared by the core's `Evictor` and the SGLang plugin's `TierVictims`."""

    __slots__ = ("_nodes", "depth")

    def __init__(self) -> None:
        self._nodes: dict = {}  # id -> node
        self.depth = 0  # passes nest (a demotion makes room below): flush at the outermost

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: int) -> bool:
        return node_id in self._nodes

    def offer(self, node, touch: Callable[[object], None]) -> None:
        """Re-offer `node` now, or at the end of the pass running."""
        if self.depth:
            self._nodes[id(node)] = node
        else:
            touch(node)

    def flush(self, touch: Callable[[object], None]) -> bool:
        """Re-offer the deferred nodes still in the tree; True if there were any."""
        if not self._nodes:
            return False
        nodes, self._nodes = self._nodes, {}
        for node in nodes.values():
            if node.is_alive:
                touch(node)
        return True

    def clear(self) -> None:
        self._nodes.clear()


class VictimHeap:
    """The candidates of one pool (a tier, or a (tier, kind) pair under a static split)."""

    __slots__ = ("entries", "changes", "bound_of")

    def __init__(self, bound_of: Optional[Bound] = None) -> None:
        self.entries: list = []  # (score lower bound, seq, node, unit, tier index, node version)
        self.changes = 0  # pushes, pops and compactions so far: equal counts, the same heap
        # The lower bound `reoffer` pushes with (required there). A unit used since it was pushed has a
        # higher one; it goes back at that bound without being scored (a score may walk the tree), so
        # only units whose bound is current are scored. Without it (entries pushed by hand) every stale
        # bound is replaced by the full score.
        self.bound_of = bound_of

    def __len__(self) -> int:
        return len(self.entries)

    def push(self, node, unit: UnitKind, tier_index: int, bound: float) -> None:
        self.changes += 1
        heapq.heappush(self.entries, (bound, next(_SEQ), node, unit, tier_index, node.version))

    def pop_lowest(self, rank: Rank, accept: Optional[Accept] = None) -> Optional[tuple]:
        """Remove and return (node, unit, tier index, score) of the lowest-ranked evictable unit.

        Stale entries are dropped; entries `rank` refuses (pinned) are dropped and their node parked;
        entries `accept` refuses are set aside and put back, so another walk can still take them.
        """
        entry = self._pop_entry(rank, accept)
        return None if entry is None else (entry[2], entry[3], entry[4], entry[0])

    def _pop_entry(self, rank: Rank, accept: Optional[Accept]) -> Optional[tuple]:
        """`pop_lowest`'s work; returns the chosen heap entry itself (score, seq, node, unit, tier
        index, version), which `peek_lowest` puts back exactly where it was."""
        self.changes += 1
        entries, bound_of = self.entries, self.bound_of
        skipped = []
        chosen = None
        rescored_seq = -1  # the entry just put back at its true score: still on top means it is the minimum
        while entries:
            bound, seq, node, unit, t, version = entries[0]
            if not node.is_alive or node.version != version:
                heapq.heappop(entries)
                continue
            if seq == rescored_seq:
                chosen = heapq.heappop(entries)
                break
            if accept is not None and not accept(node, unit, t):
                skipped.append(heapq.heappop(entries))
                continue
            if bound_of is not None:
                fresh = bound_of(node, unit, 1 << t)
                if fresh > bound + _EPS:  # used since pushed: back at its new bound, unscored
                    heapq.heapreplace(entries, (fresh, next(_SEQ), node, unit, t, version))
                    continue
            score = rank(node, unit, t)
            if score is None:
                heapq.heappop(entries)
                node.is_parked = True
                continue
            if score > bound + _EPS:  # refreshed since pushed: back at its true rank
                rescored_seq = next(_SEQ)
                heapq.heapreplace(entries, (score, rescored_seq, node, unit, t, version))
                continue
            heapq.heappop(entries)
            chosen = (score, seq, node, unit, t, version)
            break
        for entry in skipped:
            heapq.heappush(entries, entry)
        return chosen

    def peek_lowest(self, rank: Rank, accept: Optional[Accept], enough: Callable[[object, UnitKind], bool]) -> list:
        """(node, unit) of the lowest-ranked units in rank order, up to the first one `enough` accepts;
        all stay on the heap, at their current score and in their place among equal scores (a look
        ahead of the next evictions must not change them: put back behind its ties, a unit a look ahead
        saw every step was never evicted while newer equal-scored units were)."""
        seen = []
        while True:
            entry = self._pop_entry(rank, accept)
            if entry is None:
                break
            seen.append(entry)
            if enough(entry[2], entry[3]):
                break
        for entry in seen:
            heapq.heappush(self.entries, entry)
        return [(entry[2], entry[3]) for entry in seen]

    def live_units(self) -> set:
        """(id(node), unit, tier index) of every entry that is not stale (for invariant checks)."""
        return {(id(e[2]), e[3], e[4]) for e in self.entries if e[2].is_alive and e[2].version == e[5]}

    def compact(self) -> None:
        """Drop stale entries in place (callers alias the list); live ones keep their place and score."""
        self.changes += 1
        self.entries[:] = [e for e in self.entries if e[2].is_alive and e[2].version == e[5]]
        heapq.heapify(self.entries)


def reoffer(node, units: Iterable[tuple], heap_for: Callable[[UnitKind, int], VictimHeap]) -> None:
    """Invalidate `node`'s entries and push its current units with a lower bound of their score: their
    heap's own `bound_of`, the function a pop compares the key with to see the unit was used since."""
    node.version += 1
    node.is_parked = False
    if not node.is_alive:
        return
    for unit, t in units:
        heap = heap_for(unit, t)
        heap.push(node, unit, t, heap.bound_of(node, unit, 1 << t))
