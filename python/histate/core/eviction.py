"""Evictor: which unit leaves a pool when room is needed, and what its leaving does to the tree.

Units (units.py) are ranked per pool in a lazy victim heap (victims.py) with the policy's score
(eq. 7 for HiState). `make_room` evicts the lowest-ranked unpinned unit until the bytes fit (I1). An
evicted unit moves down a tier when room can be made there (tier_plan.TierPlan), and is dropped only
from the last tier; interior KV is never dropped (I3).

Re-ranking after an eviction (paper §3.3: "affected costs are updated after eviction without
changing last-access timestamps"). A heap entry only has to stay a lower bound of its unit's score,
so only changes that can *lower* a score need a re-offer:
  * a node whose units changed (a copy left a tier; a parent became a tier leaf; a merge): at once,
    so nothing escapes eviction (I7) and no stale unit is ever evicted;
  * the nearest checkpoint above a removed leaf: its span, and with it C, shrinks (and, with a learned
    near-end prior, the checkpoints above it that served the removed trajectory's near-end positions,
    `units.checkpoints_above_removed_leaf`). This is the only neighbour re-rank eviction needs, and it
    is deferred to the end of the `make_room` pass (batch eviction: one request's evictions re-rank
    each affected checkpoint once, not once per unit). The one approximation this allows: within the
    pass that checkpoint keeps its higher old score, so it can leave a pass later than exact eq. 7
    would have it leave (docs/design.md, "Victim heaps");
  * a checkpoint that vanishes only *raises* its neighbours' C (longer gap below, longer span above),
    so their entries stay valid lower bounds and are re-scored when they reach the top.
New checkpoints lower their neighbours' costs; `touch_checkpoint_neighbourhood` re-offers them.

Host duplicates (`Policy.host_reclaims_duplicates`, SGLang's write_back): a KV segment loaded back from
the host keeps its host copy while the device holds it, though the device will write it back when it
evicts it. SGLang frees those copies first when the host pool is short (`drive_host_eviction` ->
`_reclaim_full_host_duplicates`, unified_tree_core.py:1941-2035 in 0.5.23: in the order the duplicates
appeared, sparing evictable device leaves, whose demotion is imminent, in a first pass), before its own
or HiState's ranked walk of the host runs. The plugin runs under that path, so the simulator keeps the
same rule (`reclaim_host_duplicates`) rather than eq. 7's, which prices a host copy as if it were the
only one.

Policy-selected mechanisms (docs/policies.md):
  * `state_evicts_leaf`: under a static split, a state evicted from a tier leaf takes the leaf's KV
    copy in that tier with it (SGLang's mamba LRU evicts a device leaf whole,
    unified_cache/components/mamba.py:415-421);
  * `scan_victims`: the policy picks each victim from the pool's whole candidate set
    (`Policy.choose_victim`; Marconi min-max normalises its score over the candidates, which a
    lower-bound heap cannot do). The heap then only stores the candidates.
"""
from __future__ import annotations

from .items import ItemBook
from .tier_plan import TierPlan
from .policy_state import PolicyState
from .tree import Node, RadixTree
from .types import ALL_TIERS, CPU_BIT, GPU_BIT, HiStateError, ItemKind, Tier, UnitKind
from .units import checkpoint_neighbours, checkpoints_above_removed_leaf, is_tier_leaf, units_of
from .victims import DeferredReoffers, VictimHeap, reoffer

_GPU_CPU = GPU_BIT | CPU_BIT
_COMPACT_FACTOR = 4  # rebuild the heaps once stale entries outnumber live ones this many times


class Evictor:
    def __init__(self, tree: RadixTree, book: ItemBook, state: PolicyState, plan: TierPlan):
        self.tree = tree
        self.book = book
        self.state = state
        self.plan = plan
        policy = state.policy
        self.partitioned = policy.partitioned
        self.state_evicts_leaf = policy.state_evicts_leaf
        self.scan_victims = policy.scan_victims
        self.kv_takes_state = policy.kv_eviction_takes_state
        self.sessions = None  # a sessions.SessionRefs for `Policy.session_refs` policies (set by the cache)
        ledger = book.ledger
        self.heaps: dict = {pool: VictimHeap(state.bound) for pool in ledger.capacity_bytes}
        self.observer = None  # a CacheObserver, set through HybridPrefixCache.observer
        self._deferred = DeferredReoffers()  # re-ranks that wait for the end of the make_room pass
        # host copies of device-held KV, in the order they appeared (SGLang's `full_host_duplicates`);
        # None unless the policy reclaims them first. Entries are dropped lazily, as SGLang's are.
        self.host_duplicates: dict | None = {} if policy.host_reclaims_duplicates else None
        self._host_kv_pool = ledger.pool_of(Tier.CPU, ItemKind.KV) if ledger.has_tier(Tier.CPU) else None
        self._heap_of = {  # (unit kind, tier index) -> the heap of the pool that unit frees
            (unit, int(t)): self.heaps[ledger.pool_of(t, ItemKind.KV if unit is UnitKind.BUNDLE else ItemKind.CHECKPOINT)]
            for unit in UnitKind for t in ALL_TIERS if ledger.has_tier(t)}

    # --- offering units --------------------------------------------------------------------------

    def touch(self, node: Node) -> None:
        """Re-offer `node`'s current units (its old entries become stale)."""
        if node.parent is None:
            return
        reoffer(node, units_of(node, self.partitioned), self._heap_for)

    def _heap_for(self, unit: UnitKind, tier_index: int) -> VictimHeap:
        return self._heap_of[unit, tier_index]

    def _rerank_checkpoints_above(self, node: Node, removed_end: int) -> None:
        """A leaf ending at `removed_end` left `node`'s subtree: the checkpoints above whose C dropped
        (`units.checkpoints_above_removed_leaf`; `node` itself was just re-offered). Deferred while a
        `make_room` pass runs."""
        for above in checkpoints_above_removed_leaf(node, removed_end, self.state.near_end_reach_units):
            if above is not node:
                self._deferred.offer(above, self.touch)

    def _flush_deferred(self) -> bool:
        return self._deferred.flush(self.touch)

    def touch_checkpoint_neighbourhood(self, node: Node) -> None:
        """A checkpoint appeared or vanished at `node`: the gap of the checkpoints below changed too
        (affected costs are updated without touching timestamps, paper §3.3)."""
        for neighbour in checkpoint_neighbours(node):
            self.touch(neighbour)

    # --- making room -------------------------------------------------------------------------------

    def make_room(self, pool, size_bytes: int, now_s: float) -> bool:
        """Evict from `pool` until `size_bytes` fit (I1). False if it cannot be done. One pass: the
        re-ranks that evictions cause are applied once, at the end (or when the pool runs dry)."""
        ledger = self.book.ledger
        if not ledger.fits_ever(pool, size_bytes):
            return False
        if pool == self._host_kv_pool and self.host_duplicates is not None:
            self.reclaim_host_duplicates(size_bytes)
        self._deferred.depth += 1
        try:
            while ledger.free_bytes(pool) < size_bytes:
                if not self._evict_one(pool, now_s) and not (self._flush_deferred() and self._evict_one(pool, now_s)):
                    return False
            return True
        finally:
            self._deferred.depth -= 1
            if not self._deferred.depth:
                self._flush_deferred()

    def note_duplicate(self, node: Node) -> None:
        """`node`'s KV may have just become a host duplicate (a load-back that kept the host copy)."""
        if self.host_duplicates is not None and node.kv_mask & _GPU_CPU == _GPU_CPU:
            self.host_duplicates.setdefault(id(node), node)

    def reclaim_host_duplicates(self, size_bytes: int) -> None:
        """Free host copies of KV the device holds until the host KV pool has `size_bytes` free: SGLang's
        write_back reclaim (module docstring), oldest duplicate first, device leaves (next to be demoted,
        which would copy them back) only in a second pass. Touches no access time."""
        duplicates, ledger, pool = self.host_duplicates, self.book.ledger, self._host_kv_pool
        if not duplicates or ledger.free_bytes(pool) >= size_bytes:
            return
        for spare_device_leaves in (True, False):
            for key, node in list(duplicates.items()):
                if ledger.free_bytes(pool) >= size_bytes:
                    return
                if not node.is_alive or node.kv_mask & _GPU_CPU != _GPU_CPU:
                    del duplicates[key]  # stale
                    continue
                if spare_device_leaves and not node.lock_count and is_tier_leaf(node, GPU_BIT):
                    continue
                del duplicates[key]
                self.book.drop(node, ItemKind.KV, Tier.CPU)
                self.book.stats.on_eviction(UnitKind.BUNDLE, Tier.CPU, "reclaim")
                self.touch(node)
                self.touch(node.parent)  # may be a host tier leaf now

    def _rank(self, node: Node, unit: UnitKind, tier_index: int):
        if node.lock_count:
            return None  # pinned: parked until its last pin goes (cache._lock re-offers it)
        return self.state.score(node, unit, 1 << tier_index)

    def _evict_one(self, pool, now_s: float) -> bool:
        heap = self.heaps[pool]
        victim = self._scan(heap, now_s) if self.scan_victims else heap.pop_lowest(self._rank)
        if victim is None:
            return False
        node, unit, t, _ = victim
        self.evict_unit(node, unit, ALL_TIERS[t], now_s)
        if len(heap) > _COMPACT_FACTOR * (self.tree.num_nodes + 1024):
            for h in self.heaps.values():
                h.compact()
        return True

    def _scan(self, heap: VictimHeap, now_s: float):
        """The policy's choice among the pool's unpinned units (every one has a live entry, I7)."""
        candidates = [(node, unit, t) for _, _, node, unit, t, version in heap.entries
                      if node.is_alive and node.version == version and not node.lock_count and not node.is_parked]
        i = self.state.policy.choose_victim(self.state.scoring, candidates, now_s) if candidates else None
        return None if i is None else (*candidates[i], None)

    # --- evicting one unit -------------------------------------------------------------------------

    def _takes_leaf(self, node: Node, tier: Tier) -> bool:
        """A state leaving `tier` takes the node's KV copy there too (`state_evicts_leaf`): only where
        the tier splits KV and states, and only for a leaf of that tier."""
        bit = 1 << tier
        ledger = self.book.ledger
        return (bool(node.kv_mask & bit) and is_tier_leaf(node, bit)
                and ledger.pool_of(tier, ItemKind.KV) != ledger.pool_of(tier, ItemKind.CHECKPOINT)
                # a session still holding the leaf's KV, not its state, spares the KV (SGLang
                # `_can_evict_leaf_atomically`, unified_cache/components/base.py:192-202)
                and not (node.session_ref > 0 and node.state_session_ref == 0))

    def evict_unit(self, node: Node, unit: UnitKind, tier: Tier, now_s: float) -> None:
        if self.observer is not None:
            self.observer.on_unit_evicted(node, unit, tier, now_s, self.state.score_terms(node, unit, 1 << tier))
        book = self.book
        bit = 1 << tier
        had_device_state = tier is Tier.GPU and node.ckpt_mask & GPU_BIT
        takes_kv = unit is UnitKind.BUNDLE or (self.state_evicts_leaf and self._takes_leaf(node, tier))
        book.pin(node)  # cascades below must neither evict nor merge this node
        if takes_kv:
            outcome = self._evict_copy(node, ItemKind.KV, tier, now_s)
            if (outcome in ("shed", "demote") and node.ckpt_mask & bit
                    and (unit is UnitKind.CHECKPOINT or not node.children or self.kv_takes_state)):
                self._evict_copy(node, ItemKind.CHECKPOINT, tier, now_s)
        else:
            outcome = self._evict_copy(node, ItemKind.CHECKPOINT, tier, now_s)
        book.unpin(node)
        if outcome == "stuck":
            node.is_parked = True  # nothing moved; re-offered when touched or unlocked
            return
        if takes_kv and not node.kv_mask & GPU_BIT:
            self.state.on_kv_left_gpu(node, now_s)  # T_KV: time the KV held the GPU
        if had_device_state and (not node.ckpt_mask & GPU_BIT or (outcome == "drop" and takes_kv)):
            self.state.on_state_left_device(node, now_s)  # T_state under write_back
        book.stats.on_eviction(unit, tier, outcome)
        if outcome == "drop" and takes_kv:
            self.remove_node(node, now_s)
            return
        self.settle(node, checkpoint_gone=outcome == "drop" and not takes_kv)

    def settle(self, node: Node, checkpoint_gone: bool) -> None:
        """Re-rank after a copy of `node` left a tier (eviction or a reported loss).

        The node's units changed; its parent may have become a tier leaf. A vanished checkpoint only
        raises its neighbours' costs (module docstring), and the node may fold into its child."""
        self.touch(node)
        if checkpoint_gone:
            self.maybe_merge(node)
        else:
            self.touch(node.parent)

    def _evict_copy(self, node: Node, kind: ItemKind, tier: Tier, now_s: float) -> str:
        """Remove `node`'s `kind` copy from `tier`: "shed" (other copies remain), "demote", "drop",
        or "stuck" (interior KV with no room below: I3 forbids dropping it)."""
        book = self.book
        if book.mask(node, kind) & ~(1 << tier):
            book.drop(node, kind, tier)
            return "shed"
        size = book.size(node, kind)
        for lower in self.plan.lower_tiers(tier, kind):
            if self.make_room(book.pool(lower, kind), size, now_s):
                book.move(node, kind, tier, lower)
                return "demote"
        if kind is ItemKind.KV:
            return "stuck" if node.children else "drop"  # a leaf's KV goes with remove_node
        book.drop(node, kind, tier)
        self.state.on_state_gone(node, now_s)
        return "drop"

    def drop_state_copy(self, node: Node, tier: Tier, now_s: float) -> None:
        """Remove `node`'s state copy from `tier` without moving it anywhere (SGLang's path cap:
        a device tombstone that keeps KV and any host copy, unified_cache/components/mamba.py:265-320)."""
        book = self.book
        others = node.ckpt_mask & ~(1 << tier)
        book.drop(node, ItemKind.CHECKPOINT, tier)
        if not others:
            self.state.on_state_gone(node, now_s)
        book.stats.on_eviction(UnitKind.CHECKPOINT, tier, "shed" if others else "drop")
        self.settle(node, checkpoint_gone=not node.ckpt_mask)

    # --- removing nodes ----------------------------------------------------------------------------

    def remove_node(self, node: Node, now_s: float, merge: bool = True) -> None:
        """Drop a leaf's KV and every copy of its checkpoint (the terminal bundle), then unlink it."""
        had_checkpoint = bool(node.ckpt_mask)
        self.book.drop_all(node)
        if had_checkpoint:
            self.state.on_state_gone(node, now_s)
        parent, removed_end = node.parent, node.depth_pages
        if self.sessions is not None:
            self.sessions.on_leaf_removed(node)
        self.tree.remove_leaf(node)
        if parent.parent is not None:
            self.touch(parent)  # may be a tier leaf now: a new unit
            self._rerank_checkpoints_above(parent, removed_end)
            if merge:
                self.maybe_merge(parent)

    def remove_subtree(self, node: Node, now_s: float) -> None:
        """Remove `node` and everything below it (none of it may be pinned)."""
        stack, order = [node], []
        while stack:
            n = stack.pop()
            if n.lock_count:
                raise HiStateError(f"report_lost: {n} is pinned by an open request; abort it first")
            order.append(n)
            stack.extend(n.children.values())
        parent = node.parent
        for n in reversed(order):  # leaves first, so every removal is of a leaf; merge once at the end
            self.remove_node(n, now_s, merge=False)
        if parent.parent is not None:
            self.maybe_merge(parent)

    def maybe_merge(self, node: Node) -> None:
        """Fold a checkpoint-less node with one child into that child (keeps the tree compact)."""
        if (node.parent is None or not node.is_alive or node.ckpt_mask or len(node.children) != 1
                or node.lock_count):
            return
        (child,) = node.children.values()
        if child.lock_count or child.kv_mask != node.kv_mask:
            return
        if node.session_ref != child.session_ref or node.state_session_ref or (
                self.sessions is not None and self.sessions.is_leaf_of_any(node)):
            return  # a session leaf keeps its node (sessions.py)
        merged = self.tree.merge_into_child(node)
        self.touch(merged)

    def live_units(self) -> set:
        """(id(node), unit, tier index) with a live heap entry (invariant I7)."""
        live = set()
        for heap in self.heaps.values():
            live |= heap.live_units()
        return live
