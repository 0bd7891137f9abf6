"""Eviction units and their cost terms (paper §3.3, eq. 7), as pure functions of the tree.

Units in a pool (a tier, or a (tier, kind) pair under a static split):
  BUNDLE      the KV copy of a node that is a leaf *within that tier* (no child has KV there), plus
              its checkpoint copy there when the node is a true leaf (the terminal bundle);
  CHECKPOINT  a checkpoint copy that is not part of a bundle (intermediate, or terminal whose KV
              lives in another tier; every checkpoint under a static split).

C (expected extra recompute, tokens) weights each reuse position by its access probability:
a trajectory's terminal position gets q (EMA of observed terminal hits); the interior positions share
1 - q. The paper spreads that share uniformly over the L positions of the trajectory; HiState's
learned reuse-position prior (policy_state.py) gives the k-th position before the trajectory's end the
learned share p'_k of it and spreads only the rest, 1 - sum(p'), uniformly. With no near-end mass
learned this is exactly the paper's rule. M is what leaves the constrained pool, in tokens of KV.
"""
from __future__ import annotations

from .tree import Node
from .types import UnitKind


def prev_checkpoint_depth(node: Node) -> int:
    """Depth of the nearest checkpoint strictly above `node` (0: the empty prefix)."""
    parent = node.parent
    while parent is not None and parent.parent is not None:
        if parent.ckpt_mask:
            return parent.depth_pages
        parent = parent.parent
    return 0


def pages_until_checkpoint(node: Node) -> int:
    """Pages from the start of `node` to the first checkpoint (or leaf end) below it, the longest branch.

    An explicit stack, not recursion: checkpoint-less interior nodes arise at branch points, and once the
    checkpoints between them are evicted they chain as deep as the tree (a replay with a 1 TB host on the
    gpu30 row built one past Python's recursion limit; SGLang's tree, which never merges, is deeper still).
    """
    if node.ckpt_mask or not node.children:
        return len(node.keys)
    longest = 0
    stack = [(node, 0)]
    while stack:
        current, above = stack.pop()
        through = above + len(current.keys)
        if current.ckpt_mask or not current.children:
            if through > longest:
                longest = through
            continue
        stack.extend((child, through) for child in current.children.values())
    return longest


def is_tier_leaf(node: Node, bit: int) -> bool:
    for child in node.children.values():
        if child.kv_mask & bit:
            return False
    return True


_SET_BITS = tuple(tuple(t for t in range(3) if mask >> t & 1) for mask in range(8))


def units_of(node: Node, partitioned: bool) -> list:
    """(unit kind, tier index) for every unit `node` currently forms. Hot path: loops over the
    tiers the node actually occupies only."""
    units = []
    kv_mask, ckpt_mask, children = node.kv_mask, node.ckpt_mask, node.children
    for t in _SET_BITS[kv_mask | ckpt_mask]:
        bit = 1 << t
        if kv_mask & bit:
            for child in children.values():
                if child.kv_mask & bit:
                    break
            else:
                units.append((UnitKind.BUNDLE, t))
        if ckpt_mask & bit and (partitioned or not (kv_mask & bit and not children)):
            units.append((UnitKind.CHECKPOINT, t))
    return units


def last_access_s(node: Node, unit: UnitKind, bit: int) -> float:
    if unit is UnitKind.CHECKPOINT:
        return node.ckpt_access_s
    if not node.children and node.ckpt_mask & bit:
        return max(node.kv_access_s, node.ckpt_access_s)
    return node.kv_access_s


def checkpoint_neighbours(node: Node):
    """The nodes whose units a checkpoint appearing at `node` can make cheaper to lose (paper §3.3:
    affected costs are updated without touching timestamps): `node`, its ancestors up to and including
    the previous checkpoint (their span now stops at `node`), and every descendant down to and
    including the next checkpoint on each branch (their gap now starts at `node`; a checkpoint-less
    child is passed through, the checkpointed node below it is affected too). A victim heap re-offers
    them (victims.reoffer): the lazy heaps stay exact only if every unit whose score can fall is."""
    yield node
    parent = node.parent
    while parent.parent is not None:
        yield parent
        if parent.ckpt_mask:
            break
        parent = parent.parent
    below = list(node.children.values())
    while below:
        child = below.pop()
        yield child
        if not child.ckpt_mask:
            below.extend(child.children.values())


def checkpoints_above_removed_leaf(node: Node, removed_end: int, reach: int):
    """The checkpointed nodes at or above `node` whose C can fall when a leaf ending at depth
    `removed_end` (node units) leaves `node`'s subtree: the nearest one (its span shrinks) and, with a
    learned near-end prior reaching `reach` units before a trajectory's end (0 without one), every one
    above it that served a near-end position of the removed trajectory -- up to and including the first
    at or above `removed_end - reach` (`served_near_end_mass`). A victim heap re-offers them."""
    top = removed_end - reach
    while node.parent is not None:
        if node.ckpt_mask:
            yield node
            if node.depth_pages <= top:
                return
        node = node.parent


def checkpoint_at_or_above(node: Node):
    """The nearest node at or above `node` holding a checkpoint, or None. Its span, and with it its C,
    shrinks when `node`'s subtree loses a leaf."""
    while node.parent is not None and not node.ckpt_mask:
        node = node.parent
    return None if node.parent is None else node


def end_offset_pages(node, match_pages: int, window_pages: int):
    """Pages from `match_pages` (a position inside `node`'s edge or at its end) to the end of the most
    recently used trajectory below it, or None when farther than `window_pages` (or no node)."""
    if node is None:
        return None
    offset = node.depth_pages - match_pages
    while node.children:
        if offset > window_pages:
            return None
        node = max(node.children.values(), key=_kv_access)
        offset += len(node.keys)
    return offset if offset <= window_pages else None


def _kv_access(node) -> float:
    return node.kv_access_s


def served_near_end_mass(node: Node, near_end_probs: tuple, stride: int = 1) -> float:
    """Sum of p'_k over the near-end positions P_k = (T // stride - k) * stride of the trajectory ends T
    below (k pages before T; `stride` node units per page) that a checkpoint at the end of `node`
    serves: those between it and the next checkpoint below on the way to T."""
    window = len(near_end_probs)
    base = node.depth_pages
    reach = (window + 1) * stride - 1  # a subtree starting this far past `stop` has no P_k below it
    mass = 0.0
    stack = [(child, None) for child in node.children.values()]
    while stack:
        n, stop = stack.pop()
        if stop is None and n.ckpt_mask and n.children:
            stop = n.depth_pages  # hits at or below here resume from that checkpoint instead
        if n.children:
            if stop is None or n.depth_pages - len(n.keys) < stop + reach:
                stack.extend((c, stop) for c in n.children.values())
            continue
        top = n.depth_pages // stride
        for k in range(1, window + 1):
            position = (top - k) * stride
            if position < base:
                break
            if stop is None or position < stop:
                mass += near_end_probs[k - 1]
    return mass


def hit_share(node: Node, unit: UnitKind, terminal_prob: float, near_end_probs: tuple = (),
              near_end_stride: int = 1) -> float:
    """The expected number of a trajectory's hits (per hit on it) that need unit x: q for its terminal
    state, the interior share it serves for an intermediate checkpoint, 1 for interior KV (every hit
    below passes through it), 0 for a leaf's KV without its state (no hit can use it alone)."""
    if unit is UnitKind.BUNDLE:
        if node.children:
            return 1.0
        return terminal_prob if node.ckpt_mask else 0.0
    if not node.children:  # terminal checkpoint whose KV lives in another tier
        return terminal_prob
    span_pages = sum(pages_until_checkpoint(c) for c in node.children.values())
    near = sum(near_end_probs)
    share = (1.0 - near) * span_pages / (node.depth_pages + span_pages)
    if near > 1e-9:  # nothing learned yet: skip the walk (it would add 0)
        share += served_near_end_mass(node, near_end_probs, near_end_stride)
    return (1.0 - terminal_prob) * share


def expected_recompute_tokens(node: Node, unit: UnitKind, terminal_prob: float, page_num_tokens: int,
                              near_end_probs: tuple = (), near_end_stride: int = 1) -> float:
    """The paper's C_x: extra tokens recomputed, in expectation, if unit x disappears (each hit that
    needed it resumes at the previous checkpoint, a gap earlier)."""
    gap_pages = node.depth_pages - prev_checkpoint_depth(node)
    return hit_share(node, unit, terminal_prob, near_end_probs, near_end_stride) * gap_pages * page_num_tokens


_TIER_OF_BIT = {1: 0, 2: 1, 4: 2}


def expected_cost_tokens(node: Node, unit: UnitKind, bit: int, ctx) -> float:
    """C_x of eq. 7 in tokens of recompute time: what the hits that need x lose when x leaves the tier
    of `bit`. A unit evicted from the last tier is dropped: they recompute its gap (the paper's C). A
    unit evicted from a tier with a tier below is demoted there: they restore it from the slower tier
    instead, which costs its bytes times the difference of the tiers' restore costs (ScoringContext.
    restore_cost, in recompute-tokens per token of KV). Without restore costs every eviction is charged
    its recompute, as in the paper."""
    tier = _TIER_OF_BIT[bit]
    demotion = ctx.checkpoint_demotion_tier if unit is UnitKind.CHECKPOINT and ctx.checkpoint_demotion_tier \
        else ctx.demotion_tier
    lower = demotion[tier] if demotion else -1
    if lower < 0:
        return expected_recompute_tokens(node, unit, ctx.terminal_prob, ctx.page_num_tokens, ctx.near_end_probs,
                                         ctx.near_end_stride)
    moved = reclaim_tokens(node, unit, bit, ctx.page_num_tokens, ctx.checkpoint_token_equiv)
    share = hit_share(node, unit, ctx.terminal_prob, ctx.near_end_probs, ctx.near_end_stride)
    return share * moved * (ctx.restore_cost[lower] - ctx.restore_cost[tier])


def reclaim_tokens(node: Node, unit: UnitKind, bit: int, page_num_tokens: int, checkpoint_tokens: float) -> float:
    """M_x of eq. 7: what leaves the constrained pool, in tokens of KV."""
    if unit is UnitKind.CHECKPOINT:
        return checkpoint_tokens
    kv_tokens = len(node.keys) * page_num_tokens
    if not node.children and node.ckpt_mask & bit:
        return kv_tokens + checkpoint_tokens
    return kv_tokens
