"""Placement: which tier each copy goes to (paper §3.1, asymmetric tiering).

KV prefers GPU, then CPU, then SSD (demotion instead of deletion where a lower tier has room);
non-terminal checkpoints go to the policy's historical tier (SSD for HiState); a terminal checkpoint
that becomes intermediate is retired there; reused KV comes back to the GPU. Inclusive (write-through)
policies copy every new item down the tiers they write through (`Policy.kv_write_through_tiers`:
HiState's KV goes to the host only, the SSD takes what the host evicts) instead of moving it; a
checkpoint only into the tiers its policy keeps checkpoints in (`Policy.checkpoint_tiers`: HiState's
host tier holds KV, its state slots there only stage transfers). Under write-through a retired checkpoint whose home tier already
holds a copy leaves the faster tiers (HiState in SGLang: device and host copies go once the SSD copy
is acknowledged). The decisions use the evictor to make room and the item book to move copies; they
never score anything themselves.
"""
from __future__ import annotations

from typing import Protocol

from .items import ItemBook
from .tier_plan import TierPlan
from .tree import Node
from .types import ItemKind, Tier, tiers_in


class RoomMaker(Protocol):
    """What placement needs from eviction (core.eviction.Evictor): room in a pool, and recency.
    Placement decides where copies go and eviction decides what leaves; this protocol keeps the
    dependency one-way (eviction imports the tier plan, placement imports nothing of eviction)."""

    def make_room(self, pool, size_bytes: int, now_s: float) -> bool: ...

    def touch(self, node: Node) -> None: ...


class Placement:
    def __init__(self, book: ItemBook, evictor: RoomMaker, plan: TierPlan):
        self.book = book
        self.evictor = evictor
        self.plan = plan
        self.write_through = plan.policy.write_through

    def checkpoint_home(self, is_terminal: bool) -> Tier:
        """A terminal checkpoint (or one on a leaf) stays on the GPU with its KV; others go home, unless
        the policy writes no checkpoint down at creation (SGLang's write_back: it stays where the pass
        left it until the GPU evicts it, `Policy.checkpoint_write_through`)."""
        if is_terminal or not self.plan.policy.checkpoint_write_through:
            return Tier.GPU
        return self.plan.historical_tier()

    def copy_down(self, node: Node, kind: ItemKind, now_s: float) -> None:
        """Inclusive offload: copy a new item into every lower tier that can take it."""
        if not self.write_through:
            return
        book = self.book
        size = book.size(node, kind)
        book.pin(node)
        for tier in self.plan.write_through_tiers(kind):
            if not book.mask(node, kind) & (1 << tier) and self.evictor.make_room(book.pool(tier, kind), size, now_s):
                book.put(node, kind, tier, "copy", Tier.GPU)
        book.unpin(node)

    def promote_kv(self, node: Node, now_s: float) -> int:
        """Bring a reused KV segment back to the GPU (moved for exclusive tiers, copied for
        inclusive). Returns the bytes promoted (0 when no room could be made)."""
        book = self.book
        size = book.size(node, ItemKind.KV)
        if not self.evictor.make_room(book.pool(Tier.GPU, ItemKind.KV), size, now_s):
            return 0
        src = min(tiers_in(node.kv_mask))
        if self.write_through:
            book.put(node, ItemKind.KV, Tier.GPU, "copy", src)
            if self.plan.policy.kv_write_through_tiers is not None:
                # SGLang brings an SSD hit back through the host (its L3 prefetch inserts host nodes)
                self.copy_down(node, ItemKind.KV, now_s)
        else:
            book.move(node, ItemKind.KV, src, Tier.GPU)
        node.kv_created_s = now_s  # a new stay on the GPU starts (T_KV)
        self.evictor.touch(node)
        if node.parent is not None:
            self.evictor.touch(node.parent)
        return size

    def retire_terminal(self, node: Node, now_s: float) -> None:
        """A terminal checkpoint just became intermediate: it lives in the historical tier from now on.
        A copy already there (write-through) stays and the faster copies go; otherwise the fastest copy
        moves there when room can be made."""
        book = self.book
        home = self.plan.historical_tier()
        faster = [t for t in tiers_in(node.ckpt_mask) if t < home]
        if not faster:
            return
        if node.ckpt_mask & (1 << home):
            for tier in faster:
                book.drop(node, ItemKind.CHECKPOINT, tier)
            self.evictor.touch(node)
            return
        if self.write_through:
            return  # the write-through copy could not be made; the faster copy keeps the checkpoint
        book.pin(node)
        if self.evictor.make_room(book.pool(home, ItemKind.CHECKPOINT), book.config.checkpoint_size_bytes, now_s):
            book.move(node, ItemKind.CHECKPOINT, faster[0], home)
            self.evictor.touch(node)
        book.unpin(node)
