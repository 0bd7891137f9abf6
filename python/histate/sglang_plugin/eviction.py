"""Unified eviction (paper §3.3) on SGLang's tree, on every tier, with the core's victim heaps.

One `histate.core.VictimHeap` per tier (device, host, SSD) holds the eviction units of SGLang's nodes
(seen as `CoreNode`s), pushed with `histate.core.reoffer` and ranked by the cache's `PolicyState`
(eq. 7: H = t_last + tau * C / M): exactly the machinery `histate.core.HybridPrefixCache` runs.
What differs from the core is only *which* units exist, because SGLang's walks decide what can leave
a tier (`tier_units`):
  device  BUNDLE      a device leaf (`evictable_device_leaves`: unlocked, no child with device KV):
                      SGLang demotes or deletes it with its device state (FULL cascades MAMBA);
          CHECKPOINT  a device state whose Mamba lock is free, on any other node: tombstoned alone;
  host    BUNDLE      a host leaf (`evictable_host_leaves`): SGLang deletes the node;
          CHECKPOINT  a host state with no host lock and no DMA in flight, on any other node;
  SSD     the core's own units over the SSD bits (`histate.core.units_of`): a node's KV pages when no
          child has KV there (with its checkpoint on a true leaf), a checkpoint otherwise.
Units are lock-dependent (a locked device leaf is no bundle; with SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK its
state still is a checkpoint), so `rank` re-reads them: an entry whose unit is gone parks its node, and
every change that can bring a unit back reaches `on_change` (the tree core's leaf-set hook runs on
lock release, insert, split, demote and load-back). That is the core's parking + re-offer, and why a
unit met locked during a walk (R1) is offered again once unlocked, by construction.

Session references (`--enable-session-radix-cache`): SGLang's contract for that flag is "eviction
consumes unreferenced entries before referenced ones" (arg_groups/fields/memory.py:86-89; FULL's leaf
heap keys `(ref > 0, ref, policy)`, components/full.py:205-207; MAMBA's LRU keeps a referenced partition,
unified_tree_core.py:230-231, 477-480). HiState reads the references as what they say: which prefixes a
live session can still come back to. On every tier, SSD included, a unit on a live session's path (its
node's FULL reference: the session's KV path, components/full.py:68-107) or holding its frontier state
(MAMBA's, components/mamba.py:95-125) ranks after every unreferenced one (`SESSION_RANK_OFFSET_S` added
to its eq. 7 score), and eq. 7 orders the referenced units among themselves. So a checkpoint inside a
live session's context is referenced like its KV, which the state needs to be a resume point at all;
ranking only the KV and the frontier state last (SGLang's own reading), or only on device and host,
measured worse (docs/results.md, "Session references with HiState"). It is an order, never a pin: a referenced unit
stays on its heap, so `evict(n)` still frees what the ledgers report, and a session nobody closes (a
session opened with a timeout is closed by SGLang's reaper, session/session_controller.py:482-487) delays
its units' eviction but never blocks it. When a reference goes the node is re-offered (components.py),
since its score drops below the key its entry may carry. SSD objects whose node SGLang deleted
(orphans.py) belong to no live path.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from histate.core import (ALL_TIERS, CPU_BIT, GPU_BIT, SESSION_RANK_OFFSET_S, SSD_BIT, DeferredReoffers, PolicyState,
                          Tier, UnitKind, VictimHeap, checkpoint_neighbours, checkpoints_above_removed_leaf, reoffer,
                          units_of)

from .core_nodes import FULL, MAMBA, CoreNode, core_of

_BITS = {Tier.GPU: GPU_BIT, Tier.CPU: CPU_BIT, Tier.SSD: SSD_BIT}
_COMPACT_FACTOR = 4  # rebuild a heap once stale entries outnumber live nodes this many times


def session_referenced(sg: Any) -> bool:
    """Whether `sg` lies on a live session's path (SGLang's FULL `session_ref`) or holds a session's
    frontier state (MAMBA's): every unit of it then ranks after the unreferenced ones (module docstring)."""
    return sg.component_data[FULL].session_ref > 0 or sg.component_data[MAMBA].session_ref > 0


def _locked(sg: Any) -> bool:
    return any(data.lock_ref > 0 for data in sg.component_data)


def tier_units(node: CoreNode, tree_core: Any, tier: Tier) -> tuple:
    """The units SGLang's walk for `tier` can evict from `node` now."""
    sg = node.sg
    if sg.parent is None:
        return ()
    if tier is Tier.GPU:
        if sg in tree_core.evictable_device_leaves:
            return (UnitKind.BUNDLE,)
        data = sg.component_data[MAMBA]
        return (UnitKind.CHECKPOINT,) if data.value is not None and data.lock_ref == 0 else ()
    if tier is Tier.CPU:
        if sg in tree_core.evictable_host_leaves:
            return (UnitKind.BUNDLE,)
        data = sg.component_data[MAMBA]
        if (data.host_value is not None and data.host_lock_ref == 0 and data.lock_ref == 0
                and sg.write_through_pending_id is None and sg.load_back_pending_id is None):
            return (UnitKind.CHECKPOINT,)
        return ()
    if not (node.ssd_kv or node.ssd_state) or _locked(sg):
        return ()
    return tuple(unit for unit, t in units_of(node, partitioned=False) if t == Tier.SSD)


class TierVictims:
    """The victim heaps of one SGLang tree and what each walk may take from them."""

    def __init__(self, state: PolicyState, tiers: tuple = (Tier.GPU,)):
        self.state = state
        self.tree_core: Any = None  # set once SGLang built it
        self.tiers = tiers
        self.heaps = {t: VictimHeap(self.state.bound) for t in ALL_TIERS}
        self._deferred = DeferredReoffers()  # re-ranks that wait for the end of the walk

    def enable_tier(self, tier: Tier) -> None:
        if tier not in self.tiers:
            self.tiers = tuple(sorted(self.tiers + (tier,)))

    def reset(self) -> None:
        for heap in self.heaps.values():
            heap.entries.clear()
        self._deferred.clear()

    # --- offering units ------------------------------------------------------------------------

    def units(self, node: CoreNode) -> tuple:
        return tuple((unit, int(t)) for t in self.tiers for unit in tier_units(node, self.tree_core, t))

    def _heap_for(self, unit: UnitKind, tier_index: int) -> VictimHeap:
        return self.heaps[ALL_TIERS[tier_index]]

    def touch(self, node: CoreNode) -> None:
        """Re-offer `node`'s current units (its old entries become stale)."""
        units = self.units(node)
        node.offered = units
        reoffer(node, units, self._heap_for)

    def on_change(self, node: CoreNode) -> None:
        """SGLang updated `node`'s leaf-set membership (insert, split, lock release, eviction,
        demote, load-back): re-offer it if its units changed or a walk parked it."""
        if node.is_parked or self.units(node) != node.offered:
            self.touch(node)

    def touch_checkpoint_neighbourhood(self, node: CoreNode) -> None:
        """The core's re-offer after a new checkpoint (`checkpoint_neighbours`: it passes through the
        checkpoint-less nodes below down to the next checkpoint, which also covers SGLang's unmerged
        chains of single-child nodes)."""
        for neighbour in checkpoint_neighbours(node):
            self.touch(neighbour)

    def on_removed(self, node: CoreNode) -> None:
        """SGLang unlinked `node`: its entries are stale; its parent may be a leaf now (the core's
        `remove_node` re-offers it), and the checkpoint above it spans less (the core's deferred
        re-rank, applied at the end of the walk)."""
        node.is_alive = False
        node.version += 1
        parent = node.sg.parent
        if parent is None:
            return
        parent_core = core_of(parent)
        if parent.parent is not None:
            self.touch(parent_core)
        reach = self.state.near_end_reach_units
        for above in checkpoints_above_removed_leaf(parent_core, node.depth_pages, reach):
            if above is not parent_core:  # re-offered just above (as the core's `_rerank_checkpoints_above`)
                self._deferred.offer(above, self.touch)

    # --- walks ---------------------------------------------------------------------------------

    def begin_walk(self) -> None:
        self._deferred.depth += 1

    def end_walk(self) -> None:
        self._deferred.depth -= 1
        if not self._deferred.depth:
            self._deferred.flush(self.touch)

    def _rank(self, node: CoreNode, unit: UnitKind, tier_index: int) -> Optional[float]:
        tier = ALL_TIERS[tier_index]
        if unit not in tier_units(node, self.tree_core, tier):
            return None  # locked, or reclassified without a notification: parked until on_change
        score = self.state.score(node, unit, _BITS[tier])
        if self.tree_core.enable_session_radix_cache and session_referenced(node.sg):
            score += SESSION_RANK_OFFSET_S
        return score

    def next_victim(self, tier: Tier, accept: Optional[Callable[[CoreNode, UnitKind], bool]] = None) -> Optional[tuple]:
        """Pop the lowest-ranked unit of `tier` that `accept` takes: (node, unit) or None."""
        heap = self.heaps[tier]
        victim = heap.pop_lowest(self._rank, None if accept is None else (lambda n, u, t: accept(n, u)))
        if len(heap) > _COMPACT_FACTOR * (len(self.tree_core._node_arena) + 1024):
            heap.compact()
        if victim is None:
            return None
        node, unit, _, _ = victim
        node.offered = ()  # the unit leaves: SGLang's next leaf-set update re-offers what remains
        return node, unit

    def peek(self, tier: Tier, accept: Callable[[CoreNode, UnitKind], bool],
             enough: Callable[[CoreNode, UnitKind], bool]) -> list:
        """The (node, unit)s the next walks of `tier` would take, lowest first, up to the first one
        `enough` accepts; nothing leaves the heap."""
        return self.heaps[tier].peek_lowest(self._rank, lambda n, u, t: accept(n, u), enough)

    # --- invariants (tests) ----------------------------------------------------------------------

    def check_offered(self) -> None:
        """H4: every unit SGLang could evict now has a live heap entry (nothing escapes eviction)."""
        live = set()
        for heap in self.heaps.values():
            live |= heap.live_units()
        for sg in self.tree_core._node_arena.values():
            node = core_of(sg)
            for unit, t in self.units(node):
                if (id(node), unit, t) not in live:
                    raise AssertionError(f"H4: node {sg.id} forms a {unit.value} unit in "
                                         f"{ALL_TIERS[t].name} but is not offered")


def write_back_moves_state(tree_core: Any, sg: Any, unit: UnitKind) -> bool:
    """Whether evicting `unit` of `sg` from the device under `--hicache-write-policy write_back` copies
    its state to the host first instead of dropping it: every device state with no host or SSD copy, on a
    node whose KV is on the device.
      BUNDLE      SGLang's leaf eviction backs up a node not backed up yet, its KV and states together, and
                  demotes it (`evict_device_leaf`, unified_tree_core.py:1788-1825). A backed-up leaf it
                  demotes as it is, so a state the leaf gained since its backup would go with no copy:
                  HiState backs that state up first (`leaf_state_needs_backup`).
      CHECKPOINT  SGLang's own MAMBA walk backs up a state with no host copy only on a node not backed up
                  (components/mamba.py:427-437). HiState's walk asks for the backup whenever the node's KV
                  is on the device: its checkpoints are often placed inside a node already backed up (a
                  split at a planned position), and a checkpoint that left the device with no copy is a
                  miss the next turn pays. SGLang's backup of such a node copies the state alone (its KV is
                  on the host already: `_execute_and_commit_kv_backup` skips only a node with nothing left
                  to copy, unified_radix_cache.py:1695-1699)."""
    if not (tree_core.enable_hicache and tree_core.is_write_back) or core_of(sg).ssd_state:
        return False  # a state on the SSD (state_writes.py) loses nothing when its device copy goes
    return sg.component_data[MAMBA].host_value is None and sg.component_data[FULL].value is not None \
        and sg.component_data[MAMBA].value is not None


def leaf_state_needs_backup(tree_core: Any, sg: Any, unit: UnitKind) -> bool:
    """Whether HiState must back up `sg`'s device state before SGLang evicts the bundle: a backed-up
    leaf whose state has no host copy, under write_back (see `write_back_moves_state`)."""
    return unit is UnitKind.BUNDLE and sg.backuped and write_back_moves_state(tree_core, sg, unit)


def frees_state(node: CoreNode, unit: UnitKind, tier: Tier) -> bool:
    """Whether evicting `unit` from `tier` takes `node`'s checkpoint copy there: a checkpoint unit; a
    device bundle (SGLang's FULL eviction cascades to the state); a host bundle (the node goes); an SSD
    bundle on a true leaf (the core's terminal bundle)."""
    if unit is UnitKind.CHECKPOINT:
        return True
    data = node.sg.component_data[MAMBA]
    if tier is Tier.GPU:
        return data.value is not None
    if tier is Tier.CPU:
        return data.host_value is not None
    return node.ssd_state and not node.sg.children


def takes_device_state(node: CoreNode, unit: UnitKind) -> bool:
    """What a MAMBA device walk may take: units that free a device state slot."""
    return frees_state(node, unit, Tier.GPU)


def takes_host_state(node: CoreNode, unit: UnitKind) -> bool:
    return frees_state(node, unit, Tier.CPU)


def is_bundle(node: CoreNode, unit: UnitKind) -> bool:
    return unit is UnitKind.BUNDLE
