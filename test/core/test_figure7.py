"""Paper Figure 7: with one checkpoint slot to free, HiState evicts S2, LRU evicts S1 and
LRU + refresh-all evicts S6 (C's terminal state, with its bundle)."""
import pytest

from histate.core import HybridPrefixCache, Tier, make_policy
from histate.core.policies.histate import HiStateLruDisk

from .helpers import CKPT_BYTES, KV_PAGE_BYTES, serve, tiny_config

B = [("b", i) for i in range(80)]
C = [("c", i) for i in range(30)]
USED_BYTES = (80 + 30) * KV_PAGE_BYTES + 4 * CKPT_BYTES  # B's and C's KV, S1 S2 S3 S6


class LruRefreshAll(HiStateLruDisk):
    name = "lru-refresh-all"
    refresh_all = True


def figure7_cache(policy) -> HybridPrefixCache:
    cfg = tiny_config(gpu_pages=USED_BYTES // KV_PAGE_BYTES)
    cache = HybridPrefixCache(cfg, policy)
    serve(cache, B[:40], 1.0, [40])  # S1
    serve(cache, B[:44], 2.0, [44])  # S2, close to S1
    serve(cache, B[:80], 3.0, [80])  # S3, B's terminal state
    serve(cache, C[:30], 4.0, [30])  # S6, C's terminal state; then C waits for a tool
    serve(cache, B[:80], 10.0, [])  # B appends again: a hit at S3
    assert cache.ledger.used_bytes[Tier.GPU] == USED_BYTES
    cache.check_invariants()
    return cache


def surviving_states(cache) -> set:
    names = {"S1": B[:40], "S2": B[:44], "S3": B[:80], "S6": C[:30]}
    return {name for name, keys in names.items() if cache.match(keys).num_reused_pages == len(keys)}


@pytest.mark.parametrize(
    "policy, evicted",
    [(make_policy("histate"), "S2"), (make_policy("histate-lru-disk"), "S1"), (LruRefreshAll(), "S6")],
    ids=["histate", "lru", "lru-refresh-all"],
)
def test_figure7_each_policy_frees_one_checkpoint_slot(policy, evicted):
    cache = figure7_cache(policy)
    assert cache.evict(Tier.GPU, CKPT_BYTES, now_s=11.0)
    cache.check_invariants()
    assert surviving_states(cache) == {"S1", "S2", "S3", "S6"} - {evicted}


def test_histate_fork_at_s2_resumes_from_s1_after_sparsification():
    cache = figure7_cache(make_policy("histate"))
    cache.evict(Tier.GPU, CKPT_BYTES, now_s=11.0)
    result = cache.match(B[:44] + [("fork", 0)])
    assert (result.num_kv_pages, result.num_reused_pages) == (44, 40)
