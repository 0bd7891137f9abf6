"""HybridPrefixCache: the radix tree + ledger + policy state + a policy, as one pure engine.

Owns the request life cycle (begin_request -> plan_checkpoints -> finish_request, docs/core-api.md),
path locks and insertion, and composes the parts that do the rest, each with one job:
  ItemBook     (items.py)        the only writer of tier masks, the ledger, pins and the TierOp log
  PolicyState  (policy_state.py) refresh, terminal-hit EMA, residence samples, admission, scoring
  Evictor      (eviction.py)     victim heaps and what evicting a unit does to the tree
  Placement    (placement.py)    which tier each copy goes to (asymmetric tiering)
Keeps invariants I1-I10 (docs/invariants.md; `check_invariants` in invariants.py).
"""
from __future__ import annotations

import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .config import DEFAULT_STATE_FRACTION, CacheConfig
from .eviction import Evictor
from .items import ItemBook
from .ledger import Ledger, PartitionedLedger, UnboundedLedger
from .observer import CacheObserver
from .placement import Placement
from .tier_plan import TierPlan
from .policies import Policy, make_policy
from .policy_state import PolicyState
from .sessions import SessionRefs
from .tool_wait import Chain
from .stats import CacheStats
from .tree import Node, RadixTree
from .types import GPU_BIT, HiStateError, ItemKind, MatchResult, Tier, TierOp, fastest_tier
from .units import is_tier_leaf


@dataclass
class RequestLease:
    """A request between begin_request and finish_request: its match and the nodes it pins."""

    page_keys: list
    match: MatchResult
    locked_node: Optional[Node]
    now_s: float = 0.0
    is_open: bool = True
    pinned: list = field(default_factory=list)
    hint_pages: tuple = ()  # depths the request names for checkpoints (PolicyState.plan, docs/hints.md)
    chain: Optional[Chain] = None  # the chain of turns it continues, with tool-wait residency on (tool_wait.py)


class HybridPrefixCache:
    def __init__(self, config: CacheConfig, policy: Policy):
        self.config = config
        self.policy = policy
        capacity = {t: (sys.maxsize // 4 if policy.unbounded else config.capacity_bytes[t])
                    for t in policy.tiers if t in config.capacity_bytes}
        if policy.unbounded:  # the ceiling: its cache takes no room, running requests do (UnboundedLedger)
            self.ledger = UnboundedLedger(capacity, {t: config.capacity_bytes[t] for t in capacity})
        elif policy.partitioned:
            self.ledger = PartitionedLedger(capacity, config.state_fraction or _default_split(capacity),
                                            policy.shared_pool_tiers)
        else:
            self.ledger = Ledger(capacity)
        # vLLM's partial-block hits (#46384) keep block-sized allocation but hit at the page (hash unit)
        self._block_pages = config.block_pages if policy.block_granular and not policy.partial_block_hits else 1
        self.tree = RadixTree()
        self.stats = CacheStats()
        plan = TierPlan.of_ledger(policy, self.ledger)
        self.state = PolicyState(policy, config, plan.demotion(ItemKind.KV), plan.demotion(ItemKind.CHECKPOINT))
        self.book = ItemBook(config, self.ledger, self.stats, self._on_put, self._on_item_gone)
        self.evictor = Evictor(self.tree, self.book, self.state, plan)
        self.placement = Placement(self.book, self.evictor, plan)
        self.sessions: Optional[SessionRefs] = None
        if policy.session_refs or self.state.tool_wait is not None:  # SGLang's session references (sessions.py),
            # which tool-wait residency drives with its waiting chains where clients open no sessions
            self.sessions = SessionRefs(self.tree.root, self.evictor.touch)
            self.evictor.sessions = self.sessions
        self.num_open_leases = 0
        self.last_now_s = 0.0  # the latest time a caller passed in (injected clock, never wall time)
        self._observer: Optional[CacheObserver] = None

    @property
    def observer(self) -> Optional[CacheObserver]:
        """A `CacheObserver` told of evictions, vanished items and new checkpoints (diagnosis)."""
        return self._observer

    @observer.setter
    def observer(self, observer: Optional[CacheObserver]) -> None:
        self._observer = observer
        self.evictor.observer = observer

    def _on_put(self, node: Node, kind: ItemKind, tier: Tier, action: str, size_bytes: int) -> None:
        now_s = self.last_now_s
        self.state.on_bytes_in(tier, size_bytes, now_s)
        if kind is not ItemKind.CHECKPOINT:
            return
        if tier == self.policy.historical_tier:
            self.state.on_state_written(now_s)
        if self._observer is not None and action == "put":
            self._observer.on_checkpoint_put(node, tier, now_s)

    def _on_item_gone(self, node: Node, kind: ItemKind) -> None:
        if self._observer is not None:
            self._observer.on_item_gone(node, kind, self.last_now_s)

    # --- queries -----------------------------------------------------------------------------

    @property
    def terminal_prob(self) -> float:
        return self.state.terminal_prob

    @property
    def controller(self):
        """The interval controller (eq. 3-6) and its residence-time EMAs."""
        return self.state.controller

    def free_bytes(self, tier: Tier, kind: ItemKind = ItemKind.KV) -> int:
        """Bytes of `tier` (its `kind` pool under a static split) a running request can be promised
        without evicting: neither cached nor reserved (for `unlimited`: the physical capacity minus
        what running requests pin and reserve; its cache takes no room)."""
        return self.ledger.working_free_bytes(self.ledger.pool_of(tier, kind))

    def evictable_bytes(self, tier: Tier, kind: ItemKind = ItemKind.KV) -> int:
        """Cached bytes of that pool held by no pin: what eviction could free now (SGLang's
        `evictable_size`)."""
        return self.ledger.working_evictable_bytes(self.ledger.pool_of(tier, kind))

    def match(self, page_keys: Sequence) -> MatchResult:
        """Pure query: DESIGN.md hit accounting for `page_keys` (no locks, no refresh)."""
        return self._match(list(page_keys))[0]

    def _match(self, keys: list):
        path, m, partial = self.tree.walk(keys)
        held = None
        if m % self._block_pages:
            held = m
            path, m, partial = _floor_to_block(path, m, partial, self._block_pages)
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
        diverged_in = partial if partial is not None else (path[-1] if path else None)
        result = MatchResult(
            num_kv_pages=m, num_reused_pages=c, kv_bytes_by_tier=kv_bytes, checkpoint_tier=ckpt_tier,
            checkpoint_size_bytes=self.config.checkpoint_size_bytes if ckpt_tier is not None else 0,
            is_terminal_hit=terminal, num_held_kv_pages=held, end_offset_pages=self.state.end_offset(diverged_in, m))
        return result, path, partial, ckpt_node

    # --- request life cycle ------------------------------------------------------------------

    def begin_request(self, page_keys: Sequence, now_s: float, hint_pages: Sequence[int] = ()) -> RequestLease:
        """Match, pin the matched path, refresh it, and bring the reused KV to the GPU.

        `hint_pages`: checkpoint depths the request names (application-placed checkpoints); every
        plan made for this lease includes those inside its segment, for policies that accept hints.

        Mutates: lock counts on the path, access times, KV tier masks (promotion), the terminal-hit EMA.
        """
        keys = list(page_keys)
        self.last_now_s = now_s
        result, path, partial, ckpt_node = self._match(keys)
        if partial is not None and partial.start_pages < result.num_kv_pages:
            # A match that ends inside a node splits it there, as SGLang's match does (the prefix is
            # the node the request pins and refreshes); the unmatched rest keeps its own access time
            # and stays evictable. Refreshing the whole node would make the rest look recently used
            # (found by the plugin/simulator differential test: the learned priors diverged).
            path.append(self._split(partial, result.num_kv_pages - partial.start_pages, now_s))
            partial = None
        lock_node = partial if partial is not None else (path[-1] if path else None)
        self._lock(lock_node, +1)
        self.num_open_leases += 1
        self.state.refresh(path if partial is None else path + [partial], path, ckpt_node, now_s)
        self.state.observe_match(result.num_kv_pages, result.end_offset_pages)
        chain = self.state.on_resume(path[-1] if path else None, now_s, self.sessions)
        self.stats.on_match(result, len(keys))
        loaded_back = []
        for node in path:
            if node.depth_pages > result.num_reused_pages:
                break
            if not node.kv_mask & GPU_BIT:
                promoted = self.placement.promote_kv(node, now_s)
                self.stats.bytes_promoted += promoted
                if promoted:
                    loaded_back.append(node)
        for node in reversed(loaded_back):  # SGLang's load-back ack registers them from the anchor up
            self.evictor.note_duplicate(node)
        return RequestLease(keys, result, lock_node, now_s, hint_pages=tuple(hint_pages), chain=chain)

    def plan_checkpoints(self, lease: RequestLease, num_pages: Optional[int] = None,
                         step_end_pages: Sequence[int] = (), output_end_pages: Optional[int] = None) -> list[int]:
        """Checkpoint depths (pages) the forward pass over (c, num_pages] must produce.

        `step_end_pages`: where the executor's prefill forward passes ended (engines that keep one state
        per pass place states there); `output_end_pages`: pages holding KV once the output is decoded
        (engines that cache decode states place them up to there). Both optional."""
        end = len(lease.page_keys) if num_pages is None else num_pages
        m = lease.match
        return self.state.plan(m.num_reused_pages, m.num_kv_pages, end, lease.now_s,
                               tuple(step_end_pages), output_end_pages, lease.hint_pages)

    def finish_request(self, lease: RequestLease, page_keys: Optional[Sequence], now_s: float,
                       checkpoint_pages: Sequence[int] = (), session_id=None) -> "InsertResult":
        """Insert the request's pages and checkpoints, then release its pins.

        `page_keys` may run past the prompt (its output pages). Block-granular policies keep whole
        blocks and states on the block grid only; `kv_ends_at_last_state` policies insert KV only up
        to the deepest new state (docs/policies.md). `session_id`: the client session the request
        belongs to (`Policy.session_refs` policies tag the inserted path with it; others ignore it).
        Mutates: tree structure, tier masks, ledger, lock counts, the residence-time EMAs (evictions),
        session references.
        """
        if not lease.is_open:
            raise HiStateError("finish_request on a lease that was already finished or aborted")
        self.last_now_s = now_s
        keys = lease.page_keys if page_keys is None else list(page_keys)
        reused = lease.match.num_reused_pages
        block = self._block_pages
        if block > 1:
            keys = keys[:len(keys) - len(keys) % block]
        if self.policy.dense_checkpoints:  # every page boundary already counts as a state (I8)
            depths = []
        else:
            depths = sorted({d - d % block for d in checkpoint_pages if reused < d - d % block <= len(keys)})
            if self.policy.kv_ends_at_last_state:
                keys = keys[:depths[-1] if depths else reused]
        written_before = dict(self.stats.bytes_written_by_tier)
        path, num_new = self._insert_kv(keys, now_s, lease)
        end_pages = path[-1].depth_pages if path else 0
        num_ckpts = 0
        for depth in depths:
            if depth <= end_pages:
                node = self._node_ending_at(path, depth, now_s)
                num_ckpts += self._add_checkpoint(node, now_s, is_terminal=depth == len(keys))
        self._close(lease)
        tail = path[-1] if path else None
        if self.policy.session_refs:
            self.sessions.register(session_id, tail)
        self.state.on_turn_end(tail, lease.chain, now_s, self.sessions)
        if self.policy.max_states_per_path >= 0 and tail is not None:
            self._cap_path_states(tail, now_s)
        written = {t: b - written_before.get(t, 0) for t, b in self.stats.bytes_written_by_tier.items()
                   if b != written_before.get(t, 0)}
        return InsertResult(num_new, num_ckpts, written)

    def close_session(self, session_id, now_s: float) -> None:
        """A client session ended (SGLang's `close_session`): its references go, so its KV and states
        become ordinary eviction candidates again. No-op for policies without session references."""
        self.last_now_s = now_s
        if self.policy.session_refs:
            self.sessions.close(session_id)

    def _cap_path_states(self, tail: Node, now_s: float) -> None:
        """SGLang's `--mamba-max-states-per-path` (`MambaComponent._evict_excess_path_states`,
        unified_cache/components/mamba.py:265-320): after an insert, the shallowest device states of
        the path to `tail` beyond the cap lose their device copy; KV and any host copy stay. The tail,
        forks (not exactly one child), device leaves and pinned nodes are spared (a soft cap). Runs
        after the request's own pins are gone; nodes other running requests pin are spared (SGLang
        spares only the node each one matched: more conservative here)."""
        cap = self.policy.max_states_per_path
        holders = []
        node = tail
        while node is not None and node.parent is not None:
            if node.ckpt_mask & GPU_BIT:
                holders.append(node)
            node = node.parent
        excess = len(holders) - cap
        for node in reversed(holders):  # shallowest first
            if excess <= 0 or node is tail:
                break
            if not node.is_alive or node.lock_count or len(node.children) != 1:
                continue
            if node.kv_mask & GPU_BIT and is_tier_leaf(node, GPU_BIT):
                continue  # a device leaf
            self.evictor.drop_state_copy(node, Tier.GPU, now_s)
            excess -= 1

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

        Mutates: what `Evictor.make_room` mutates.
        """
        self.last_now_s = now_s
        return self.evictor.make_room(self.ledger.pool_of(tier, kind), size_bytes, now_s)

    # --- reservations: memory running requests hold outside the cache --------------------------

    def reserve(self, size_bytes: int, now_s: float, tier: Tier = Tier.GPU, kind: ItemKind = ItemKind.KV) -> bool:
        """Promise `size_bytes` of a pool to a running request (its new KV or working state while it
        computes), evicting cache to make room. Refused without side effects when free + evictable
        bytes cannot cover it (the engines' admission rule: SGLang's PrefillAdder, vLLM's allocator).

        Mutates: what `Evictor.make_room` mutates; the pool's reserved bytes.
        """
        self.last_now_s = now_s
        pool, ledger = self.ledger.pool_of(tier, kind), self.ledger
        if size_bytes > ledger.working_free_bytes(pool) + ledger.working_evictable_bytes(pool):
            return False
        if ledger.working_free_bytes(pool) < size_bytes and not self.evictor.make_room(pool, size_bytes, now_s):
            return False
        self.ledger.reserve(pool, size_bytes)
        return True

    def release(self, size_bytes: int, tier: Tier = Tier.GPU, kind: ItemKind = ItemKind.KV) -> None:
        """Give back a reservation (before `finish_request` inserts what the request computed)."""
        pool = self.ledger.pool_of(tier, kind)
        if size_bytes > self.ledger.reserved_bytes[pool]:
            raise HiStateError(f"release of {size_bytes} B from {pool} exceeds its reservations")
        self.ledger.reserve(pool, -size_bytes)

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
        if not self.book.mask(node, kind) & bit:
            return False
        self.stats.num_lost_reported += 1
        observer = self._observer
        if observer is not None:
            observer.on_fault(True)
        try:
            if kind is ItemKind.KV and not node.kv_mask & ~bit:
                self.evictor.remove_subtree(node, now_s)
                return True
            self.book.drop(node, kind, tier)
            self.evictor.settle(node, checkpoint_gone=kind is ItemKind.CHECKPOINT and not node.ckpt_mask)
            return True
        finally:
            if observer is not None:
                observer.on_fault(False)

    def drain_ops(self) -> list[TierOp]:
        ops, self.book.ops = self.book.ops, []
        return ops

    def check_invariants(self) -> None:
        from .invariants import check_invariants
        check_invariants(self)

    # --- locks -------------------------------------------------------------------------------

    def _lock(self, node: Optional[Node], delta: int) -> None:
        """Path lock: a request pins its node and every ancestor (I5)."""
        book = self.book
        while node is not None and node.parent is not None:
            if delta > 0:
                book.pin(node)
            else:
                book.unpin(node)
                if node.lock_count == 0 and node.is_parked:
                    self.evictor.touch(node)
            node = node.parent

    # --- insertion ---------------------------------------------------------------------------

    def _insert_kv(self, keys: list, now_s: float, lease: RequestLease):
        """Add the pages the tree lacks as one new GPU leaf. Returns (path root->end, pages added);
        every node on the returned path is pinned until the lease closes."""
        evictor = self.evictor
        path, pos, partial = self.tree.walk(keys)
        if partial is not None:
            path.append(self._split(partial, pos - partial.start_pages, now_s))
        if not self.policy.refresh_matched_only:
            for node in path:
                node.kv_access_s = now_s
        if self.policy.tracks_node_stats:
            for node in path:  # every node the insert walks (unified_tree_core.py:1368-1374)
                node.hit_count += 1
        parent = path[-1] if path else self.tree.root
        num_new = len(keys) - pos
        if num_new <= 0:
            return path, 0
        size = num_new * self.config.kv_bytes_per_page
        held = parent.lock_count > 0  # a pinned node's ancestors are pinned too (I5): nothing to add
        if not held:
            self._lock(parent, +1)  # making room must not evict the path we attach to
        ok = evictor.make_room(self.ledger.pool_of(Tier.GPU, ItemKind.KV), size, now_s)
        if not held:
            self._lock(parent, -1)
        if not ok:
            self.stats.num_insert_failures += 1
            return path, 0
        was_leaf_with_state = parent is not self.tree.root and not parent.children and parent.ckpt_mask
        leaf = self.tree.add_child(parent, keys[pos:], now_s)
        if self.policy.tracks_node_stats:
            _note_new_leaf(leaf)
        self.book.put(leaf, ItemKind.KV, Tier.GPU, "put")
        self._lock(leaf, +1)
        lease.pinned.append(leaf)
        self.placement.copy_down(leaf, ItemKind.KV, now_s)
        evictor.touch(leaf)
        evictor.touch(parent)
        if was_leaf_with_state:
            self.placement.retire_terminal(parent, now_s)
        path.append(leaf)
        return path, num_new

    def _node_ending_at(self, path: list, depth: int, now_s: float) -> Node:
        """The node of `path` that ends at `depth`, splitting one edge if needed (I4: the split
        leaves existing checkpoints where they are). Keeps `path` up to date."""
        i = bisect_left(path, depth, key=_depth_of)
        node = path[i]
        if node.depth_pages == depth:
            return node
        head = self._split(node, depth - node.start_pages, now_s)
        path.insert(i, head)
        return head

    def _split(self, node: Node, num_pages: int, now_s: float) -> Node:
        """Split `node` after its first `num_pages`; returns the new upper node (a host duplicate if
        `node` is one, registered as SGLang registers a split's new fragment)."""
        head = self.tree.split(node, num_pages, now_s)
        self.evictor.touch(node)
        self.evictor.note_duplicate(head)
        return head

    def _add_checkpoint(self, node: Node, now_s: float, is_terminal: bool) -> int:
        if node.ckpt_mask:
            node.ckpt_access_s = now_s
            return 0
        tier = self.placement.checkpoint_home(is_terminal or not node.children)
        book = self.book
        book.pin(node)
        ok = self.evictor.make_room(book.pool(tier, ItemKind.CHECKPOINT), self.config.checkpoint_size_bytes, now_s)
        book.unpin(node)
        if not ok:
            self.stats.num_checkpoint_failures += 1
            return 0
        node.ckpt_access_s = node.ckpt_created_s = now_s
        if tier != Tier.GPU and self.policy.captures_in_pass:
            # Captured by the forward pass, the state entered the device before its home tier (the SGLang
            # plugin's capture slot): Little's law sees it arrive there too.
            self.state.on_bytes_in(Tier.GPU, self.config.checkpoint_size_bytes, now_s)
        book.put(node, ItemKind.CHECKPOINT, tier, "put")
        self.placement.copy_down(node, ItemKind.CHECKPOINT, now_s)
        self.evictor.touch_checkpoint_neighbourhood(node)
        return 1


@dataclass(frozen=True, slots=True)
class InsertResult:
    num_new_pages: int
    num_checkpoints_added: int
    bytes_written_by_tier: dict


def _note_new_leaf(leaf: Node) -> None:
    """A new leaf is hit once (its insert, unified_tree_core.py:1433-1439) and raises the T-LRU history
    length of every ancestor to its depth (`_set_tlru_lens_and_raise_history`, :191-210)."""
    leaf.hit_count = 1
    depth = leaf.depth_pages
    node = leaf.parent
    while node is not None and node.parent is not None and node.history_pages < depth:
        node.history_pages = depth
        node = node.parent


def _depth_of(node: Node) -> int:
    return node.depth_pages


def _floor_to_block(path: list, num_pages: int, partial: Optional[Node], block_pages: int):
    """A walk's result cut back to whole blocks (vLLM hashes and hits whole blocks,
    `FullAttentionManager.find_longest_cache_hit`: `max_length // block_size`)."""
    num_pages -= num_pages % block_pages
    i = bisect_left(path, num_pages + 1, key=_depth_of)  # path[:i] end at or before the cut
    rest = path[i:] + ([partial] if partial is not None else [])
    cut = rest[0] if rest and rest[0].start_pages < num_pages else None
    return path[:i], num_pages, cut


def _default_split(capacity: dict) -> dict:
    return {t: DEFAULT_STATE_FRACTION for t in capacity}


def make_cache(policy: str, config: Optional[CacheConfig] = None) -> HybridPrefixCache:
    """Build a cache running the named policy bundle (see `available_policies()`)."""
    return HybridPrefixCache(config or CacheConfig(), make_policy(policy))
