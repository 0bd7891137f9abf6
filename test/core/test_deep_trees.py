"""Trees deeper than Python's recursion limit: the core walks them without recursing.

Checkpoint-less interior nodes arise at branch points; once the checkpoints between them are evicted they
chain as deep as the tree. A replay of the gpu30 row with a 1 TB host and a 10 TB SSD (nothing ever dropped)
built such a chain and died in `pages_until_checkpoint` with RecursionError; SGLang's tree, which never
merges nodes, is deeper still, and there the same walk runs inside the scheduler (eq. 7's hit share).
"""
import sys

from histate.core.tree import Node
from histate.core.types import UnitKind
from histate.core.units import hit_share, pages_until_checkpoint

DEPTH = 3 * sys.getrecursionlimit()


def _branching_chain(depth: int, checkpoint_at: int = -1):
    """A chain of `depth` one-page nodes under a root, each also holding a one-page side leaf (a branch
    point), with a checkpoint on the chain node at `checkpoint_at` (none if -1)."""
    root = Node(0, [], None, 0, 0.0)
    parent, chain = root, []
    for i in range(depth):
        node = Node(2 * i + 1, [i], parent, i + 1, 0.0)
        parent.children[("c", i)] = node
        side = Node(2 * i + 2, [-i - 1], parent, i + 1, 0.0)
        parent.children[("s", i)] = side
        if i == checkpoint_at:
            node.ckpt_mask = 1
        chain.append(node)
        parent = node
    return root, chain


def test_a_chain_deeper_than_the_recursion_limit_is_walked():
    root, chain = _branching_chain(DEPTH)
    assert pages_until_checkpoint(chain[0]) == DEPTH  # one page per node down to the last leaf
    assert pages_until_checkpoint(chain[-1]) == 1


def test_the_walk_stops_at_the_first_checkpoint_of_each_branch():
    stop = DEPTH // 2
    _, chain = _branching_chain(DEPTH, checkpoint_at=stop)
    assert pages_until_checkpoint(chain[0]) == stop + 1  # nodes 0..stop, the checkpointed one included
    assert pages_until_checkpoint(chain[stop + 1]) == DEPTH - stop - 1  # below it: to the last leaf


def test_eq7s_hit_share_of_a_checkpoint_above_the_chain():
    root, chain = _branching_chain(DEPTH)
    top = chain[0]
    top.ckpt_mask = 1  # a checkpoint at depth 1 above a DEPTH-1 page checkpoint-less chain
    span = (DEPTH - 1) + 1  # the chain below it, and its one-page side leaf
    share = hit_share(top, UnitKind.CHECKPOINT, terminal_prob=0.0)  # the interior share, nothing learned
    assert abs(share - span / (top.depth_pages + span)) < 1e-12
