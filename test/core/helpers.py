"""Shared builders for core tests: tiny byte sizes so capacities read as page counts."""
from histate.core import MISS_REASONS as REASONS, CacheConfig, Tier

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


def expected_reasons(log, keys: list, L: int, P: int, m: int, c: int, now_s: float, seen=frozenset(),
                     held=None) -> dict:
    """Miss reasons by core/misses.py's rule, read off the simulator's `explain.EvictionLog` (an
    independent record of the cache's events: per key, when its KV and checkpoints came and went and
    whether an eviction decision or a fault took them) as it stood just after `now_s`. The log must be
    told each request (`set_request`), as the replay does, so a fault is never read as an eviction.
    `seen`: page keys of the contexts (prompt and output) of requests that left before this one matched; `held`: KV pages held
    before the match was floored to a block (the pages from m to it are page_boundary)."""
    held = m if held is None else held
    out = dict.fromkeys(REASONS, 0)
    out["page_boundary"] = L - len(keys) * P + (held - m) * P
    for i in range(held, len(keys)):
        event = log.kv_eviction_before(keys[i], now_s + 1e-9)
        if event is None:
            out["never_cached" if keys[i] in seen else "no_prefix"] += P
        else:
            out["kv_evicted" if event[1] >= 0 else "not_restored"] += P
    for depth in range(m, c, -1):
        if log.checkpoint_state_before(keys[depth - 1], now_s + 1e-9) == "gone":
            gone = log._last_before(log.ckpt_gone[keys[depth - 1]], now_s + 1e-9)
            out["state_evicted" if gone[1] >= 0 else "not_restored"] += (depth - c) * P
            out["no_checkpoint"] += (m - depth) * P
            break
    else:
        out["no_checkpoint"] += (m - c) * P
    return out
