"""HybridPrefixCache: the radix tree + ledger + interval controller + a policy, as one pure engine.

Owns every mutation of the tree's data (tier masks, checkpoints, locks, access times) and keeps
invariants I1-I9 (docs/invariants.md; `check_invariants` in invariants.py). The life cycle of a
request is begin_request -> plan_checkpoints -> finish_request (docs/core-api.md).

Victim selection is a heap per pool with lazy invalidation: every structural change to a node bumps
its version and re-pushes its units; refreshes only raise scores, so a popped entry whose recomputed
score is higher is pushed back instead of evicted. No eviction scans the tree.
"""
from __future__ import annotations

import heapq
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import count
from typing import Optional, Sequence

from .config import CacheConfig
from .interval import Ema, IntervalController
from .ledger import Ledger, PartitionedLedger
from .placement import Placement
from .policies import AdmissionContext, Policy, make_policy
from .stats import CacheStats
from .tree import Node, RadixTree
from .types import ALL_TIERS, HiStateError, ItemKind, MatchResult, Tier, TierOp, UnitKind, fastest_tier
from .units import last_access_s, units_of

_COMPACT_FACTOR = 4  # rebuild a heap once stale entries outnumber live ones this many times


@dataclass
class RequestLease:
    """A request between begin_request and finish_request: its match and the nodes it pins."""

    page_keys: list
    match: MatchResult
    locked_node: Optional[Node]
    now_s: float = 0.0
    is_open: bool = True
    pinned: list = field(default_factory=list)


class HybridPrefixCache(Placement):
    def __init__(self, config: CacheConfig, policy: Policy):
        self.config = config
        self.policy = policy
        capacity = {t: (sys.maxsize // 4 if policy.unbounded else config.capacity_bytes[t])
                    for t in policy.tiers if t in config.capacity_bytes}
        self.ledger = (PartitionedLedger(capacity, config.state_fraction or _default_split(capacity))
                       if policy.partitioned else Ledger(capacity))
        self.tree = RadixTree()
        self.controller = IntervalController(
            config.checkpoint_token_equiv / config.page_num_tokens, config.supported_intervals_pages, config.ema_alpha)
        self.terminal_hits = Ema(config.ema_alpha, config.initial_terminal_hit_prob)
        self.stats = CacheStats()
        self.heaps: dict = {pool: [] for pool in self.ledger.capacity_bytes}
        self._heap_of = {  # (unit kind, tier index) -> the heap of the pool that unit frees
            (unit, int(t)): self.heaps[self.ledger.pool_of(t, ItemKind.KV if unit is UnitKind.BUNDLE else ItemKind.CHECKPOINT)]
            for unit in UnitKind for t in ALL_TIERS if self.ledger.has_tier(t)}
        self._seq = count()
        self._ops: list = []
        self.num_open_leases = 0
        self.last_now_s = 0.0  # the latest time a caller passed in (injected clock, never wall time)

    # --- queries -----------------------------------------------------------------------------

    @property
    def terminal_prob(self) -> float:
        return self.terminal_hits.value

    def match(self, page_keys: Sequence) -> MatchResult:
        """Pure query: DESIGN.md hit accounting for `page_keys` (no locks, no refresh)."""
        return self._match(list(page_keys))[0]

    def _match(self, keys: list):
        path, m, partial = self.tree.walk(keys)
        ckpt_node = None
        if self.policy.dense_checkpoints:
            c = m
            nodes_kv = path + ([partial] if partial is not None else [])
        else:  # c: the deepest checkpoint on the matched path (checkpoints sit at node ends, I4)
            i = len(path) - 1
            while i >= 0 and not path[i].ckpt_mask:
                i -= 1
            ckpt_node = path[i] if i >= 0 else None
            c = ckpt_node.depth_pages if ckpt_node is not None else 0
            nodes_kv = path[:i + 1]
        kv_page_bytes = self.config.kv_bytes_per_page
        kv_bytes: dict = {}
        done = 0
        for node in nodes_kv:
            take = min(node.depth_pages, c) - done
            if take <= 0:
                break
            tier = fastest_tier(node.kv_mask)
            kv_bytes[tier] = kv_bytes.get(tier, 0) + take * kv_page_bytes
            done += take
        if self.policy.dense_checkpoints:
            ckpt_tier = Tier.GPU if c else None
            terminal = partial is None and bool(path) and not path[-1].children and m == path[-1].depth_pages
        else:
            ckpt_tier = fastest_tier(ckpt_node.ckpt_mask) if ckpt_node is not None else None
            terminal = ckpt_node is not None and not ckpt_node.children
        result = MatchResult(
            num_kv_pages=m, num_reused_pages=c, kv_bytes_by_tier=kv_bytes, checkpoint_tier=ckpt_tier,
            checkpoint_size_bytes=self.config.checkpoint_size_bytes if ckpt_tier is not None else 0,
            is_terminal_hit=terminal)
        return result, path, partial, ckpt_node

    # --- request life cycle ------------------------------------------------------------------

    def begin_request(self, page_keys: Sequence, now_s: float) -> RequestLease:
        """Match, pin the matched path, refresh it, and bring the reused KV to the GPU.

        Mutates: lock counts on the path, access times, KV tier masks (promotion), the terminal-hit EMA.
        """
        keys = list(page_keys)
        self.last_now_s = now_s
        result, path, partial, ckpt_node = self._match(keys)
        lock_node = partial if partial is not None else (path[-1] if path else None)
        self._lock(lock_node, +1)
        self.num_open_leases += 1
        for node in path:
            node.kv_access_s = now_s
        if partial is not None:
            partial.kv_access_s = now_s
        if ckpt_node is not None:
            ckpt_node.ckpt_access_s = now_s
            if self.policy.refresh_all:
                for node in path:  # every checkpoint above the hit; eq. 7's cost still sparsifies them
                    if node.ckpt_mask and node.depth_pages < ckpt_node.depth_pages:
                        node.ckpt_access_s = now_s
        if result.num_kv_pages > 0:
            self.terminal_hits.observe(1.0 if result.is_terminal_hit else 0.0)
        self.stats.on_match(result, len(keys))
        for node in path:
            if node.depth_pages > result.num_reused_pages:
                break
            if not node.kv_mask & (1 << Tier.GPU):
                self._promote_kv(node, now_s)
        return RequestLease(keys, result, lock_node, now_s)

    def plan_checkpoints(self, lease: RequestLease, num_pages: Optional[int] = None) -> list[int]:
        """Checkpoint depths (pages) the forward pass over (c, num_pages] must produce."""
        end = len(lease.page_keys) if num_pages is None else num_pages
        if self.policy.dense_checkpoints:
            return []
        ctx = AdmissionContext(lease.match.num_reused_pages, lease.match.num_kv_pages, end,
                               self.controller, self.config, lease.now_s)
        return self.policy.admit(ctx)

    def finish_request(self, lease: RequestLease, page_keys: Optional[Sequence], now_s: float,
                       checkpoint_pages: Sequence[int] = ()) -> "InsertResult":
        """Insert the request's pages and checkpoints, then release its pins.

        Mutates: tree structure, tier masks, ledger, lock counts, the residence-time EMAs (evictions).
        """
        if not lease.is_open:
            raise HiStateError("finish_request on a lease that was already finished or aborted")
        self.last_now_s = now_s
        keys = lease.page_keys if page_keys is None else list(page_keys)
        written_before = dict(self.stats.bytes_written_by_tier)
        path, num_new = self._insert_kv(keys, now_s, lease)
        end_pages = path[-1].depth_pages if path else 0
        num_ckpts = 0
        if self.policy.dense_checkpoints:  # every page boundary already counts as a state (I8)
            checkpoint_pages = ()
        for depth in sorted(set(checkpoint_pages)):
            if lease.match.num_reused_pages < depth <= end_pages:
                node = self._node_ending_at(path, depth, now_s)
                num_ckpts += self._add_checkpoint(node, now_s, is_terminal=depth == len(keys))
        self._close(lease)
        written = {t: b - written_before.get(t, 0) for t, b in self.stats.bytes_written_by_tier.items()
                   if b != written_before.get(t, 0)}
        return InsertResult(num_new, num_ckpts, written)

    def abort_request(self, lease: RequestLease) -> None:
        self._close(lease)

    def _close(self, lease: RequestLease) -> None:
        if not lease.is_open:
            return
        lease.is_open = False
        self.num_open_leases -= 1
        self._lock(lease.locked_node, -1)
        for node in lease.pinned:
            self._lock(node, -1)

    def evict(self, tier: Tier, size_bytes: int, now_s: float, kind: ItemKind = ItemKind.KV) -> bool:
        """Free `size_bytes` in `tier` (for `kind` under a static split) by evicting the lowest-ranked
        units; the adapter's answer to SGLang's `evict(num_tokens)`. False if pins prevent it.

        Mutates: what `_make_room` mutates.
        """
        self.last_now_s = now_s
        return self._make_room(self.ledger.pool_of(tier, kind), size_bytes, now_s)

    def report_lost(self, page_keys: Sequence, depth_pages: int, kind: ItemKind, tier: Tier, now_s: float) -> bool:
        """An executor found a copy missing or corrupt (a torn file, a failed read): forget it, so that
        later matches do not count on it. Faults become misses, never wrong results.

        The item is the checkpoint at `depth_pages`, or the KV segment holding page `depth_pages - 1`
        (any page of it; a TierOp names its last). A KV segment lost from its only tier takes its whole
        subtree with it (I3); that subtree must not be pinned (abort the request first). Returns whether
        a copy was forgotten.
        Mutates: masks, ledger, tree structure, heaps.
        """
        self.last_now_s = now_s
        path, pos, partial = self.tree.walk(list(page_keys[:depth_pages]))
        if pos != depth_pages or depth_pages == 0:
            return False
        if kind is ItemKind.KV and partial is not None:
            node = partial  # the page sits inside this segment
        elif partial is None and path:
            node = path[-1]
        else:
            return False
        bit = 1 << tier
        if not self._mask(node, kind) & bit:
            return False
        self.stats.num_lost_reported += 1
        if kind is ItemKind.KV and not node.kv_mask & ~bit:
            self._remove_subtree(node, now_s)
            return True
        self._drop(node, kind, tier)
        self._settle(node, checkpoint_gone=kind is ItemKind.CHECKPOINT and not node.ckpt_mask)
        return True

    def _remove_subtree(self, node: Node, now_s: float) -> None:
        stack, order = [node], []
        while stack:
            n = stack.pop()
            if n.lock_count:
                raise HiStateError(f"report_lost: {n} is pinned by an open request; abort it first")
            order.append(n)
            stack.extend(n.children.values())
        parent = node.parent
        for n in reversed(order):  # leaves first, so every removal is of a leaf; merge once at the end
            self._remove_node(n, now_s, merge=False)
        if parent.parent is not None:
            self._maybe_merge(parent)

    def drain_ops(self) -> list[TierOp]:
        ops, self._ops = self._ops, []
        return ops

    def check_invariants(self) -> None:
        from .invariants import check_invariants
        check_invariants(self)

    # --- locks -------------------------------------------------------------------------------

    def _lock(self, node: Optional[Node], delta: int) -> None:
        """Path lock: a request pins its node and every ancestor (I5)."""
        while node is not None and node.parent is not None:
            node.lock_count += delta
            if node.lock_count == 0 and node.is_parked:
                self._touch(node)
            node = node.parent

    # --- insertion ---------------------------------------------------------------------------

    def _insert_kv(self, keys: list, now_s: float, lease: RequestLease):
        """Add the pages the tree lacks as one new GPU leaf. Returns (path root->end, pages added);
        every node on the returned path is pinned until the lease closes."""
        path, pos, partial = self.tree.walk(keys)
        if partial is not None:
            head = self.tree.split(partial, pos - partial.start_pages, now_s)
            self._touch(partial)
            path.append(head)
        for node in path:
            node.kv_access_s = now_s
        parent = path[-1] if path else self.tree.root
        num_new = len(keys) - pos
        if num_new <= 0:
            return path, 0
        size = num_new * self.config.kv_bytes_per_page
        self._lock(parent, +1)  # making room must not evict the path we attach to
        ok = self._make_room(self.ledger.pool_of(Tier.GPU, ItemKind.KV), size, now_s)
        self._lock(parent, -1)
        if not ok:
            self.stats.num_insert_failures += 1
            return path, 0
        was_leaf_with_state = parent is not self.tree.root and not parent.children and parent.ckpt_mask
        leaf = self.tree.add_child(parent, keys[pos:], now_s)
        self._put(leaf, ItemKind.KV, Tier.GPU, "put")
        self._lock(leaf, +1)
        lease.pinned.append(leaf)
        if self.policy.write_through:
            self._write_through(leaf, ItemKind.KV, now_s)
        self._touch(leaf)
        self._touch(parent)
        if was_leaf_with_state:
            self._retire_terminal(parent, now_s)
        path.append(leaf)
        return path, num_new

    def _node_ending_at(self, path: list, depth: int, now_s: float) -> Node:
        """The node of `path` that ends at `depth`, splitting one edge if needed (I4: the split
        leaves existing checkpoints where they are). Keeps `path` up to date."""
        i = bisect_left(path, depth, key=_depth_of)
        node = path[i]
        if node.depth_pages == depth:
            return node
        head = self.tree.split(node, depth - node.start_pages, now_s)
        self._touch(node)
        path.insert(i, head)
        return head

    def _add_checkpoint(self, node: Node, now_s: float, is_terminal: bool) -> int:
        if node.ckpt_mask:
            node.ckpt_access_s = now_s
            return 0
        tier = Tier.GPU if is_terminal or node.children == {} else self._historical_tier()
        node.lock_count += 1
        ok = self._make_room(self.ledger.pool_of(tier, ItemKind.CHECKPOINT), self.config.checkpoint_size_bytes, now_s)
        node.lock_count -= 1
        if not ok:
            self.stats.num_checkpoint_failures += 1
            return 0
        node.ckpt_access_s = node.ckpt_created_s = now_s
        self._put(node, ItemKind.CHECKPOINT, tier, "put")
        if self.policy.write_through:
            self._write_through(node, ItemKind.CHECKPOINT, now_s)
        self._touch_checkpoint_neighbourhood(node)
        return 1

    # --- eviction ----------------------------------------------------------------------------

    def _make_room(self, pool, size_bytes: int, now_s: float) -> bool:
        """Evict from `pool` until `size_bytes` fit (I1). False if it cannot be done."""
        if not self.ledger.fits_ever(pool, size_bytes):
            return False
        while self.ledger.free_bytes(pool) < size_bytes:
            if not self._evict_one(pool, now_s):
                return False
        return True

    def _evict_one(self, pool, now_s: float) -> bool:
        heap = self.heaps[pool]
        while heap:
            score, _, node, unit, bit_index, version = heap[0]
            if not node.is_alive or node.version != version:
                heapq.heappop(heap)
                continue
            if node.lock_count:
                heapq.heappop(heap)
                node.is_parked = True  # I7: re-offered when its last pin goes
                continue
            current = self.policy.score(self, node, unit, 1 << bit_index)
            if current > score + 1e-9:  # refreshed since pushed: put it back at its true rank
                heapq.heapreplace(heap, (current, next(self._seq), node, unit, bit_index, version))
                continue
            heapq.heappop(heap)
            self._evict_unit(node, unit, ALL_TIERS[bit_index], now_s)
            if len(heap) > _COMPACT_FACTOR * (self.tree.num_nodes + 1024):
                self._rebuild_heaps()
            return True
        return False

    def _touch(self, node: Node) -> None:
        """Invalidate `node`'s heap entries and push its current units.

        Entries are pushed with the unit's last access time, a lower bound of every policy's score
        (Policy.score contract); the true score is computed only if the entry reaches the top of
        the heap, where `_evict_one` re-ranks it. Most entries are invalidated before that.
        """
        node.version += 1
        node.is_parked = False
        if not node.is_alive or node.parent is None:
            return
        for unit, t in units_of(node, self.policy.partitioned):
            bound = last_access_s(node, unit, 1 << t)
            heapq.heappush(self._heap_of[unit, t], (bound, next(self._seq), node, unit, t, node.version))

    def _touch_upward(self, node: Node) -> None:
        """`node` changed shape: re-rank it and its ancestors up to the nearest checkpoint, whose
        span (eq. 7's C of an intermediate checkpoint) runs through it."""
        while node is not None and node.parent is not None:
            self._touch(node)
            if node.ckpt_mask:
                break
            node = node.parent
        if node is not None and node.parent is not None:
            self._touch(node)

    def _touch_checkpoint_neighbourhood(self, node: Node) -> None:
        """A checkpoint appeared or vanished at `node`: the gap of the checkpoints below changed too
        (affected costs are updated without touching timestamps, paper §3.3)."""
        self._touch(node)
        self._touch_upward(node.parent)
        for child in node.children.values():
            self._touch(child)

    def _rebuild_heaps(self) -> None:
        """Drop stale entries (dead node or old version); live ones keep their place and score."""
        for heap in self.heaps.values():
            heap[:] = [e for e in heap if e[2].is_alive and e[2].version == e[5]]  # in place: _heap_of aliases it
            heapq.heapify(heap)


@dataclass(frozen=True, slots=True)
class InsertResult:
    num_new_pages: int
    num_checkpoints_added: int
    bytes_written_by_tier: dict


def _depth_of(node: Node) -> int:
    return node.depth_pages


def _default_split(capacity: dict) -> dict:
    from .policies.sglang_hicache import DEFAULT_STATE_FRACTION
    return {t: DEFAULT_STATE_FRACTION for t in capacity}


def make_cache(policy: str, config: Optional[CacheConfig] = None) -> HybridPrefixCache:
    """Build a cache running the named policy bundle (see `available_policies()`)."""
    return HybridPrefixCache(config or CacheConfig(), make_policy(policy))
