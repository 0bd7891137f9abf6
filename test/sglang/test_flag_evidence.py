"""Why `--enable-histate` refuses `--enable-int8-mamba-checkpoint` and `--hicache-host-memory-mode
buffer_only`: the facts behind each message, checked on SGLang 0.5.23's own objects (stock cache, no
HiState), so a later SGLang that changes them fails here and the refusal gets revisited. The refusals
themselves are tested in test_plugin_cli.py; docs/sglang.md ("SGLang flags with --enable-histate") cites
these tests.
"""
from __future__ import annotations

import dataclasses

import pytest

from ._sglang_kit import FULL_MAMBA_CONFIGS, kit_on_cpu


def _int8_cache_with_a_checkpoint():
    """SGLang's kit fixture with `--enable-int8-mamba-checkpoint` (a MambaCheckpointPool beside the active
    MambaPool) and one finished request cached through `release`'s checkpoint path (finish_req)."""
    from sglang.test.kits.unified_radix_cache.core import UnifiedRadixCacheInt8MambaCheckpointFixtures
    from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

    cfg = dataclasses.replace(FULL_MAMBA_CONFIGS[0], enable_int8_mamba_checkpoint=True)
    with kit_on_cpu("stock"):
        cache, allocator, pool = build_fixture(cfg)
    ckpt_free, active_free = pool.mamba_ckpt_pool.available_size(), pool.mamba_allocator.available_size()
    kit = UnifiedRadixCacheInt8MambaCheckpointFixtures()
    kit.assertIsNotNone = lambda value: None  # a unittest mixin; the kit asserts allocation succeeded
    tokens = list(range(1, 13))
    kit._finished_req(cache, allocator, pool, tokens)
    node = cache.tree_core.node_by_id(match_prefix(cache, tokens).last_device_node)
    return cfg, cache, allocator, pool, node, (ckpt_free, active_free)


def test_sglang_int8_checkpoints_live_in_a_pool_its_host_tier_does_not_read(sglang_plugins):
    """With int8 checkpoints a cached state is a MambaCheckpointPool slot (int8 data + per-(head, k) scales,
    components/mamba.py:567-575), but SGLang's host tier, which HiState moves every checkpoint through
    (device -> host -> SSD), is built over the active MambaPool's tensors (hybrid_pool_assembler.py:1298)
    and backs a node up by its slot number (`build_hicache_transfers` BACKUP_HOST, components/mamba.py:
    876-885): it would copy an unrelated bf16/fp32 row of the active pool to host and SSD."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.unified_cache.components import CacheTransferPhase, ComponentType

    from sglang_cpu.hicache import attach_hicache, hicache_server_args
    from sglang_cpu.pools import Pools

    cfg, cache, allocator, pool, node, (ckpt_free, active_free) = _int8_cache_with_a_checkpoint()
    value = node.component_data[ComponentType.MAMBA].value
    assert pool.mamba_ckpt_pool.available_size() == ckpt_free - 1  # the state went to the int8 pool ...
    assert pool.mamba_allocator.available_size() == active_free  # ... and the request's active slot came back
    assert pool.mamba_ckpt_pool.temporal.qdata.dtype == torch.int8

    server_args = hicache_server_args(cfg.page_size, 64, enable_int8_mamba_checkpoint=True)
    attach_hicache(cache, Pools(pool, allocator.get_kvcache(), allocator, cfg.page_size), server_args)
    host = cache.host_pool_group.entry_map[PoolName.MAMBA].host_pool
    active = pool.mamba_pool.mamba_cache.temporal
    assert host.temporal_dtype == active.dtype != torch.int8
    assert host.temporal_device_layers[0].data_ptr() == active[0].data_ptr()  # the host mirrors the active pool
    [backup] = cache.components[ComponentType.MAMBA].build_hicache_transfers(node, CacheTransferPhase.BACKUP_HOST)
    assert backup.device_indices.tolist() == value.tolist()  # the int8 slot number, read in the active pool


def test_sglang_int8_checkpoint_slots_cost_the_bytes_its_estimator_reports(sglang_plugins):
    """What int8 would buy: SGLang's own estimator (mamba_checkpoint_pool.py:262-294) for the reference model,
    Qwen3.5-9B (24 Gated-DeltaNet layers, 32 value heads of 128 x 128, a 3 x 8192 bf16 conv window), against
    the active slot: 13.5 MiB instead of 49.1 MiB with fp32 states (3.6x), 13.3 instead of 25.1 MiB with bf16
    (1.9x). And the kit's pool really holds that many bytes per slot."""
    import torch
    from sglang.srt.mem_cache.mamba_checkpoint_pool import MambaCheckpointPool

    layers, heads, d_v, d_k, conv = 24, 32, 128, 128, [(8192, 3)]
    mib = {}
    for dtype in (torch.float32, torch.bfloat16):
        est = MambaCheckpointPool.estimate_mem_usage_bytes(
            num_layers=layers, num_slots=0, num_heads=heads, head_v_dim=d_v, head_k_dim=d_k, conv_shapes=conv,
            conv_dtype=torch.bfloat16, temporal_dtype=dtype)  # num_slots=0: the one reserved slot, i.e. one slot
        active = layers * (heads * d_v * d_k * dtype.itemsize + 8192 * 3 * 2)
        mib[dtype] = (est["total"] / 2**20, active / 2**20)
    assert mib[torch.float32] == (13.5, 49.125) and mib[torch.bfloat16] == (13.3125, 25.125)

    _, _, _, pool, _, _ = _int8_cache_with_a_checkpoint()
    ckpt = pool.mamba_ckpt_pool
    slots = ckpt.num_slots + 1
    temporal = ckpt.temporal
    expected = temporal.qdata[:, 0].numel() + temporal.scale[:, 0].numel() * temporal.scale.element_size() + sum(
        c[:, 0].numel() * c.element_size() for c in ckpt.conv)
    assert ckpt.mem_usage_bytes() == slots * expected


def _hybrid_model(tmp_path):
    from .test_plugin_cli import _hybrid_model as write

    return write(tmp_path)


@pytest.mark.parametrize("argv, says", [
    (["--enable-hierarchical-cache", "--hicache-ratio", "2"], "not supported together with --enable-hierarchical-cache"),
    (["--radix-cache-backend", "histate"], "only supports the built-in mamba radix cache"),
])
def test_sglang_itself_refuses_int8_checkpoints_with_a_host_tier_or_another_cache(sglang_plugins, tmp_path, argv, says):
    """SGLang's resolver (arg_groups/mamba_hook.py:75-99), without HiState: both things --enable-histate
    turns on are refused next to --enable-int8-mamba-checkpoint; alone the flag resolves."""
    from sglang.srt.server_args import prepare_server_args

    base = ["--model-path", _hybrid_model(tmp_path), "--device", "cpu", "--skip-tokenizer-init",
            "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule", "--enable-int8-mamba-checkpoint"]
    prepare_server_args(base).resolve_once()
    with pytest.raises(ValueError, match=says):
        prepare_server_args([*base, *argv]).resolve_once()


def test_sglang_buffer_only_host_memory_keeps_no_cached_data_in_dram(sglang_plugins, tmp_path, monkeypatch):
    """`--hicache-host-memory-mode buffer_only` on SGLang's own cache: a request's KV and state go to storage
    (SGLang's file backend), the tree holds no host copy of either, and host eviction has nothing to free
    (unified_radix_cache.py:1437-1440). HiState's host tier keeps reusable KV there and lands SSD-restored
    checkpoints as a node's host copy; neither can exist in this mode."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from sglang_cpu.hicache import HICACHE_ARGS, attach_hicache
    from sglang_cpu.pools import PAGE, Driver, build_cache, build_pools, publish_server_args

    storage = tmp_path / "l3"
    storage.mkdir()
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(storage))
    pools = build_pools(64 * PAGE, 8)
    server_args = publish_server_args(page_size=PAGE, chunk_tokens=PAGE,
                                      **{**HICACHE_ARGS, "hicache_host_memory_mode": "buffer_only"},
                                      hicache_storage_backend="file", hicache_storage_prefetch_policy="wait_complete")
    cache = attach_hicache(build_cache("stock", pools), pools, server_args)
    assert cache.host_memory_mode == "buffer_only" and cache.tree_core.is_host_memory_buffer_only
    driver = Driver(cache, pools)
    tokens = list(range(1000, 1000 + 4 * PAGE))
    driver.serve(tokens, [len(tokens)])
    files = []
    for _ in range(500):  # scheduler steps until SGLang's storage writes landed
        cache.check_hicache_events()
        files = sorted(p.name for p in storage.iterdir())
        if len(files) == 5:
            break
        import time

        time.sleep(0.01)
    assert sum(".mamba" in f for f in files) == 1 and len(files) == 5  # 4 KV pages + the state, in storage
    node = cache.tree_core.node_by_id(driver.match(tokens).last_device_node)
    assert node.component_data[ComponentType.FULL].host_value is None
    assert node.component_data[ComponentType.MAMBA].host_value is None
    assert cache.evict_host(len(tokens)) == 0
