"""Asymmetric placement and the two ledgers, on hand-sized examples (sizes in pages of KV)."""
from histate.core import HybridPrefixCache, ItemKind, Tier, make_cache, make_policy

from .helpers import CKPT_BYTES, KV_PAGE_BYTES, serve, tiny_config

A = [("a", i) for i in range(10)]
B = [("b", i) for i in range(10)]


def tiers_of(cache, keys):
    path, pos, _ = cache.tree.walk(list(keys))
    node = path[-1]
    return node.kv_mask, node.ckpt_mask


def test_exclusive_tiers_demote_instead_of_deleting_when_a_lower_tier_has_room():
    cache = make_cache("histate-exclusive", tiny_config(gpu_pages=16, cpu_pages=16, ssd_pages=64))
    serve(cache, A, 1.0, [10])  # 10 pages KV + 4 pages state on GPU
    serve(cache, B, 2.0, [10])  # needs 14 pages: A's bundle moves down instead of disappearing
    cache.check_invariants()
    assert cache.match(A).num_reused_pages == 10
    kv_mask, ckpt_mask = tiers_of(cache, A)
    assert kv_mask == 1 << Tier.CPU and ckpt_mask == 1 << Tier.CPU
    assert cache.stats.evictions[("bundle", "GPU", "demote")] == 1


GPU, CPU, SSD = 1 << Tier.GPU, 1 << Tier.CPU, 1 << Tier.SSD


def test_histate_sends_historical_checkpoints_to_ssd_and_keeps_the_terminal_on_gpu():
    """SGLang's HiCache tiers as the plugin runs them: KV written through device -> host (the SSD takes
    what the host evicts), a checkpoint written through to the SSD (the host's state slots only stage),
    kept on the device only while it is a trajectory's terminal state."""
    cache = make_cache("histate", tiny_config(gpu_pages=64, cpu_pages=64, ssd_pages=64))
    serve(cache, A[:4], 1.0, [4])
    assert tiers_of(cache, A[:4]) == (GPU | CPU, GPU | SSD)  # a terminal: device + its SSD copy
    serve(cache, A, 2.0, [6, 10])  # 6 is planned inside the new segment; 4 became historical
    assert tiers_of(cache, A[:4])[1] == SSD
    assert tiers_of(cache, A[:6])[1] == SSD
    assert tiers_of(cache, A) == (GPU | CPU, GPU | SSD)
    result = cache.match(A[:6] + [("x", 0)])
    assert (result.num_reused_pages, result.checkpoint_tier) == (6, Tier.SSD)
    assert result.kv_bytes_by_tier == {Tier.GPU: 6 * KV_PAGE_BYTES}
    cache.check_invariants()


def test_histate_sheds_the_device_copies_of_an_evicted_bundle():
    cache = make_cache("histate", tiny_config(gpu_pages=16, cpu_pages=64, ssd_pages=64))
    serve(cache, A, 1.0, [10])  # 10 pages KV + 4 pages state on GPU
    serve(cache, B, 2.0, [10])  # needs 14 pages: A's device copies go, its host KV and SSD state stay
    cache.check_invariants()
    assert tiers_of(cache, A) == (CPU, SSD)  # the host copy of KV stays; the state is on SSD alone
    assert cache.stats.evictions[("bundle", "GPU", "shed")] == 1
    result = cache.match(A)
    assert (result.num_reused_pages, result.checkpoint_tier) == (10, Tier.SSD)
    assert result.kv_bytes_by_tier == {Tier.CPU: 10 * KV_PAGE_BYTES}


def test_promotion_moves_reused_kv_back_to_gpu():
    cache = make_cache("histate-exclusive", tiny_config(gpu_pages=16, cpu_pages=32, ssd_pages=64))
    serve(cache, A, 1.0, [10])
    serve(cache, B, 2.0, [10])  # A demoted to CPU
    lease = cache.begin_request(A + [("a", 10)], 3.0)
    assert lease.match.kv_bytes_by_tier == {Tier.CPU: 10 * KV_PAGE_BYTES}
    assert tiers_of(cache, A)[0] == 1 << Tier.GPU  # exclusive tiers: moved, not copied
    cache.abort_request(lease)
    cache.check_invariants()


def test_histate_promotion_copies_reused_kv_back_to_gpu():
    cache = make_cache("histate", tiny_config(gpu_pages=16, cpu_pages=32, ssd_pages=64))
    serve(cache, A, 1.0, [10])
    serve(cache, B, 2.0, [10])  # A's device copy shed
    lease = cache.begin_request(A + [("a", 10)], 3.0)
    assert lease.match.kv_bytes_by_tier == {Tier.CPU: 10 * KV_PAGE_BYTES}
    assert tiers_of(cache, A)[0] == GPU | CPU  # inclusive tiers: copied, the host copy stays
    cache.abort_request(lease)
    cache.check_invariants()


def test_histate_kv_reaches_the_ssd_when_the_host_evicts_it_and_comes_back_through_the_host():
    """The SSD is the host's victim tier for KV (docs/policies.md "Tiering"): nothing of A's KV is on
    SSD while the host holds it; once the host evicts it, it moves there, and a hit brings it back to
    the device through the host (SGLang's L3 prefetch inserts host nodes)."""
    cache = make_cache("histate", tiny_config(gpu_pages=16, cpu_pages=12, ssd_pages=64))
    serve(cache, A, 1.0, [10])
    assert tiers_of(cache, A)[0] == GPU | CPU
    serve(cache, B, 2.0, [10])  # A's device copy is shed; the host keeps 12 pages: A's KV leaves it
    cache.check_invariants()
    assert tiers_of(cache, A)[0] == SSD
    assert cache.stats.evictions[("bundle", "CPU", "demote")] == 1
    lease = cache.begin_request(A + [("a", 10)], 3.0)
    assert lease.match.kv_bytes_by_tier == {Tier.SSD: 10 * KV_PAGE_BYTES}
    assert tiers_of(cache, A)[0] & (GPU | CPU) == GPU | CPU
    cache.abort_request(lease)
    cache.check_invariants()


def test_write_through_keeps_copies_and_sheds_the_gpu_copy_on_eviction():
    cache = make_cache("vllm-cpu", tiny_config(gpu_pages=16, cpu_pages=64))
    serve(cache, A, 1.0, [10])
    assert tiers_of(cache, A) == ((1 << Tier.GPU) | (1 << Tier.CPU), (1 << Tier.GPU) | (1 << Tier.CPU))
    serve(cache, B, 2.0, [10])
    assert tiers_of(cache, A) == (1 << Tier.CPU, 1 << Tier.CPU)
    assert cache.stats.evictions[("bundle", "GPU", "shed")] == 1
    assert cache.match(A).num_reused_pages == 10


def test_static_partition_evicts_states_within_their_share_only():
    """SGLang's state LRU: an internal node loses its state alone, a leaf goes whole (KV included;
    unified_cache/components/mamba.py:415-421), although the KV pool has room."""
    cfg = tiny_config(gpu_pages=40, state_fraction={Tier.GPU: 0.2})  # 8 pages = 2 states, 32 pages of KV
    cache = HybridPrefixCache(cfg, make_policy("sglang-hicache"))
    pools = cache.ledger.capacity_bytes
    assert pools[(Tier.GPU, ItemKind.CHECKPOINT)] == 8 * KV_PAGE_BYTES
    assert pools[(Tier.GPU, ItemKind.KV)] == 32 * KV_PAGE_BYTES
    serve(cache, A[:3], 0.0, [3])
    serve(cache, A[:6], 1.0, [6])  # two states: A[:3] is now internal
    serve(cache, A[:6], 2.0, [6])  # a hit refreshes the matched state only (mamba.py:127-149)
    serve(cache, B[:3], 3.0, [3])  # the oldest state (internal A[:3]) goes alone: its KV stays
    cache.check_invariants()
    assert cache.match(A[:3]).num_kv_pages == 3 and cache.match(A[:3]).num_reused_pages == 0
    assert cache.match(A[:6]).num_reused_pages == 6
    serve(cache, [("c", 0), ("c", 1)], 4.0, [2])  # the next oldest (leaf A[:6]) takes its KV along
    cache.check_invariants()
    assert cache.match(A[:6]).num_kv_pages == 0
    assert cache.ledger.used_bytes[(Tier.GPU, ItemKind.CHECKPOINT)] == 2 * CKPT_BYTES
    assert cache.ledger.used_bytes[(Tier.GPU, ItemKind.KV)] == 5 * KV_PAGE_BYTES


def test_sglang_state_eviction_of_a_device_leaf_sheds_its_kv_to_host():
    cfg = tiny_config(gpu_pages=40, cpu_pages=400, state_fraction={Tier.GPU: 0.2, Tier.CPU: 0.5})
    cache = HybridPrefixCache(cfg, make_policy("sglang-hicache"))
    for i, keys in enumerate((A[:3], B[:3], [("c", 0), ("c", 1)])):
        serve(cache, keys, float(i), [len(keys)])
    cache.check_invariants()
    assert tiers_of(cache, A[:3]) == (1 << Tier.CPU, 1 << Tier.CPU)  # KV left the GPU with the state
    assert cache.match(A[:3]).num_reused_pages == 3  # still a host hit


def test_sglang_l3_is_one_pool_for_kv_and_states():
    cfg = tiny_config(gpu_pages=40, cpu_pages=40, ssd_pages=100)
    cache = HybridPrefixCache(cfg, make_policy("sglang-hicache"))
    pools = cache.ledger.capacity_bytes
    assert pools[(Tier.SSD, None)] == 100 * KV_PAGE_BYTES
    assert cache.ledger.pool_of(Tier.SSD, ItemKind.KV) == cache.ledger.pool_of(Tier.SSD, ItemKind.CHECKPOINT)
    assert (Tier.CPU, ItemKind.KV) in pools and (Tier.CPU, ItemKind.CHECKPOINT) in pools


def test_unlimited_reuses_every_page_of_the_longest_cached_prefix():
    cache = make_cache("unlimited", tiny_config(gpu_pages=1))
    serve(cache, A, 1.0)
    result = cache.match(A[:7] + B)
    assert (result.num_kv_pages, result.num_reused_pages) == (7, 7)


def test_a_lost_checkpoint_becomes_a_miss_at_the_previous_one():
    cache = make_cache("histate", tiny_config(gpu_pages=64, cpu_pages=64, ssd_pages=64))
    serve(cache, A[:4], 1.0, [4])
    serve(cache, A, 2.0, [6, 10])
    assert cache.report_lost(A, 6, ItemKind.CHECKPOINT, Tier.SSD, 3.0)
    assert not cache.report_lost(A, 6, ItemKind.CHECKPOINT, Tier.SSD, 3.0)  # already forgotten
    cache.check_invariants()
    assert cache.match(A[:6] + [("x", 0)]).num_reused_pages == 4
    assert cache.match(A).num_reused_pages == 10
    assert cache.stats.num_lost_reported == 1


def test_lost_kv_in_its_only_tier_takes_the_subtree_with_it():
    cache = make_cache("histate-exclusive", tiny_config(gpu_pages=64, cpu_pages=64, ssd_pages=64))
    serve(cache, A[:4], 1.0, [4])
    serve(cache, A, 2.0, [10])
    serve(cache, A[:4] + B[:3], 3.0, [7])
    assert cache.report_lost(A, 4, ItemKind.KV, Tier.GPU, 4.0)
    cache.check_invariants()
    assert cache.match(A).num_kv_pages == 0 and cache.match(A[:4] + B[:3]).num_kv_pages == 0
    assert cache.ledger.used_bytes[Tier.GPU] == cache.ledger.used_bytes[Tier.SSD] == 0


def test_report_lost_refuses_to_pull_pinned_kv():
    import pytest
    from histate.core import HiStateError
    cache = make_cache("histate", tiny_config(gpu_pages=64))
    serve(cache, A, 1.0, [10])
    lease = cache.begin_request(A, 2.0)
    with pytest.raises(HiStateError, match="pinned"):
        cache.report_lost(A, 10, ItemKind.KV, Tier.GPU, 2.0)
    cache.abort_request(lease)
    assert cache.report_lost(A, 10, ItemKind.KV, Tier.GPU, 2.0)
    cache.check_invariants()


def test_lost_kv_can_be_named_by_any_page_of_its_segment():
    cache = make_cache("histate", tiny_config(gpu_pages=64, cpu_pages=64))
    serve(cache, A, 1.0, [10])
    assert cache.report_lost(A, 3, ItemKind.KV, Tier.CPU, 2.0)  # page 2 of the 10-page segment
    assert tiers_of(cache, A)[0] == GPU  # its device copy is left
    assert cache.report_lost(A, 3, ItemKind.KV, Tier.GPU, 2.0)  # ... and was its last copy
    assert cache.tree.num_nodes == 0
    cache.check_invariants()


def test_reservation_is_refused_without_side_effects_when_pins_hold_the_pool():
    """SGLang's PrefillAdder admits a prefill only if it fits in free + evictable KV
    (sglang/srt/managers/schedule_policy.py, budget check against `rem_total_tokens`): a reservation
    that pinned data makes impossible must evict nothing and be refused."""
    cache = make_cache("histate", tiny_config(gpu_pages=20))
    keys = [("a", i) for i in range(12)]
    lease = cache.begin_request(keys, 1.0)
    cache.finish_request(lease, None, 1.0, [12])
    held = cache.begin_request(keys, 2.0)  # pins the 12 pages and the checkpoint
    assert cache.evictable_bytes(Tier.GPU) == 0
    used = dict(cache.ledger.used_bytes)
    assert not cache.reserve(10 * KV_PAGE_BYTES, 3.0)
    assert cache.ledger.used_bytes == used and cache.stats.evictions == {}
    cache.abort_request(held)
    assert cache.evictable_bytes(Tier.GPU) == cache.ledger.used_bytes[Tier.GPU]
    assert cache.reserve(10 * KV_PAGE_BYTES, 4.0)  # now eviction makes room
    assert cache.free_bytes(Tier.GPU) >= 0 and sum(cache.stats.evictions.values()) > 0
    cache.check_invariants()
    cache.release(10 * KV_PAGE_BYTES)
    cache.check_invariants()


def test_unlimited_caches_everything_yet_admits_only_what_running_work_leaves_room_for():
    """The ceiling keeps every page without evicting, but running requests share the GPU's physical
    memory as they do under every other policy: what they pin plus what they reserve must fit, so the
    ceiling waits at admission whenever the running work alone does not (docs/policies.md)."""
    cache = make_cache("unlimited", tiny_config(gpu_pages=20))
    for s in range(10):  # 100 pages cached in a 20-page GPU
        serve(cache, [(s, i) for i in range(10)], float(s))
    assert cache.stats.evictions == {} and cache.tree.num_nodes == 10
    assert cache.free_bytes(Tier.GPU) == 20 * KV_PAGE_BYTES and cache.evictable_bytes(Tier.GPU) == 0
    lease = cache.begin_request([(0, i) for i in range(10)] + [("new", 0)], 11.0)  # pins 10 pages
    assert cache.free_bytes(Tier.GPU) == 10 * KV_PAGE_BYTES
    assert not cache.reserve(11 * KV_PAGE_BYTES, 11.0)
    assert cache.reserve(10 * KV_PAGE_BYTES, 11.0) and cache.free_bytes(Tier.GPU) == 0
    cache.check_invariants()
    cache.release(10 * KV_PAGE_BYTES)
    cache.abort_request(lease)
    assert cache.free_bytes(Tier.GPU) == 20 * KV_PAGE_BYTES and cache.stats.evictions == {}
