"""Page-granular radix tree: structure only (walk, split, add, remove, merge).

A node's edge holds `keys` (one page key per page) and ends at depth `depth_pages`. Each node
records in which tiers its KV segment lives (`kv_mask`, a bit per Tier) and whether a recurrent
checkpoint sits at its end (`ckpt_mask`, 0 = none). Checkpoints sit only at node ends: inserting one
inside an edge splits it, so a split never moves a checkpoint (I4). Capacity accounting, eviction and
placement live in cache.py; this module never decides anything.
"""
from __future__ import annotations

from itertools import count
from typing import Optional, Sequence


class Node:
    __slots__ = (
        "id", "keys", "parent", "children", "depth_pages", "kv_mask", "ckpt_mask",
        "kv_access_s", "ckpt_access_s", "kv_created_s", "ckpt_created_s",
        "lock_count", "version", "is_alive", "is_parked",
        "session_ref", "state_session_ref", "hit_count", "history_pages",
        "turn_end",
    )

    def __init__(self, node_id: int, keys: list, parent: Optional["Node"], depth_pages: int, now_s: float):
        self.id = node_id
        self.keys = keys
        self.parent = parent
        self.children: dict = {}
        self.depth_pages = depth_pages
        self.kv_mask = 0
        self.ckpt_mask = 0
        self.kv_access_s = now_s
        self.ckpt_access_s = now_s
        self.kv_created_s = now_s
        self.ckpt_created_s = now_s
        self.lock_count = 0
        self.version = 0
        self.is_alive = True
        self.is_parked = False
        # Read only by policies that model SGLang's session references and eviction strategies
        # (core/sessions.py, policies/sglang_tuned.py); zero for every other policy.
        self.session_ref = 0        # live session paths covering this node's KV (SGLang FULL session_ref)
        self.state_session_ref = 0  # live sessions whose state leaf is this node (SGLang MAMBA session_ref)
        self.hit_count = 0          # inserts that walked through this node (SGLang `hit_count`)
        self.history_pages = depth_pages  # deepest depth ever below this node (T-LRU's history length)
        self.turn_end = None  # the finished turn that ended here, when tool-wait residency is on (tool_wait.py)

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def start_pages(self) -> int:
        return self.depth_pages - len(self.keys)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:  # debugging aid for invariant messages
        return f"Node#{self.id}[{self.start_pages}:{self.depth_pages}] kv={self.kv_mask:03b} ckpt={self.ckpt_mask:03b}"


class RadixTree:
    """Structure of the tree. Mutates only node links, keys and depths."""

    def __init__(self) -> None:
        self._ids = count(1)
        self.root = Node(0, [], None, 0, 0.0)
        self.num_nodes = 0  # excluding the root

    def walk(self, page_keys: Sequence) -> tuple[list, int, Optional[Node]]:
        """Follow `page_keys` from the root.

        Returns (nodes fully matched, pages matched, partially matched node or None). The pages
        matched include the prefix of the partial node's edge.
        """
        path = []
        node = self.root
        pos = 0
        n = len(page_keys)
        while pos < n:
            child = node.children.get(page_keys[pos])
            if child is None:
                return path, pos, None
            keys = child.keys
            k = len(keys)
            if page_keys[pos:pos + k] == keys:
                path.append(child)
                pos += k
                node = child
                continue
            # partial edge match: count the common pages
            j = 1
            limit = min(k, n - pos)
            while j < limit and keys[j] == page_keys[pos + j]:
                j += 1
            return path, pos + j, child
        return path, pos, None

    def split(self, node: Node, num_head_pages: int, now_s: float) -> Node:
        """Split `node` after `num_head_pages` pages; returns the new head (parent) node.

        The head inherits the KV tiers and timestamps; the checkpoint stays at the tail's end (I4).
        """
        assert 0 < num_head_pages < len(node.keys)
        head = Node(next(self._ids), node.keys[:num_head_pages], node.parent,
                    node.start_pages + num_head_pages, now_s)
        head.kv_mask = node.kv_mask
        head.kv_access_s = node.kv_access_s
        head.kv_created_s = node.kv_created_s
        head.lock_count = node.lock_count  # path locks cover both halves
        head.session_ref = node.session_ref  # a session covering the tail covers its head (SGLang full.py)
        head.hit_count = node.hit_count
        head.history_pages = node.history_pages
        node.parent.children[head.keys[0]] = head
        node.keys = node.keys[num_head_pages:]
        node.parent = head
        head.children[node.keys[0]] = node
        node.version += 1
        self.num_nodes += 1
        return head

    def add_child(self, parent: Node, keys: list, now_s: float) -> Node:
        child = Node(next(self._ids), keys, parent, parent.depth_pages + len(keys), now_s)
        parent.children[keys[0]] = child
        self.num_nodes += 1
        return child

    def remove_leaf(self, node: Node) -> None:
        assert node.is_leaf and node.parent is not None
        del node.parent.children[node.keys[0]]
        node.is_alive = False
        node.version += 1
        self.num_nodes -= 1

    def merge_into_child(self, node: Node) -> Node:
        """Fold a single-child `node` into its child (node has no checkpoint). Returns the child."""
        (child,) = node.children.values()
        child.keys = node.keys + child.keys
        child.parent = node.parent
        node.parent.children[child.keys[0]] = child
        child.kv_access_s = max(child.kv_access_s, node.kv_access_s)
        child.kv_created_s = min(child.kv_created_s, node.kv_created_s)
        node.is_alive = False
        node.version += 1
        child.version += 1
        self.num_nodes -= 1
        return child

    def iter_nodes(self):
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
