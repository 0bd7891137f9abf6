"""Executable form of docs/invariants.md. Each check names its invariant; tests call it after every
operation. Cost: O(nodes + heap entries), so it is for tests and debugging, not the hot path."""
from __future__ import annotations

from .types import InvariantViolation, ItemKind, Tier, tiers_in
from .units import units_of


def _fail(code: str, msg: str) -> None:
    raise InvariantViolation(f"{code}: {msg}")


def check_invariants(cache) -> None:
    tree, ledger, policy = cache.tree, cache.ledger, cache.policy
    allowed = 0
    for t in policy.tiers:
        if ledger.has_tier(t):
            allowed |= 1 << t
    ckpt_allowed = 0
    for t in policy.checkpoint_tiers or policy.tiers:
        ckpt_allowed |= 1 << t
    used = {pool: 0 for pool in ledger.capacity_bytes}
    protected = {pool: 0 for pool in ledger.capacity_bytes}
    live_entries = cache.evictor.live_units()
    block_pages = cache.config.block_pages if policy.block_granular and not policy.partial_block_hits else 1
    num_nodes = 0
    for node in tree.iter_nodes():
        num_nodes += 1
        parent = node.parent
        # I4: structure
        if not node.keys:
            _fail("I4", f"{node} has an empty edge")
        if parent.children.get(node.keys[0]) is not node:
            _fail("I4", f"{node} is not its parent's child under its first key")
        if node.depth_pages != parent.depth_pages + len(node.keys):
            _fail("I4", f"{node} depth does not equal parent depth + edge length")
        # I3: KV resident somewhere, only in the policy's tiers
        if node.kv_mask == 0:
            _fail("I3", f"{node} has no KV copy in any tier")
        if (node.kv_mask | node.ckpt_mask) & ~allowed:
            _fail("I3", f"{node} has a copy in a tier the policy does not use")
        # I11: checkpoints only in the tiers the policy keeps them in (HiState: device and SSD)
        if node.ckpt_mask & ~ckpt_allowed:
            _fail("I11", f"{node} holds a checkpoint in a tier its policy keeps none in")
        # I8: states only where the policy admits them
        if node.ckpt_mask and policy.dense_checkpoints:
            _fail("I8", f"{node} holds an explicit checkpoint under a dense policy")
        if node.ckpt_mask and node.depth_pages % block_pages:
            _fail("I8", f"{node} holds a checkpoint off the {block_pages}-page block grid")
        # I5: path locks
        if node.lock_count < 0:
            _fail("I5", f"{node} lock count {node.lock_count} < 0")
        if parent.parent is not None and node.lock_count > parent.lock_count:
            _fail("I5", f"{node} is locked more than its parent")
        if cache.num_open_leases == 0 and node.lock_count != 0:
            _fail("I5", f"{node} still locked with no request open")
        for t in tiers_in(node.kv_mask):
            pool = ledger.pool_of(t, ItemKind.KV)
            used[pool] += node.num_pages * cache.config.kv_bytes_per_page
            if node.lock_count:
                protected[pool] += node.num_pages * cache.config.kv_bytes_per_page
        for t in tiers_in(node.ckpt_mask):
            pool = ledger.pool_of(t, ItemKind.CHECKPOINT)
            used[pool] += cache.config.checkpoint_size_bytes
            if node.lock_count:
                protected[pool] += cache.config.checkpoint_size_bytes
        # I7: every evictable unit is offered to the victim heaps
        if not node.lock_count and not node.is_parked:
            for unit, t in units_of(node, policy.partitioned):
                if (id(node), unit, t) not in live_entries:
                    _fail("I7", f"{node} unit {unit.value}@{Tier(t).name} missing from the victim heap")
    if num_nodes != tree.num_nodes:
        _fail("I4", f"tree counts {tree.num_nodes} nodes but holds {num_nodes}")
    for pool, capacity in ledger.capacity_bytes.items():
        # I2: the ledger is the sum of the items; I1: never above capacity, reservations included
        if ledger.used_bytes[pool] != used[pool]:
            _fail("I2", f"pool {pool}: ledger says {ledger.used_bytes[pool]} B, items sum to {used[pool]} B")
        reserved = ledger.reserved_bytes[pool]
        if reserved < 0 or used[pool] + reserved > capacity:
            _fail("I1", f"pool {pool}: {used[pool]} B used + {reserved} B reserved > capacity {capacity} B")
        # I10: protected bytes are exactly the copies held by pinned nodes
        if ledger.protected_bytes[pool] != protected[pool]:
            _fail("I10", f"pool {pool}: ledger protects {ledger.protected_bytes[pool]} B, "
                         f"pinned copies sum to {protected[pool]} B")
    if cache.sessions is not None:
        _check_holds(cache.sessions, tree)


def _check_holds(refs, tree) -> None:
    """I13: each node's hold counts are what the registered leaves say (sessions.py): `session_ref` one
    per (holder, KV leaf) at or below it, `state_session_ref` one per holder whose state leaf it is, and
    every leaf is a live node of the tree."""
    kv, state = {}, {}
    for leaves in refs.kv_leaves.values():
        for leaf in leaves:
            if not leaf.is_alive:
                _fail("I13", f"{leaf} is a hold's KV leaf but left the tree")
            node = leaf
            while node is not None and node.parent is not None:
                kv[node] = kv.get(node, 0) + 1
                node = node.parent
    for leaves in refs.state_leaves.values():
        for leaf in leaves:
            if not leaf.is_alive:
                _fail("I13", f"{leaf} is a hold's state leaf but left the tree")
            state[leaf] = state.get(leaf, 0) + 1
    for node in tree.iter_nodes():
        if node.session_ref != kv.get(node, 0) or node.state_session_ref != state.get(node, 0):
            _fail("I13", f"{node} holds {node.session_ref} KV / {node.state_session_ref} state references, "
                         f"its leaves say {kv.get(node, 0)} / {state.get(node, 0)}")
