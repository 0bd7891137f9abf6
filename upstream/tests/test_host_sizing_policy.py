"""The test that ships with upstream/series 0011 ([hybrid pool] the cache sizes its host pools).

Written as it would sit in SGLang's own test tree (no HiState import): stock `UnifiedRadixCache` (Full + Mamba,
Python tree core) with SGLang's host tier on CPU (the test support's CPU stand-ins). The expected pool sizes
are computed from the byte sizes the test asks for and each host pool's bytes per token, the way the host
pools document their sizing (``host_size * 1e9 // size_per_token``, then a page more), not read back from the
code under test.
"""
from __future__ import annotations

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_cpu.hicache import HICACHE_ARGS, _cpu_hicache
from sglang_cpu.pools import PAGE, build_pools, cache_params, publish_server_args

RATIO = 2.0


class SizedCache(UnifiedRadixCache):
    """A cache that answers the host-sizing question with fixed sizes, and records what it was asked."""

    sizes = None
    asked = []

    def host_pool_sizes(self, kv_pool, state_pool):
        SizedCache.asked.append((kv_pool, state_pool))
        return self.sizes


def hicache(cache_class, pools):
    server_args = publish_server_args(page_size=pools.page_size, chunk_tokens=max(16, pools.page_size),
                                      **{**HICACHE_ARGS, "hicache_ratio": RATIO})
    cache = cache_class(cache_params(pools))
    with _cpu_hicache():
        cache.init_hicache(server_args, cache_params(pools))
    return cache


def host_pools(cache):
    return cache.host_pool_group.get_pool(PoolName.KV), cache.host_pool_group.get_pool(PoolName.MAMBA)


def pool_size(host_size_gb: float, size_per_token: int, page_size: int) -> int:
    tokens = int(host_size_gb * 1e9 // size_per_token)
    return (tokens // page_size + 1) * page_size


@pytest.fixture
def pools():
    return build_pools(64 * PAGE, 16)


def test_a_cache_without_an_answer_keeps_sglangs_rule(pools):
    kv, mamba = host_pools(hicache(UnifiedRadixCache, pools))
    assert UnifiedRadixCache(cache_params(pools)).host_pool_sizes(None, None) is None
    assert kv.size >= RATIO * pools.allocator.size  # each host pool mirrors its device pool, times the ratio
    assert mamba.size >= RATIO * pools.mamba_pool.size


def test_the_cache_sizes_the_host_pools_of_a_hybrid_stack(pools):
    kv_stock, mamba_stock = host_pools(hicache(UnifiedRadixCache, pools))
    kv_gb = 3 * kv_stock.size * kv_stock.size_per_token / 1e9  # three times SGLang's KV host pool
    mamba_gb = 2.5 * mamba_stock.size_per_token / 1e9  # two and a half state slots
    SizedCache.sizes, SizedCache.asked = (kv_gb, mamba_gb), []
    cache = hicache(SizedCache, pools)
    kv, mamba = host_pools(cache)
    assert len(SizedCache.asked) == 1
    asked_kv, asked_state = SizedCache.asked[0]
    assert asked_state is pools.mamba_pool and asked_kv is not None
    assert kv.size == pool_size(kv_gb, kv.size_per_token, kv.page_size)
    assert mamba.size == pool_size(mamba_gb, mamba.size_per_token, mamba.page_size)
    assert kv.size > 2.9 * kv_stock.size and mamba.size < mamba_stock.size
