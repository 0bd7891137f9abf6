"""Shared builders for core tests: tiny byte sizes so capacities read as page counts."""
from histate.core import CacheConfig, Tier

PAGE_TOKENS = 64
KV_PAGE_BYTES = PAGE_TOKENS  # kv_bytes_per_token = 1
CKPT_BYTES = 4 * KV_PAGE_BYTES  # one checkpoint = 4 pages of KV (N_s = 256 tokens)


def tiny_config(gpu_pages: int, cpu_pages: int = 0, ssd_pages: int = 0, **kw) -> CacheConfig:
    capacity = {Tier.GPU: gpu_pages * KV_PAGE_BYTES}
    if cpu_pages:
        capacity[Tier.CPU] = cpu_pages * KV_PAGE_BYTES
    if ssd_pages:
        capacity[Tier.SSD] = ssd_pages * KV_PAGE_BYTES
    return CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=CKPT_BYTES,
                       capacity_bytes=capacity, **kw)


def serve(cache, keys, now_s, checkpoint_pages=None):
    """One request through the whole life cycle; returns its MatchResult."""
    lease = cache.begin_request(keys, now_s)
    positions = cache.plan_checkpoints(lease) if checkpoint_pages is None else checkpoint_pages
    cache.finish_request(lease, None, now_s, positions)
    return lease.match


def assert_restorable(cache, keys, result):
    """I6: a reported hit has KV for [0, c) in some tier and a checkpoint exactly at c."""
    c = result.num_reused_pages
    if c == 0:
        return
    path, pos, _ = cache.tree.walk(list(keys[:c]))
    assert pos == c, "KV of the reused prefix is not in the tree"
    assert all(node.kv_mask for node in path), "a reused KV segment has no tier"
    if not cache.policy.dense_checkpoints:
        assert path and path[-1].depth_pages == c and path[-1].ckpt_mask, "no checkpoint at c"
