"""Session references on the tree: SGLang 0.5.23's `--enable-session-radix-cache`, for the policies
that model it (`Policy.session_refs`: `sglang-tuned`).

SGLang (paths relative to the installed `sglang/srt/`) tags the KV a session's finished requests
inserted, and evicts unreferenced KV first:
  * at finish, the node the insert ended on is registered as the session's leaf
    (mem_cache/unified_radix_cache.py:1329-1335 -> unified_cache/session_ref_tracker.py:56-84), per
    component resolved to the nearest node at or above it holding that component's data
    (unified_cache/components/base.py:213-230);
  * a new leaf below one of the session's leaves replaces it; a leaf on another branch (a rewind) is
    added next to it (base.py:252-305);
  * FULL (KV): every node on the path root -> leaf counts one reference per leaf of each session
    covering it (full.py:68-105, `_advance_session_coverage` from the leaf up to the replaced leaf);
    a split copies the count to the new parent (full.py:147-152);
  * MAMBA (states): only the leaf node itself is referenced (mamba.py:95-125); a split gives the new
    parent none (mamba.py:322-330);
  * closing a session releases all its leaves (session_ref_tracker.py:101-118, base.py:307-312);
  * deleting a leaf node moves its session leaf to the nearest ancestor with data, or releases the
    whole path when that ancestor is already one of the session's leaves (base.py:314-330).
What the counts do to eviction is the policy's business (`sglang_tuned.py`): FULL orders device and
host victims by (referenced, count, strategy) (full.py:205-207, 209-220, 250-266); the MAMBA LRU keeps
referenced states in a partition walked last (unified_tree_core.py:230-258, mamba.py:373-383).

A reference count only ever rises on registration; a release lowers the scores of the nodes it
touches, so they are re-offered to the victim heaps (`touch`): heap entries stay lower bounds.
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional

from .tree import Node


class SessionRefs:
    """The leaves of every live session, per component, and the counts they put on the tree."""

    def __init__(self, root: Node, touch: Callable[[Node], None]):
        self.root = root
        self.touch = touch  # re-offer a node whose score may have dropped
        self.kv_leaves: dict = {}     # session id -> set of nodes (FULL session leaves)
        self.state_leaves: dict = {}  # session id -> set of nodes (MAMBA session leaves)
        self._kv_sessions_at: dict = {}     # node -> set of session ids with a FULL leaf there
        self._state_sessions_at: dict = {}  # node -> set of session ids with a MAMBA leaf there
        self.closed: set = set()      # a request finishing after its session closed tags nothing

    # --- registration (a finished request) --------------------------------------------------------

    def register(self, session_id: Hashable, end: Optional[Node]) -> None:
        """The request of `session_id` whose insert ended at `end` finished."""
        if session_id is None or session_id in self.closed or end is None or end is self.root:
            return
        self._register_kv(session_id, end)
        state_leaf = _nearest_with_state(end, self.root)
        if state_leaf is not None:
            self._register_state(session_id, state_leaf)

    def _register_kv(self, sid: Hashable, leaf: Node) -> None:
        leaves = self.kv_leaves.setdefault(sid, set())
        if leaf in leaves:
            return
        old = _nearest_in(leaf, leaves, self.root)
        node = leaf
        while node is not old and node is not self.root:
            node.session_ref += 1
            node = node.parent
        self._mark(self._kv_sessions_at, leaves, sid, leaf)
        if old is not None:
            self._unmark(self._kv_sessions_at, leaves, sid, old)

    def _register_state(self, sid: Hashable, leaf: Node) -> None:
        leaves = self.state_leaves.setdefault(sid, set())
        if leaf in leaves:
            return
        old = _nearest_in(leaf, leaves, self.root)
        leaf.state_session_ref += 1
        self._mark(self._state_sessions_at, leaves, sid, leaf)
        if old is not None:
            old.state_session_ref -= 1
            self._unmark(self._state_sessions_at, leaves, sid, old)
            self.touch(old)

    # --- release (the session closed) -------------------------------------------------------------

    def close(self, session_id: Hashable) -> None:
        self.closed.add(session_id)
        for leaf in self.kv_leaves.pop(session_id, ()):
            self._sessions_at_discard(self._kv_sessions_at, leaf, session_id)
            self._dec_path(leaf, None)
        for leaf in self.state_leaves.pop(session_id, ()):
            self._sessions_at_discard(self._state_sessions_at, leaf, session_id)
            leaf.state_session_ref -= 1
            self.touch(leaf)

    # --- tree changes ------------------------------------------------------------------------------

    def on_leaf_removed(self, node: Node) -> None:
        """`node` (a leaf) leaves the tree: its session leaves move to the nearest ancestor with data
        (every ancestor has KV somewhere; a state for the MAMBA leaf), or release the path when that
        ancestor already is one of the session's leaves (base.py:314-330)."""
        for sid in tuple(self._kv_sessions_at.get(node, ())):
            leaves = self.kv_leaves[sid]
            self._unmark(self._kv_sessions_at, leaves, sid, node)
            fallback = node.parent if node.parent is not self.root else None
            if fallback is not None and fallback in leaves:
                fallback = None
            self._dec_path(node, fallback)
            if fallback is not None:
                self._mark(self._kv_sessions_at, leaves, sid, fallback)
        for sid in tuple(self._state_sessions_at.get(node, ())):
            leaves = self.state_leaves[sid]
            self._unmark(self._state_sessions_at, leaves, sid, node)
            node.state_session_ref -= 1
            fallback = _nearest_with_state(node.parent, self.root)
            if fallback is not None and fallback not in leaves:
                fallback.state_session_ref += 1
                self._mark(self._state_sessions_at, leaves, sid, fallback)

    def is_leaf_of_any(self, node: Node) -> bool:
        return bool(self._kv_sessions_at.get(node)) or bool(self._state_sessions_at.get(node))

    # --- internals ---------------------------------------------------------------------------------

    def _dec_path(self, leaf: Node, stop: Optional[Node]) -> None:
        node = leaf
        while node is not stop and node is not self.root:
            node.session_ref -= 1
            self.touch(node)
            node = node.parent

    @staticmethod
    def _mark(index: dict, leaves: set, sid: Hashable, node: Node) -> None:
        leaves.add(node)
        index.setdefault(node, set()).add(sid)

    @classmethod
    def _unmark(cls, index: dict, leaves: set, sid: Hashable, node: Node) -> None:
        leaves.discard(node)
        cls._sessions_at_discard(index, node, sid)

    @staticmethod
    def _sessions_at_discard(index: dict, node: Node, sid: Hashable) -> None:
        sids = index.get(node)
        if sids is not None:
            sids.discard(sid)
            if not sids:
                del index[node]


def _nearest_in(leaf: Node, leaves: set, root: Node) -> Optional[Node]:
    """The nearest strict ancestor of `leaf` among `leaves` (base.py:252-260)."""
    if not leaves:
        return None
    node = leaf.parent
    while node is not None and node is not root:
        if node in leaves:
            return node
        node = node.parent
    return None


def _nearest_with_state(node: Optional[Node], root: Node) -> Optional[Node]:
    """The nearest node at or above `node` holding a state in some tier (MAMBA's match validator:
    a device or host copy, mamba.py:151-162)."""
    while node is not None and node is not root:
        if node.ckpt_mask:
            return node
        node = node.parent
    return None
