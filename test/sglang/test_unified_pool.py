"""HiState's default device pool, `--enable-unified-memory`, under the scheduler's admission.

SGLang's unified pool keeps KV and recurrent states in one byte buffer
(`init_unified_mamba_pools`, unified_memory_pool.py:1593), so a state slot costs KV tokens
(`mamba_slot_full_token_cost`). `PrefillAdder` then admits new requests against the ledger:
`rem_mamba_slots = schedulable free slots + tree_cache.mamba_evictable_size()`
(schedule_policy.py:710-714) and `rem_total_tokens = free + full_evictable_size() - reserved`
(prefill_budget.py:91-101). The batch is then allocated by `alloc_req_slots` (evicts states
through `ensure_mamba_capacity`, allocation.py:298-349, "fail-loud: an alloc failure here means
the admission budget (PrefillAdder) was wrong") and `alloc_token_slots` (evicts KV). A cache
whose eviction frees less than its ledger reports makes these raise.

Rounds here: requests arrive (new prompts and continuations of finished ones), are matched with
copy-on-write (`Req.init_next_round_input`), admitted by the real `PrefillAdder`, allocated by
the real allocation functions, and released by `release_kv_cache`, keeping their KV and state
in the tree (finished) or not (aborted). After every round: `sanity_check`, the ledger contract
on a copy, and HiState's H4. Stock runs the same rounds as the reference.
"""
from __future__ import annotations

import random
from array import array

import pytest
import torch

from ._scheduler_round import prefill_round
from ._sglang_kit import TickClock, assert_evict_frees_what_the_ledger_reports, assert_histate_invariants
from sglang_cpu.pools import QWEN35_LIKE_STATE, build_cache, build_unified_pools, publish_server_args

ROUNDS = 30


def _request(rid, tokens):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=4))


def _allocate(cache, pools, batch):
    """`alloc_for_extend`'s two allocations (allocation.py:405-432), page size 1: request rows
    and state slots for the batch, then its extend KV; the prefix KV comes off the tree."""
    from sglang.srt.mem_cache.allocation import alloc_req_slots, alloc_token_slots

    alloc_req_slots(pools.req_to_token_pool, batch, cache)
    fresh = alloc_token_slots(cache, sum(req.extend_end - req.prefix_len for req in batch))
    offset = 0
    for req in batch:
        row = req.kv.req_pool_idx
        if req.prefix_len:
            pools.req_to_token_pool.write((row, slice(0, req.prefix_len)), cache.prefix_device_indices(req).to(torch.int32))
        num_new = req.extend_end - req.prefix_len
        pools.req_to_token_pool.write((row, slice(req.prefix_len, req.extend_end)),
                                      fresh[offset:offset + num_new].to(torch.int32))
        offset += num_new
        req.kv.kv_committed_len = req.kv.kv_allocated_len = req.extend_end


@pytest.mark.parametrize("kind", ["stock", "histate"])
def test_admission_on_the_unified_pool_matches_what_eviction_frees(sglang_plugins, kind):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    publish_server_args(page_size=1, chunk_tokens=16)
    pools = build_unified_pools(kv_tokens=4096, mamba_slots=8, state_shape=QWEN35_LIKE_STATE)  # a state ~ 834 KV tokens
    cache = build_cache(kind, pools, **({"clock": TickClock()} if kind == "histate" else {}))
    assert pools.allocator.mamba_slot_full_token_cost() > 0  # states and KV share the bytes
    rng = random.Random(11)
    finished: list[list[int]] = []
    admitted_past_free_slots = evicted_for_states = 0
    for round_no in range(ROUNDS):
        waiting = []
        for i in range(rng.randrange(1, 5)):
            fresh = list(range(10**6 * (round_no + 1) + 1000 * i, 10**6 * (round_no + 1) + 1000 * i + rng.randrange(20, 300)))
            base = rng.choice(finished) if finished and rng.random() < 0.7 else []
            waiting.append(_request(f"{round_no}.{i}", base[:rng.randrange(1, len(base) + 1)] + fresh if base else fresh))
        free_slots = pools.mamba_allocator.schedulable_available_size()
        adder, chunked = prefill_round(cache, pools.allocator, 1, None, waiting, rem_chunk_tokens=None)
        assert chunked is None
        batch = adder.can_run_list
        new_states = sum(not req.kv.holds_mamba for req in batch)
        admitted_past_free_slots += new_states > free_slots
        states_before = cache.mamba_evictable_size() + cache.mamba_protected_size()
        _allocate(cache, pools, batch)  # raises if admission trusted more than eviction frees
        evicted_for_states += states_before > cache.mamba_evictable_size() + cache.mamba_protected_size()
        for req in batch:
            keep = rng.random() < 0.6
            req.finished_reason = FINISH_LENGTH(length=0) if keep else FINISH_ABORT()
            release_kv_cache(req, cache, checkpoint=keep)
            if keep:
                finished.append(list(req.origin_input_ids))
        cache.sanity_check()
        assert_evict_frees_what_the_ledger_reports(cache, pools.allocator, pools.req_to_token_pool, share_tensors=False)
        assert_histate_invariants(cache)
    # The rounds did lean on the ledger: most batches needed more state slots than were free
    # (HiState 20 of 30 rounds, stock 19) and their allocation evicted tree states (22 and 22).
    assert admitted_past_free_slots >= ROUNDS // 2 and evicted_for_states >= ROUNDS // 2


@pytest.mark.parametrize("unified", [False, True])
def test_a_kv_token_costs_its_bytes_on_both_device_pools(sglang_plugins, unified):
    """Eq. 3-7 price a checkpoint in KV tokens (N_s = state bytes / KV bytes per token). SGLang's
    unified sub-pools report 0 from `get_kv_size_bytes()`, which once made a KV token 1 byte on HiState's
    default pool and suppressed every interval checkpoint. Expected here from the geometry alone: two
    full-attention layers x (K + V) x 1 head x 8 dims x 2 bytes (bf16) = 64 bytes."""
    from sglang_cpu.pools import FULL_LAYERS, build_pools

    from histate.sglang_plugin.tree_cache import kv_bytes_per_token

    publish_server_args(page_size=1, chunk_tokens=16)
    pools = build_unified_pools(kv_tokens=1024, mamba_slots=4) if unified else build_pools(1024, 4)
    kvcache = pools.allocator.get_kvcache()
    pool = getattr(kvcache, "full_kv_pool", kvcache)
    head_num, head_dim, itemsize = 1, 8, 2
    if not unified:
        head_num, head_dim = pool.head_num, pool.head_dim
        itemsize = pool.k_buffer[0].element_size()
    assert kv_bytes_per_token(kvcache) == len(FULL_LAYERS) * 2 * head_num * head_dim * itemsize
