"""What each engine really caches, pinned on hand-sized examples (docs/policies.md, one test per
modelled behaviour; pages of 64 tokens, sizes in pages of KV: see helpers.tiny_config)."""
from dataclasses import replace

from histate.core import HybridPrefixCache, Tier, make_cache, make_policy

from .helpers import KV_PAGE_BYTES, tiny_config

A = [("a", i) for i in range(40)]
X = [("x", i) for i in range(40)]


def plan_and_finish(cache, keys, now_s, steps=(), output_end=None, out_keys=()):
    lease = cache.begin_request(keys, now_s)
    positions = cache.plan_checkpoints(lease, step_end_pages=steps, output_end_pages=output_end)
    cache.finish_request(lease, list(keys) + list(out_keys), now_s, positions)
    cache.check_invariants()
    return lease.match, positions


def checkpoint_depths(cache):
    return sorted(n.depth_pages for n in cache.tree.iter_nodes() if n.ckpt_mask)


def kv_depth(cache, keys):
    return cache.match(keys).num_kv_pages


# --- SGLang: one tracked state per forward pass; the insert stops at the last state ---------------

def sglang(gpu_pages=400):
    return make_cache("sglang-hicache", tiny_config(gpu_pages, cpu_pages=400, ssd_pages=800))


def test_sglang_keeps_one_state_per_forward_pass_at_its_end():
    cache = sglang()
    _, positions = plan_and_finish(cache, A[:30], 0.0, steps=(8, 16, 30))
    assert positions == [8, 16, 30]
    assert checkpoint_depths(cache) == [8, 16, 30]


def test_sglang_branch_inside_the_last_chunk_leaves_no_prompt_end_state_and_no_kv_past_it():
    cache = sglang()
    plan_and_finish(cache, A[:20], 0.0)
    keys = A[:12] + X[:10]  # leaves the cached path at page 12, inside its only forward pass (0 ... 22]
    match, positions = plan_and_finish(cache, keys, 1.0, steps=(22,))
    assert match.num_kv_pages == 12 and match.num_reused_pages == 0
    assert positions == [12]  # the branch point replaced the pass's state
    assert cache.match(keys).num_kv_pages == 12  # X was never inserted: nothing past the last state


def test_sglang_branch_in_an_earlier_chunk_replaces_only_that_chunk_state():
    cache = sglang()
    plan_and_finish(cache, A[:20], 0.0)
    keys = A[:5] + X[:20]
    _, positions = plan_and_finish(cache, keys, 1.0, steps=(8, 16, 25))
    assert positions == [5, 16, 25]


def test_sglang_finish_donates_only_the_last_state_on_the_256_token_decode_grid():
    cache = sglang()
    # prompt 10 pages; the output ends at page 17: decode crossed pages 12 and 16 (256-token grid)
    out = [("o", i) for i in range(7)]
    _, positions = plan_and_finish(cache, A[:10], 0.0, steps=(10,), output_end=17, out_keys=out)
    assert positions == [10, 16]
    assert kv_depth(cache, A[:10] + out) == 16  # output KV up to the donated state, not page 17


def test_sglang_output_shorter_than_the_grid_caches_nothing_past_the_prompt():
    cache = sglang()
    out = [("o", i) for i in range(3)]
    _, positions = plan_and_finish(cache, A[:10], 0.0, steps=(10,), output_end=11, out_keys=out)
    assert positions == [10]
    assert kv_depth(cache, A[:10] + out) == 10


# --- vLLM: 576-token blocks (9 pages), whole-block hits, states on the block grid -----------------

def vllm(policy="vllm-marconi", gpu_pages=400):
    return make_cache(policy, replace(tiny_config(gpu_pages, cpu_pages=400), block_pages=9))


def test_vllm_hit_is_a_whole_number_of_blocks():
    cache = vllm()
    plan_and_finish(cache, A[:30], 0.0, steps=(27, 30))
    assert checkpoint_depths(cache) == [27]  # the prompt tail past the last block is not a state
    assert kv_depth(cache, A[:30]) == 27  # and its partial block is not cached
    result = cache.match(A[:25] + X[:5])
    assert (result.num_kv_pages, result.num_reused_pages) == (18, 0)  # 25 shared pages hit 2 blocks


def test_vllm_keeps_step_end_states_and_block_crossings_of_the_decode():
    cache = vllm()
    out = [("o", i) for i in range(20)]
    _, positions = plan_and_finish(cache, A[:30], 0.0, steps=(9, 18, 27, 30), output_end=47, out_keys=out)
    assert checkpoint_depths(cache) == [9, 18, 27, 36, 45]
    assert kv_depth(cache, A[:30] + out) == 45
    assert cache.match(A[:30] + out[:10]).num_reused_pages == 36  # a later turn resumes mid-output


def test_vllm_branch_point_is_floored_to_its_block():
    cache = vllm()
    plan_and_finish(cache, A[:30], 0.0, steps=(27, 30))
    _, positions = plan_and_finish(cache, A[:22] + X[:10], 1.0, steps=(32,))
    assert 18 in checkpoint_depths(cache)  # branch at page 22 -> block boundary 18
    assert all(d % 9 == 0 for d in checkpoint_depths(cache))


# --- Marconi: input + output, state after the last decoded token, FLOP-aware scan eviction --------

def test_marconi_keeps_the_state_after_the_last_decoded_token():
    cache = make_cache("marconi", tiny_config(400))
    out = [("o", i) for i in range(5)]
    _, positions = plan_and_finish(cache, A[:10], 0.0, output_end=15, out_keys=out)
    assert positions == [15]
    assert cache.match(A[:10] + out).num_reused_pages == 15


def test_marconi_refreshes_only_the_matched_node():
    cache = make_cache("marconi", tiny_config(400))
    plan_and_finish(cache, A[:10], 0.0)
    plan_and_finish(cache, A[:20], 5.0)  # hits the node at 10, inserts [10, 20)
    head = cache.tree.walk(A[:10])[0][-1]
    assert head.kv_access_s == head.ckpt_access_s == 5.0
    plan_and_finish(cache, A[:20] + X[:2], 9.0)  # matches 20: the node at 10 is not refreshed
    assert head.kv_access_s == 5.0


def test_marconi_evicts_by_minmax_flop_efficiency_and_recency_among_nodes_with_one_child_at_most():
    """Three leaves of 2 pages: p and q hang under a 20-page prefix, r is alone and the oldest. LRU
    would evict r; Marconi weighs FLOPs saved per byte of the whole prefix (alpha = 2) and evicts p,
    whose prefix memory is largest; the two-child branch node is no candidate."""
    cfg = tiny_config(gpu_pages=45)  # A (20 + 4) + p, q, r (2 + 4 each) = 42 pages
    cache = make_cache("marconi", cfg)
    plan_and_finish(cache, A[:20], 0.0)
    plan_and_finish(cache, [("r", 0), ("r", 1)], 0.5)
    plan_and_finish(cache, A[:20] + [("p", 0), ("p", 1)], 1.0)
    plan_and_finish(cache, A[:20] + [("q", 0), ("q", 1)], 1.0)
    plan_and_finish(cache, [("s", 0), ("s", 1), ("s", 2)], 2.0)  # needs room: one unit must go
    assert cache.match(A[:20] + [("p", 0), ("p", 1)]).num_kv_pages == 20  # p's leaf went
    assert cache.match([("r", 0), ("r", 1)]).num_reused_pages == 2  # oldest, but cheap to keep
    assert cache.match(A[:20]).num_reused_pages == 20  # the branch node (2 children) is no candidate


def test_every_block_granular_state_sits_on_the_block_grid_invariant_i8():
    cache = vllm("vllm-cpu")
    lease = cache.begin_request(A[:30], 0.0)
    cache.finish_request(lease, None, 0.0, [4, 13, 30])  # off-grid requests are floored to blocks
    cache.check_invariants()
    assert checkpoint_depths(cache) == [9, 27]
