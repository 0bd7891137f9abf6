"""Placement: where each KV segment and checkpoint copy lives, and what happens when one is evicted.

Asymmetric tiering (paper §3.1): KV prefers GPU, then CPU, then SSD (demotion instead of deletion
where a lower tier has room); non-terminal checkpoints go to the policy's historical tier (SSD for
HiState); an evicted unit moves down a tier when room can be made there, and is dropped only from the
last tier. Inclusive (write-through) policies keep copies in every tier instead of moving.
A mixin of HybridPrefixCache: it uses the cache's ledger, heaps and stats and keeps I1-I3, I6-I8.
"""
from __future__ import annotations

from .tree import Node
from .types import ItemKind, Tier, TierOp, UnitKind, tiers_in

GPU_BIT = 1 << Tier.GPU


class Placement:
    # --- item bookkeeping (the only place masks and the ledger change) -----------------------

    def _size(self, node: Node, kind: ItemKind) -> int:
        if kind is ItemKind.KV:
            return node.num_pages * self.config.kv_bytes_per_page
        return self.config.checkpoint_size_bytes

    def _mask(self, node: Node, kind: ItemKind) -> int:
        return node.kv_mask if kind is ItemKind.KV else node.ckpt_mask

    def _set_mask(self, node: Node, kind: ItemKind, mask: int) -> None:
        if kind is ItemKind.KV:
            node.kv_mask = mask
        else:
            node.ckpt_mask = mask

    def _add(self, node: Node, kind: ItemKind, tier: Tier) -> int:
        size = self._size(node, kind)
        self.ledger.add(self.ledger.pool_of(tier, kind), size)
        self._set_mask(node, kind, self._mask(node, kind) | (1 << tier))
        self.stats.on_write(kind, tier, size)
        if kind is ItemKind.CHECKPOINT and tier == self.policy.historical_tier:
            self.controller.note_state_written(self.last_now_s)
        return size

    def _sub(self, node: Node, kind: ItemKind, tier: Tier) -> int:
        size = self._size(node, kind)
        self.ledger.sub(self.ledger.pool_of(tier, kind), size)
        self._set_mask(node, kind, self._mask(node, kind) & ~(1 << tier))
        return size

    def _put(self, node: Node, kind: ItemKind, tier: Tier, action: str = "put", src: Tier = None) -> None:
        self._record(action, node, kind, src, tier, self._add(node, kind, tier))

    def _drop(self, node: Node, kind: ItemKind, tier: Tier) -> None:
        self._record("drop", node, kind, tier, None, self._sub(node, kind, tier))

    def _move(self, node: Node, kind: ItemKind, src: Tier, dst: Tier) -> None:
        self._sub(node, kind, src)
        self._record("move", node, kind, src, dst, self._add(node, kind, dst))

    def _record(self, action, node, kind, src, dst, size) -> None:
        if self.config.record_ops:
            keys = tuple(node.keys) if kind is ItemKind.KV else (node.keys[-1],)
            self._ops.append(TierOp(action, kind, keys, node.depth_pages, src, dst, size))

    # --- placement decisions -----------------------------------------------------------------

    def _lower_tiers(self, tier: Tier) -> list:
        return [t for t in self.policy.tiers if t > tier and self.ledger.has_tier(t)]

    def _historical_tier(self) -> Tier:
        wanted = self.policy.historical_tier
        if wanted is not None and self.ledger.has_tier(wanted):
            return wanted
        return Tier.GPU

    def _write_through(self, node: Node, kind: ItemKind, now_s: float) -> None:
        """Inclusive offload: copy a new item into every lower tier that can take it."""
        size = self._size(node, kind)
        node.lock_count += 1
        for tier in self._lower_tiers(Tier.GPU):
            if not self._mask(node, kind) & (1 << tier) and self._make_room(self.ledger.pool_of(tier, kind), size, now_s):
                self._put(node, kind, tier, "copy", Tier.GPU)
        node.lock_count -= 1

    def _promote_kv(self, node: Node, now_s: float) -> None:
        """Bring a reused KV segment back to the GPU (moved for exclusive tiers, copied for inclusive)."""
        size = self._size(node, ItemKind.KV)
        if not self._make_room(self.ledger.pool_of(Tier.GPU, ItemKind.KV), size, now_s):
            return
        src = min(tiers_in(node.kv_mask))
        if self.policy.write_through:
            self._put(node, ItemKind.KV, Tier.GPU, "copy", src)
        else:
            self._move(node, ItemKind.KV, src, Tier.GPU)
        node.kv_created_s = now_s  # a new stay on the GPU starts (T_KV)
        self.stats.bytes_promoted += size
        self._touch(node)
        if node.parent is not None:
            self._touch(node.parent)

    def _retire_terminal(self, node: Node, now_s: float) -> None:
        """A terminal checkpoint just became intermediate: send it to the historical tier."""
        home = self._historical_tier()
        if self.policy.write_through or node.ckpt_mask & (1 << home):
            return
        src = min(tiers_in(node.ckpt_mask))
        if src >= home:
            return
        node.lock_count += 1
        if self._make_room(self.ledger.pool_of(home, ItemKind.CHECKPOINT), self.config.checkpoint_size_bytes, now_s):
            self._move(node, ItemKind.CHECKPOINT, src, home)
            self._touch(node)
        node.lock_count -= 1

    # --- eviction of one unit ----------------------------------------------------------------

    def _evict_unit(self, node: Node, unit: UnitKind, tier: Tier, now_s: float) -> None:
        node.lock_count += 1  # cascades below must neither evict nor merge this node
        if unit is UnitKind.CHECKPOINT:
            outcome = self._evict_copy(node, ItemKind.CHECKPOINT, tier, now_s)
        else:
            outcome = self._evict_copy(node, ItemKind.KV, tier, now_s)
            if outcome in ("shed", "demote") and not node.children and node.ckpt_mask & (1 << tier):
                self._evict_copy(node, ItemKind.CHECKPOINT, tier, now_s)
        node.lock_count -= 1
        if outcome == "stuck":
            node.is_parked = True  # nothing moved; re-offered when touched or unlocked
            return
        if unit is UnitKind.BUNDLE and not node.kv_mask & GPU_BIT:
            self.controller.kv_residence_s.observe(now_s - node.kv_created_s)  # T_KV: time KV held the GPU
        self.stats.on_eviction(unit, tier, outcome)
        if outcome == "drop" and unit is UnitKind.BUNDLE:
            self._remove_node(node, now_s)
            return
        self._settle(node, checkpoint_gone=outcome == "drop")

    def _settle(self, node: Node, checkpoint_gone: bool) -> None:
        """Re-rank after a copy of `node` left a tier (eviction or a reported loss)."""
        if checkpoint_gone:  # neighbours' costs change; the node may fold into its child
            self._touch_checkpoint_neighbourhood(node)
            self._maybe_merge(node)
        else:  # a copy moved or was shed: the node's units changed, its parent may be a tier leaf now
            self._touch(node)
            self._touch(node.parent)

    def _evict_copy(self, node: Node, kind: ItemKind, tier: Tier, now_s: float) -> str:
        """Remove `node`'s `kind` copy from `tier`: "shed" (other copies remain), "demote", "drop",
        or "stuck" (interior KV with no room below: I3 forbids dropping it)."""
        if self._mask(node, kind) & ~(1 << tier):
            self._drop(node, kind, tier)
            return "shed"
        size = self._size(node, kind)
        for lower in self._lower_tiers(tier):
            if self._make_room(self.ledger.pool_of(lower, kind), size, now_s):
                self._move(node, kind, tier, lower)
                return "demote"
        if kind is ItemKind.KV:
            return "stuck" if node.children else "drop"  # a leaf's KV goes with _remove_node
        self._drop(node, kind, tier)
        self.controller.state_residence_s.observe(now_s - node.ckpt_created_s)
        return "drop"

    def _remove_node(self, node: Node, now_s: float, merge: bool = True) -> None:
        """Drop a leaf's KV and every copy of its checkpoint (the terminal bundle), then unlink it."""
        for tier in tiers_in(node.kv_mask):
            self._drop(node, ItemKind.KV, tier)
        if node.ckpt_mask:
            for tier in tiers_in(node.ckpt_mask):
                self._drop(node, ItemKind.CHECKPOINT, tier)
            self.controller.state_residence_s.observe(now_s - node.ckpt_created_s)
        parent = node.parent
        self.tree.remove_leaf(node)
        if parent.parent is not None:
            self._touch_upward(parent)
            if merge:
                self._maybe_merge(parent)

    def _maybe_merge(self, node: Node) -> None:
        """Fold a checkpoint-less node with one child into that child (keeps the tree compact)."""
        if (node.parent is None or not node.is_alive or node.ckpt_mask or len(node.children) != 1
                or node.lock_count):
            return
        (child,) = node.children.values()
        if child.lock_count or child.kv_mask != node.kv_mask:
            return
        merged = self.tree.merge_into_child(node)
        self._touch(merged)
