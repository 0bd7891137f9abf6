"""One prefill admission round as SGLang's scheduler runs it, over the real `PrefillAdder`.

`prefill_round` keeps the steps of `Scheduler._get_new_batch_prefill_raw` (scheduler.py
4155-4327) that decide which requests run and which one is chunked, in their order: the
continuing chunked request first (4176-4184), then the waiting queue, stopping on
`budget_state() == OTHER` (4207) or a non-CONTINUE `add_one_req` (4270-4306, which also gives
back a state slot the match copied for a request that was not admitted), then taking
`adder.new_chunked_req` with the scheduler's `assert self.chunked_req is None` (4324-4327).
Left out: LoRA, priority preemption, HiCache prefetch gates, DLLM, the delayer (all off here).
"""
from __future__ import annotations

from typing import Any, Callable, Optional


def prefill_round(cache: Any, allocator: Any, page_size: int, chunked_req: Optional[Any], waiting: list, *,
                  rem_chunk_tokens: Optional[int], rem_input_tokens: int = 16 * 1024,
                  chunked_req_limit: Optional[int] = None, running_batch: Optional[Any] = None,
                  num_mixed_decode_tokens: int = 0) -> tuple[Any, Optional[Any]]:
    """Returns the adder (its `can_run_list` is the batch) and the scheduler's `chunked_req`.
    `chunked_req_limit`: the cap shortest-prefill-first puts on the continuing chunk (4178-4183).
    `running_batch`, `num_mixed_decode_tokens`: the decoding batch and, with `--enable-mixed-chunk`, the
    tokens its rows take off this round's budgets (4157-4174; schedule_policy.py:638-655)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    adder = PrefillAdder(page_size, cache, allocator, running_batch, new_token_ratio=0.7,
                         rem_input_tokens=rem_input_tokens, rem_chunk_tokens=rem_chunk_tokens,
                         num_mixed_decode_tokens=num_mixed_decode_tokens)
    if chunked_req is not None:
        chunked_req.init_next_round_input()
        adder.chunked_req_limit = chunked_req_limit
        chunked_req = adder.add_chunked_req(chunked_req)
    for req in waiting:
        if adder.budget_state() == AddReqResult.OTHER:
            break
        req.init_next_round_input(cache)
        result = adder.add_one_req(req, has_chunked_req=chunked_req is not None, truncation_align_size=None)
        if result != AddReqResult.CONTINUE:
            admitted = bool(adder.can_run_list) and req is adder.can_run_list[-1]
            if not admitted and req.kv.holds_mamba:
                req.kv.mamba_cow_src_index = None
                cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
                req.kv.mamba_pool_idx = None
            break
    if adder.new_chunked_req is not None:
        assert chunked_req is None, "scheduler.py:4326: a new chunked request next to a continuing one"
        chunked_req = adder.new_chunked_req
    return adder, chunked_req


def serve_request(rig: Any, req: Any, chunk_tokens: int, check_states: Callable[[], None] = lambda: None) -> list:
    """One request of a `GdnRig` through the scheduler's steps: the SSD-restore hold, admission rounds
    (`prefill_round`: load-back of host hits), the passes (`ScheduleBatch.prepare_for_extend` and the GDN
    layers), the prompt-end insert and release; then backups are acknowledged. `check_states` runs after
    every insert, before the scheduler step that could home a state. Returns each pass's end."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

    from sglang_cpu.hicache import drain_backups

    cache = rig.cache
    req.init_next_round_input(cache, cow_mamba=False)  # enqueue: Scheduler._prefetch_kvcache (scheduler.py:3344) copies no state
    while not cache.check_prefetch_progress(req.cache_request_handle):
        cache.check_hicache_events()  # the scheduler's steps go on; each agrees the SSD reads in flight
    ends, chunked, waiting = [], None, [req]
    while waiting or chunked is not None:
        if chunked is not None:
            checkpoint_kv_cache(chunked, cache)
            check_states()
        adder, chunked = prefill_round(cache, rig.pools.allocator, rig.page, chunked, waiting,
                                       rem_chunk_tokens=chunk_tokens)
        assert adder.can_run_list == [req]
        if waiting:
            req._hs_admitted = (req.prefix_len, req.mamba_branching_seqlen)
        waiting = []
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()
        rig.forward([req])
        ends.append(req.extend_end)
    checkpoint_kv_cache(req, cache)
    req.finished_reason = FINISH_LENGTH(length=0)
    release_kv_cache(req, cache, checkpoint=True)
    check_states()
    drain_backups(cache)
    return ends
