"""Tool-wait residency (core/tool_wait.py): chains of turns inferred from the tree, their holds and
deadlines, and what a hold does to eviction.

Expectations are built from each stream by hand: which request resumes which turn end, which gaps
were observed, and (for eviction) a control cache without residency that takes the other victim, so
a hold that is not registered, not ranked or never released fails a test.
"""
from __future__ import annotations

import random

from histate.core import GPU_BIT, Tier, make_cache
from histate.core.tool_wait import CHAIN_HOLD_FACTOR, HOLD_KEY, HOLD_QUANTILE, GapPredictor, ToolWait

from .helpers import KV_PAGE_BYTES, tiny_config

A = [("a", i) for i in range(60)]
B = [("b", i) for i in range(60)]
C = [("c", i) for i in range(60)]
D = [("d", i) for i in range(60)]


class _Node:
    """The node shape ToolWait reads: parent and turn_end."""

    def __init__(self, parent=None):
        self.parent = parent
        self.turn_end = None


def _path(depth: int) -> list:
    root = _Node()
    nodes = [root]
    for _ in range(depth):
        nodes.append(_Node(nodes[-1]))
    return nodes


# --- the predictor -----------------------------------------------------------------------------------

def test_the_hold_bound_is_the_quantile_of_the_observed_waits():
    rng = random.Random(7)
    waits = [rng.expovariate(1 / 20) for _ in range(300)]
    gaps = GapPredictor()
    assert gaps.hold_s(()) == 0.0  # no evidence, nothing held
    for w in waits:
        gaps.observe(w)
    bound = gaps.bound_s
    assert sum(w <= bound for w in waits) >= HOLD_QUANTILE * len(waits)
    assert sum(w < bound for w in waits) < HOLD_QUANTILE * len(waits)
    assert gaps.hold_s((1.0, 2.0)) == bound  # a chain with short waits holds for the shared bound
    long_chain = (bound, 3 * bound)
    assert gaps.hold_s(long_chain) == CHAIN_HOLD_FACTOR * 3 * bound  # a slow chain holds longer


# --- chains --------------------------------------------------------------------------------------------

def _turn(wait, match_end, matched_s, tail, finish_s):
    """One request: matched at `matched_s` (ending at `match_end`), finished at `finish_s`."""
    return wait.on_turn_end(tail, wait.on_resume(match_end, matched_s), finish_s)


def test_a_resume_continues_the_chain_and_a_second_request_from_there_branches():
    wait = ToolWait()
    nodes = _path(4)
    assert _turn(wait, None, 0.0, nodes[3], 10.0) is None  # no wait observed yet: nothing held
    first = nodes[3].turn_end
    looked = wait.on_resume(nodes[3], 14.0)
    assert looked.turn is first and not first.is_consumed  # a lookup changes nothing (a refused admission)
    held = _turn(wait, nodes[3], 14.0, nodes[4], 20.0)  # resumed 4 s after the turn ended
    assert first.is_consumed and nodes[4].turn_end.chain_gaps_s == (4.0,)
    assert held == (HOLD_KEY, first.chain_id) and wait.is_waiting(held)
    branch = _turn(wait, nodes[3], 15.0, nodes[2], 21.0)  # a second request from the consumed turn
    assert branch not in (None, held) and nodes[2].turn_end.chain_gaps_s == ()
    assert wait.gaps.bound_s == 4.0  # one wait observed, not two
    # a match ending below a turn end, within the search, continues it
    deeper = _path(6)
    chain_id = _turn(wait, None, 30.0, deeper[2], 30.0)
    assert _turn(wait, deeper[6], 33.0, deeper[6], 34.0) == chain_id
    assert deeper[6].turn_end.chain_gaps_s == (3.0,)


def test_a_waiting_chain_expires_at_its_deadline_once_and_holds_again_under_a_new_id():
    wait = ToolWait()
    nodes = _path(3)
    _turn(wait, None, 0.0, nodes[2], 0.0)
    held = _turn(wait, nodes[2], 10.0, nodes[3], 10.0)  # one wait of 10 s: the bound 10, the chain's 2 x 10
    assert wait.is_waiting(held)
    assert wait.expired(10.0 + CHAIN_HOLD_FACTOR * 10.0 - 0.001) == []
    assert wait.expired(10.0 + CHAIN_HOLD_FACTOR * 10.0) == [held]
    assert wait.expired(1e9) == [] and not wait.is_waiting(held)
    again = _turn(wait, nodes[3], 40.0, nodes[3], 41.0)  # it came back after letting go
    assert again not in (None, held) and nodes[3].turn_end.chain_gaps_s == (10.0, 30.0)
    assert wait.counts() | {"resumes": 0, "turn_ends": 0} == {"held": 2, "back_in_time": 0, "back_late": 1, "expired": 1,
                                                               "resumes": 0, "turn_ends": 0}
    # a chain that comes back in time keeps its id, and its new deadline replaces the old one
    kept = _turn(wait, nodes[3], 42.0, nodes[3], 43.0)
    assert kept == again and wait.expired(43.0 + CHAIN_HOLD_FACTOR * 30.0 - 0.001) == []
    assert (wait.counts()["back_in_time"], wait.counts()["back_late"]) == (1, 1)


# --- what a hold does to eviction ---------------------------------------------------------------------

def _serve(cache, keys, now_s, positions):
    lease = cache.begin_request(keys, now_s)
    cache.finish_request(lease, keys, now_s, positions)
    cache.check_invariants()


def _stream(tool_wait: bool):
    """A's first turn (t=0) and its resume at t=5 (one observed wait of 5 s: A's chain holds its path
    until 5 + 2 x 5 = 15); B's first turn at t=6 (held with the shared bound, 5 s: until 11); D at t=12
    (B's hold has expired by then, A's has not) fills the device, so the next request must evict."""
    cache = make_cache("histate", tiny_config(40, cpu_pages=400, ssd_pages=800, tool_wait=tool_wait))
    _serve(cache, A[:10], 0.0, [10])
    _serve(cache, A[:20], 5.0, [20])
    _serve(cache, B[:10], 6.0, [10])
    return cache


def _on_gpu(cache, keys, depth) -> bool:
    path, pos, partial = cache.tree.walk(list(keys[:depth]))
    return pos == depth and partial is None and bool(path[-1].kv_mask & GPU_BIT)


def test_a_waiting_turns_path_outlives_an_older_unheld_one_and_goes_once_released():
    control = _stream(tool_wait=False)
    _serve(control, C[:10], 12.0, [10])
    assert not _on_gpu(control, A, 20) and _on_gpu(control, B, 10)  # eq. 7 alone takes A's leaf (older)
    cache = _stream(tool_wait=True)
    wait = cache.state.tool_wait
    assert wait.num_resumes == 1 and wait.is_waiting((HOLD_KEY, 1))  # A's chain (it held nothing after its first turn)
    _serve(cache, C[:10], 12.0, [10])
    assert _on_gpu(cache, A, 20) and not _on_gpu(cache, B, 10)  # A's chain waits, B's let go at t=11
    assert cache.tree.walk(list(A[:20]))[0][-1].session_ref == 1
    _serve(cache, D[:10], 16.0, [10])  # past A's deadline: its path is eq. 7's again, and oldest
    assert not _on_gpu(cache, A, 20)
    assert all(node.session_ref == 0 for node in cache.tree.iter_nodes() if node.depth_pages <= 20
               and node.keys[0][0] == "a")


def test_a_hold_is_an_order_never_a_pin():
    """Everything on the device held: eviction still frees what it is asked for."""
    cache = make_cache("histate", tiny_config(36, cpu_pages=400, ssd_pages=800, tool_wait=True))
    _serve(cache, A[:10], 0.0, [10])
    _serve(cache, A[:20], 100.0, [20])  # one wait of 100 s: every later turn holds for >= 100 s
    _serve(cache, B[:10], 101.0, [10])
    assert all(n.session_ref for n in cache.tree.iter_nodes() if n.kv_mask & GPU_BIT)
    assert cache.evict(Tier.GPU, 10 * KV_PAGE_BYTES, 102.0)
    cache.check_invariants()


def test_off_by_default_and_for_policies_that_do_not_read_it():
    assert make_cache("histate", tiny_config(36)).state.tool_wait is None
    assert make_cache("vllm-disk", tiny_config(36, cpu_pages=40, ssd_pages=80, tool_wait=True)).state.tool_wait is None
    assert make_cache("histate-exclusive", tiny_config(36, cpu_pages=40, ssd_pages=80, tool_wait=True)).state.tool_wait
