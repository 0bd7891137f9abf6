"""ItemBook: the only writer of tier masks, the ledger, pins and the TierOp log.

Every copy of a KV segment or checkpoint that appears in, moves between or leaves a tier goes through
`put` / `move` / `drop`, so the ledger always equals the sum of the copies it accounts for (I2) and the
bytes held by pinned nodes are known at any time (I10; what SGLang calls protected, as opposed to
evictable, size). Every pin goes through `pin` / `unpin` for the same reason. Decides nothing.
"""
from __future__ import annotations

from typing import Callable, Optional

from .config import CacheConfig
from .ledger import Ledger
from .stats import CacheStats
from .tree import Node
from .types import ItemKind, Tier, TierOp, tiers_in


class ItemBook:
    def __init__(self, config: CacheConfig, ledger: Ledger, stats: CacheStats,
                 on_put: Callable[[Node, ItemKind, Tier, str, int], None],
                 on_item_gone: Callable[[Node, ItemKind], None]):
        self.config = config
        self.ledger = ledger
        self.stats = stats
        self.ops: list = []
        self._on_put = on_put  # (node, kind, tier, action, size): every copy entering a tier
        self._on_item_gone = on_item_gone
        # pools holding a node's copies, per tier mask (pins walk every node of a path: keep it cheap)
        self._kv_pools = tuple(tuple(ledger.pool_of(t, ItemKind.KV) for t in tiers_in(m)) for m in range(8))
        self._ckpt_pools = tuple(tuple(ledger.pool_of(t, ItemKind.CHECKPOINT) for t in tiers_in(m)) for m in range(8))
        self._kv_bytes_per_page = config.kv_bytes_per_page
        self._checkpoint_bytes = config.checkpoint_size_bytes

    # --- sizes and masks ---------------------------------------------------------------------------

    def size(self, node: Node, kind: ItemKind) -> int:
        if kind is ItemKind.KV:
            return node.num_pages * self.config.kv_bytes_per_page
        return self.config.checkpoint_size_bytes

    @staticmethod
    def mask(node: Node, kind: ItemKind) -> int:
        return node.kv_mask if kind is ItemKind.KV else node.ckpt_mask

    def pool(self, tier: Tier, kind: ItemKind):
        return self.ledger.pool_of(tier, kind)

    # --- copies --------------------------------------------------------------------------------------

    def put(self, node: Node, kind: ItemKind, tier: Tier, action: str = "put", src: Optional[Tier] = None) -> None:
        """A new copy in `tier` ("put": new data; "copy": duplicated from `src`, which keeps its own)."""
        size = self._add(node, kind, tier)
        self._record(action, node, kind, src, tier, size)
        self._on_put(node, kind, tier, action, size)

    def drop(self, node: Node, kind: ItemKind, tier: Tier) -> None:
        self._record("drop", node, kind, tier, None, self._sub(node, kind, tier))
        if not (node.kv_mask if kind is ItemKind.KV else node.ckpt_mask):
            self._on_item_gone(node, kind)

    def move(self, node: Node, kind: ItemKind, src: Tier, dst: Tier) -> None:
        self._sub(node, kind, src)
        size = self._add(node, kind, dst)
        self._record("move", node, kind, src, dst, size)
        self._on_put(node, kind, dst, "move", size)

    def drop_all(self, node: Node) -> None:
        """Every copy of `node`'s KV and checkpoint (a leaf leaving the tree)."""
        for tier in tiers_in(node.kv_mask):
            self.drop(node, ItemKind.KV, tier)
        for tier in tiers_in(node.ckpt_mask):
            self.drop(node, ItemKind.CHECKPOINT, tier)

    def _add(self, node: Node, kind: ItemKind, tier: Tier) -> int:
        size = self.size(node, kind)
        pool = self.ledger.pool_of(tier, kind)
        self.ledger.add(pool, size)
        if node.lock_count:
            self.ledger.protect(pool, size)
        if kind is ItemKind.KV:
            node.kv_mask |= 1 << tier
        else:
            node.ckpt_mask |= 1 << tier
        self.stats.on_write(kind, tier, size)
        return size

    def _sub(self, node: Node, kind: ItemKind, tier: Tier) -> int:
        size = self.size(node, kind)
        pool = self.ledger.pool_of(tier, kind)
        self.ledger.sub(pool, size)
        if node.lock_count:
            self.ledger.protect(pool, -size)
        if kind is ItemKind.KV:
            node.kv_mask &= ~(1 << tier)
        else:
            node.ckpt_mask &= ~(1 << tier)
        return size

    def _record(self, action, node, kind, src, dst, size) -> None:
        if self.config.record_ops:
            keys = tuple(node.keys) if kind is ItemKind.KV else (node.keys[-1],)
            self.ops.append(TierOp(action, kind, keys, node.depth_pages, src, dst, size))

    # --- pins ----------------------------------------------------------------------------------------

    def pin(self, node: Node) -> None:
        """One more pin on `node` alone (path locks pin every node of a path, cache._lock)."""
        if node.lock_count == 0 and (node.kv_mask or node.ckpt_mask):
            self._protect_all(node, +1)
        node.lock_count += 1

    def unpin(self, node: Node) -> None:
        node.lock_count -= 1
        if node.lock_count == 0 and (node.kv_mask or node.ckpt_mask):
            self._protect_all(node, -1)

    def _protect_all(self, node: Node, sign: int) -> None:
        protected = self.ledger.protected_bytes
        if node.kv_mask:
            kv = sign * len(node.keys) * self._kv_bytes_per_page
            for pool in self._kv_pools[node.kv_mask]:
                protected[pool] += kv
        if node.ckpt_mask:
            ckpt = sign * self._checkpoint_bytes
            for pool in self._ckpt_pools[node.ckpt_mask]:
                protected[pool] += ckpt
