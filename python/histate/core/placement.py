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

from typing import TYPE_CHECKING, Iterable

from .items import ItemBook
from .ledger import Ledger
from .policies import Policy
from .tree import Node
from .types import ItemKind, Tier, tiers_in

if TYPE_CHECKING:
    from .eviction import Evictor


class TierPlan:
    """The tiers a policy uses, in order: pure lookups on the policy and the tiers that exist (the
    ledger's, or, for an executor without a core ledger, the tiers it was given: the SGLang plugin)."""

    def __init__(self, policy: Policy, present: Iterable[Tier]):
        self.policy = policy
        self.present = frozenset(present)
        checkpoint_tiers = policy.checkpoint_tiers if policy.checkpoint_tiers is not None else policy.tiers
        self._lower = {
            kind: {t: [u for u in tiers if u > t and u in self.present] for t in Tier}
            for kind, tiers in ((ItemKind.KV, policy.tiers), (ItemKind.CHECKPOINT, checkpoint_tiers))}

    @classmethod
    def of_ledger(cls, policy: Policy, ledger: Ledger) -> "TierPlan":
        return cls(policy, [t for t in Tier if ledger.has_tier(t)])

    def lower_tiers(self, tier: Tier, kind: ItemKind = ItemKind.KV) -> list:
        """The tiers below `tier` that can hold `kind`, fastest first."""
        return self._lower[kind][tier]

    def write_through_tiers(self, kind: ItemKind) -> list:
        """The tiers a write-through policy copies a new `kind` item into (`Policy.kv_write_through_tiers`:
        HiState writes KV through to the host only; the SSD takes KV the host evicts)."""
        lower = self.lower_tiers(Tier.GPU, kind)
        wanted = self.policy.kv_write_through_tiers
        return lower if kind is not ItemKind.KV or wanted is None else [t for t in lower if t in wanted]

    def demotion(self, kind: ItemKind) -> dict:
        """tier -> the tier a `kind` copy evicted from it moves to (None: it is dropped)."""
        return {t: (self._lower[kind][t][0] if self._lower[kind][t] else None) for t in self.policy.tiers}

    def historical_tier(self) -> Tier:
        """Where a non-terminal checkpoint lives: the policy's choice if that tier exists, else GPU."""
        wanted = self.policy.historical_tier
        if wanted is not None and wanted in self.present:
            return wanted
        return Tier.GPU


class Placement:
    def __init__(self, book: ItemBook, evictor: "Evictor", plan: TierPlan):
        self.book = book
        self.evictor = evictor
        self.plan = plan
        self.write_through = plan.policy.write_through

    def checkpoint_home(self, is_terminal: bool) -> Tier:
        """A terminal checkpoint (or one on a leaf) stays on the GPU with its KV; others go home."""
        return Tier.GPU if is_terminal else self.plan.historical_tier()

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
