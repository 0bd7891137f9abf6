"""`check_invariants` can fail: each check below is broken on purpose and must name its invariant."""
import pytest

from histate.core import InvariantViolation, Tier, make_cache

from .helpers import serve, tiny_config

A = [("a", i) for i in range(6)]


def _served(policy: str):
    cache = make_cache(policy, tiny_config(gpu_pages=64, cpu_pages=64, ssd_pages=64))
    serve(cache, A, 1.0, [4, 6])
    cache.check_invariants()
    path, _, _ = cache.tree.walk(list(A))
    return cache, path[0]  # visited first: its own check fails before any it corrupts below


def test_i11_a_histate_checkpoint_on_the_host_is_caught():
    cache, node = _served("histate")
    node.ckpt_mask |= 1 << Tier.CPU  # HiState's host state slots only stage transfers
    with pytest.raises(InvariantViolation, match="I11"):
        cache.check_invariants()


def test_i3_a_node_without_kv_is_caught():
    cache, node = _served("histate")
    node.kv_mask = 0
    with pytest.raises(InvariantViolation, match="I3"):
        cache.check_invariants()


def test_i5_a_negative_lock_count_is_caught():
    cache, node = _served("histate")
    node.lock_count = -1
    with pytest.raises(InvariantViolation, match="I5"):
        cache.check_invariants()
