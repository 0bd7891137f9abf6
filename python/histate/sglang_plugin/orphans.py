"""SSD objects no tree node knows any more, ranked for deletion.

SGLang deletes a node when it leaves the host (its host eviction removes the leaf; a flush removes
every node; a restart starts with an empty tree). Its objects on HiState's SSD stay readable by
SGLang's own L3 prefetch (by page hash), so they are still cache; but no node carries them, so the
SSD tier's live eq. 7 ranking cannot score them. Each group (one node's objects) keeps the score its
node had when it went (eq. 7 with the node's last access time and cost at that moment, frozen), and the
SSD trim weighs it against the live units (ssd_tier.py). Objects found at a restart have no score and
go first. A key a live node writes again (the same prefix cached anew) is claimed back and never
deleted as an orphan.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import secrets
import threading
from typing import Callable, Iterable, Optional

UNKNOWN_SCORE = float("-inf")
"""Score of objects from before a restart: nothing is known of them, so they go first."""


class OrphanObjects:
    """The scheduler thread adds, claims and deletes orphans; SGLang's backup thread (the store's
    `on_capacity_needed`) reads the lowest of them at the moment it needs room (`lowest_keys`). One lock
    makes both see the same set: a claim takes effect for the store's thread at once, and nothing is
    re-sorted per step (the store's thread walks the heap in order, O(k log k) for the k groups it
    takes)."""

    def __init__(self) -> None:
        self._heap: list = []  # (score, seq, keys, bytes per key)
        self._owner: dict = {}  # key -> seq of the group that owns it
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, key: str) -> bool:
        return key in self._owner

    def keys(self) -> set:
        with self._lock:
            return set(self._owner)

    def add(self, keys: Iterable[str], size_bytes: int, score: float) -> None:
        """One node's objects (`size_bytes` each), ranked by `score` (lower goes first)."""
        keys = tuple(keys)
        if not keys:
            return
        with self._lock:
            seq = next(self._seq)
            for key in keys:
                self._owner[key] = seq
            heapq.heappush(self._heap, (score, seq, keys, size_bytes))

    def claim(self, keys: Iterable[str]) -> None:
        """A live node holds these keys again: they are no longer orphans."""
        with self._lock:
            for key in keys:
                self._owner.pop(key, None)

    def lowest_score(self) -> Optional[float]:
        with self._lock:
            self._drop_empty()
            return self._heap[0][0] if self._heap else None

    def pop_lowest(self) -> Optional[tuple]:
        """(keys still orphaned, bytes each) of the lowest-ranked group, or None."""
        with self._lock:
            self._drop_empty()
            if not self._heap:
                return None
            _, seq, keys, size_bytes = heapq.heappop(self._heap)
            owned = tuple(k for k in keys if self._owner.get(k) == seq)
            for key in owned:
                del self._owner[key]
            return owned, size_bytes

    def lowest_keys(self, bytes_needed: int, keep: Callable[[str], bool]) -> list:
        """Orphan keys, lowest score first, that `keep` accepts, until they cover `bytes_needed`; nothing
        is removed (the caller deletes them, and `pop_lowest` drops the emptied groups later). Any
        thread. The heap is walked in order through a second heap of its positions, so only the
        groups taken (and their heap children) are looked at."""
        keys, covered = [], 0
        with self._lock:
            heap, owner = self._heap, self._owner
            frontier = [(heap[0], 0)] if heap else []
            while frontier and covered < bytes_needed:
                (_, seq, group, size_bytes), i = heapq.heappop(frontier)
                for child in (2 * i + 1, 2 * i + 2):
                    if child < len(heap):
                        heapq.heappush(frontier, (heap[child], child))
                for key in group:
                    if covered >= bytes_needed:
                        break
                    if owner.get(key) == seq and keep(key):
                        keys.append(key)
                        covered += size_bytes
        return keys

    def in_order(self) -> list:
        """(key, bytes) of every orphan in deletion order (diagnostics and tests: sorts everything)."""
        with self._lock:
            return [(k, size_bytes) for _, seq, keys, size_bytes in sorted(self._heap)
                    for k in keys if self._owner.get(k) == seq]

    def _drop_empty(self) -> None:
        """(lock held)"""
        while self._heap and not any(self._owner.get(k) == self._heap[0][1] for k in self._heap[0][2]):
            heapq.heappop(self._heap)

    def clear(self) -> None:
        with self._lock:
            self._heap.clear()
            self._owner.clear()


def rank_free_id(name: str) -> int:
    """A positive 63-bit id of an object's rank-independent name (`<pool>/<page hash>`, the store key
    without the rank suffix), for exchanging sets of objects through integer all-reduces."""
    return (int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1) or 1


def agree_common_ids(local_ids: set, reduce: Callable[[list, bool], list]) -> set:
    """The ids every rank holds, through element-wise all-reduces only (`reduce(values, minimum)`: MIN
    when `minimum`, else MAX; SGLang's TP all-reduce). One rank proposes its ids (the smallest random
    nonce wins: no rank number is needed), every rank flags which of them it holds, and the MIN of the
    flags keeps those on all ranks. Four collectives, the same count and sizes on every rank; exact but
    for 63-bit id collisions."""
    nonce = secrets.randbits(62) + 1
    (winner,) = reduce([nonce], True)
    proposer = nonce == winner
    (count,) = reduce([len(local_ids) if proposer else 0], False)
    if count == 0:
        return set()
    proposal = sorted(local_ids) if proposer else [0] * count
    candidates = reduce(proposal, False)  # MAX with zeros elsewhere: the proposer's ids on every rank
    held = reduce([int(c in local_ids) for c in candidates], True)
    return {c for c, ok in zip(candidates, held) if ok}
