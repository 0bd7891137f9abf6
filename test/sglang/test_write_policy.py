"""HiState picks HiCache's host write policy when the operator gave none (sglang_plugin/write_policy.py,
the rule of core/write_policy.py): write_back with an SSD tier, no L3 and a host KV pool at most 1.8x the
device pool; otherwise SGLang's write_through, and an explicit `--hicache-write-policy` always wins.

The expectation is computed here from the pools SGLang built (host KV tokens x KV bytes per token against
the device's KV and state bytes), not by the rule's module."""
from __future__ import annotations

import pytest

from sglang_cpu.hicache import build_hicache, drain_backups
from sglang_cpu.pools import PAGE, Driver, build_pools

from .test_accepted_configs import stock_server_args_path


def _parse(argv: list):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *argv])


@stock_server_args_path
def test_the_command_line_tells_a_given_policy_from_sglangs_default(sglang_plugins):
    from histate.sglang_plugin.write_policy import AUTO_ATTR

    assert getattr(_parse(["--enable-histate"]), AUTO_ATTR) is True
    for argv in (["--hicache-write-policy", "write_through"], ["--hicache-write-policy=write_back"]):
        record = _parse(["--enable-histate", *argv])
        assert getattr(record, AUTO_ATTR) is False, argv
        assert record.hicache_write_policy == argv[-1].split("=")[-1]  # the value is SGLang's, unchanged
    assert _parse([]).hicache_write_policy == "write_through"


def test_a_record_without_the_stash_is_the_operators_choice():
    """Engine(**kwargs) and series 0003 records carry no stash: HiState never switches them."""
    from types import SimpleNamespace

    from histate.sglang_plugin.write_policy import choose_write_policy

    assert choose_write_policy(SimpleNamespace(cache_controller=object()), SimpleNamespace()) is None


def _cache(tmp_path, hicache_ratio: float, write_policy: str = "auto", ssd: bool = True, **flags):
    from histate.sglang_plugin.config import resolve_config
    from histate.sglang_plugin.server_settings import storage_extra_config

    ssd_flags = {"ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file", "ssd_size_bytes": "64MiB"} if ssd else {}
    config = resolve_config({"enable": True, **ssd_flags, **flags}, {})
    pools = build_pools(1024, 8)
    storage = storage_extra_config(None, config) if config.has_ssd else None
    return build_hicache("histate", pools, histate_config=config, storage_extra=storage,
                         hicache_ratio=hicache_ratio, write_policy=write_policy), pools


def _host_to_device(cache, pools) -> float:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    kv_bytes_per_token = pools.allocator.get_kvcache().full_kv_pool.k_buffer[0][0].numel() * 2 * \
        pools.allocator.get_kvcache().full_kv_pool.k_buffer[0].element_size() * \
        len(pools.allocator.get_kvcache().full_kv_pool.k_buffer)
    host_tokens = cache.host_pool_group.get_pool(PoolName.KV).size
    mamba = pools.req_to_token_pool.mamba_pool
    state_bytes = sum(t[:, 0].numel() * t.element_size() for t in (mamba.mamba_cache.temporal, *mamba.mamba_cache.conv))
    device = pools.allocator.size * kv_bytes_per_token + mamba.size * state_bytes
    return host_tokens * kv_bytes_per_token / device


def _runs_write_back(cache) -> bool:
    flags = (cache.cache_controller.write_policy == "write_back", cache.is_write_back,
             cache.tree_core.is_write_back, cache.histate.write_back,
             cache.histate.ssd_tier is not None and cache.histate.ssd_tier.state_writes is not None)
    assert len(set(flags)) == 1, flags  # SGLang's three settings and HiState's two agree
    return flags[0]


def test_a_short_host_runs_write_back_and_a_roomy_one_write_through(tmp_path):
    short, pools = _cache(tmp_path / "a", hicache_ratio=1.2)
    assert _host_to_device(short, pools) <= 1.8 and _runs_write_back(short)
    assert short.histate.metrics.totals[("host_write_policy", "write_back", "histate")] == 1  # on /metrics
    assert short.write_through_threshold in (1, 2)  # the rig sets its own threshold after init
    roomy, pools = _cache(tmp_path / "b", hicache_ratio=3.0)
    assert _host_to_device(roomy, pools) > 1.8 and not _runs_write_back(roomy)
    assert roomy.histate.metrics.totals[("host_write_policy", "write_through", "histate")] == 1


def test_an_explicit_policy_no_ssd_or_an_l3_keep_write_through(tmp_path, mooncake, monkeypatch):
    from .test_l3_mooncake import _use

    given, _ = _cache(tmp_path / "a", hicache_ratio=1.2, write_policy="write_through")
    assert not _runs_write_back(given)
    assert given.histate.metrics.totals[("host_write_policy", "write_through", "operator")] == 1
    no_ssd, _ = _cache(tmp_path / "b", hicache_ratio=1.2, ssd=False)
    assert no_ssd.cache_controller.write_policy == "write_through" and not no_ssd.is_write_back
    assert not no_ssd.histate.write_back
    _use(mooncake, monkeypatch)
    with_l3, _ = _cache(tmp_path / "c", hicache_ratio=1.2, l3="mooncake")
    assert with_l3.histate.ssd_tier.backend.l3 is not None and not _runs_write_back(with_l3)


def test_the_switched_cache_serves_as_write_back(tmp_path):
    """A request on the switched cache: nothing is copied to the host at insert (write_back), and its
    checkpoint goes to the SSD at creation (HiState's state writes)."""
    cache, pools = _cache(tmp_path, hicache_ratio=1.2)
    driver = Driver(cache, pools)
    tokens = list(range(1000, 1000 + 4 * PAGE))
    driver.serve(tokens, [len(tokens)])
    drain_backups(cache)
    assert cache.cache_controller.mem_pool_host.entries  # host pools exist
    writes = cache.histate.metrics.totals
    assert writes.get(("state_writes_total", "stored"), 0) >= 1, writes
    from sglang.srt.mem_cache.hicache_storage import PoolName

    host_kv = cache.host_pool_group.get_pool(PoolName.KV)
    assert host_kv.available_size() == host_kv.size  # no KV mirrored to the host


def test_two_tp_ranks_with_hosts_sized_apart_take_one_policy(tmp_path):
    """Each rank sizes its host from its own headroom: a rank whose host alone is short (1.2x) and one whose
    host alone is roomy (3x) both take write_back, the shorter host's choice (the MIN over the ranks), through
    test_rank_agreement.py's two-thread all-reduce. Each alone: test_a_short_host_runs_write_back_..."""
    from histate.sglang_plugin.config import resolve_config

    from .test_rank_agreement import Rank, TwoRankGroup, _build_in_lockstep

    group = TwoRankGroup()
    configs = [resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / f"rank{r}")], "ssd_backend": "file",
                               "ssd_size_bytes": "64MiB"}, {}) for r in (0, 1)]
    ranks = _build_in_lockstep(group, lambda r: Rank(r, group, {}, ssd_config=configs[r], write_policy="auto",
                                                     hicache_ratio=(1.2, 3.0)[r]))
    assert [_runs_write_back(rank.cache) for rank in ranks] == [True, True]
