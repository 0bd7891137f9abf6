"""Chunked-prefill cuts on the state grid, through SGLang's real `PrefillAdder` with real `Req`s, admitted
the way the scheduler admits them (`_scheduler_round.prefill_round`).

The state grid here is 64 tokens (page 16, a 64-token state chunk), the chunk budget 1,000 tokens (not
a page multiple, like a user's value), so SGLang's own cuts land off the grid and HiState's floor shows.
"""
from __future__ import annotations

from array import array

import pytest

from ._scheduler_round import prefill_round
from sglang_cpu.pools import build_cache, build_pools, publish_server_args

GRID = 64
CHUNK = 1000
PROMPT = 4000


def _cache(kind, mode="grid", **server_fields):
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.config import resolve_config

    publish_server_args(page_size=16, chunk_tokens=GRID, **server_fields)
    install_chunk_planning()
    pools = build_pools(16 * 1024, 16)
    if kind == "stock":
        return build_cache("stock", pools), pools
    cache = build_cache("histate", pools, histate_config=resolve_config({"enable": True, "chunk_align": mode}, {}))
    assert cache.histate.grid_tokens == GRID
    return cache, pools


def _req(first_token, num_tokens=PROMPT):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=f"r{first_token}", origin_input_text="",
               origin_input_ids=array("q", range(first_token, first_token + num_tokens)),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=8))


def _prefill_round(cache, pools, chunked_req, waiting, **kwargs):
    return prefill_round(cache, pools.allocator, 16, chunked_req, waiting, rem_chunk_tokens=CHUNK, **kwargs)


def _truncated(adder):
    return [r for r in adder.can_run_list if r.extend_end < len(r.full_untruncated_fill_ids)]


def _run_chunk(req):
    """What the chunk's forward pass leaves for admission: `checkpoint_kv_cache` advances the prefix to
    the chunk end (common.py:280). (No model runs here; the tree insert is not needed for admission.)"""
    req.prefix_len = req.extend_end


@pytest.mark.parametrize("kind, mode, first_end", [
    ("stock", None, 992),     # SGLang: the chunk budget, page-floored
    ("histate", "grid", 960),  # ... floored to the 64-token state grid
    ("histate", "off", 992),   # HiState with SGLang's cuts
])
def test_one_truncated_request_per_batch_and_its_cut_is_on_the_grid(sglang_plugins, kind, mode, first_end):
    """Two long prompts wait. The first is cut; the batch stops there (the scheduler tracks one chunked
    request), and HiState's floor leaves 40 tokens of budget that must not admit the second one cut."""
    cache, pools = _cache(kind, mode) if kind == "histate" else _cache(kind)
    first, second = _req(10_000), _req(50_000)
    adder, chunked = _prefill_round(cache, pools, None, [first, second])
    assert adder.can_run_list == [first] and first.extend_end == first_end
    assert _truncated(adder) == [first] and chunked is first


@pytest.mark.parametrize("kind, ends", [
    ("stock", [992, 1992, 2992, 3992, 4000]),  # first chunk page-floored, continuations not
    ("histate", [960, 1920, 2880, 3840, 4000]),  # every cut on the grid; the final chunk untouched
])
def test_continuing_chunks_are_floored_and_never_share_a_batch_with_a_new_chunked_request(sglang_plugins, kind,
                                                                                           ends):
    """A long prompt runs chunk by chunk while a second long prompt waits. Each round the continuing
    chunk goes first; when it is cut the round must end (the scheduler's `assert self.chunked_req is
    None`, raised as AssertionError by `prefill_round`)."""
    cache, pools = _cache(kind)
    long_prompt, waiting = _req(10_000), _req(50_000)
    adder, chunked = _prefill_round(cache, pools, None, [long_prompt])
    seen = [long_prompt.extend_end]
    while chunked is long_prompt:
        _run_chunk(long_prompt)
        adder, chunked = _prefill_round(cache, pools, chunked, [waiting])
        assert adder.can_run_list[0] is long_prompt
        assert _truncated(adder) == ([chunked] if chunked is not None else [])
        seen.append(long_prompt.extend_end)
    assert seen == ends
    if kind == "histate":
        assert cache.histate.metrics.totals[("prefill_chunk_cuts_total", "grid")] == len(ends) - 1


def test_a_cut_the_floor_would_empty_waits_for_the_next_round(sglang_plugins):
    """960 tokens of a short prompt leave 40 tokens of budget: SGLang would cut the next prompt at 32
    (page-floored); on the grid that is nothing, so it waits (SGLang's own answer when flooring leaves
    nothing) and gets a whole chunk next round, starting on the grid."""
    cache, pools = _cache("histate")
    short, long_prompt = _req(10_000, 960), _req(50_000)
    adder, chunked = _prefill_round(cache, pools, None, [short, long_prompt])
    assert adder.can_run_list == [short] and chunked is None
    adder, chunked = _prefill_round(cache, pools, None, [long_prompt])
    assert adder.can_run_list == [long_prompt] and long_prompt.extend_end == 960 and chunked is long_prompt


def test_shortest_prefill_first_keeps_its_room_for_short_requests(sglang_plugins):
    """Under --schedule-policy shortest-prefill-first SGLang caps a continuing chunk so that waiting
    short requests fit beside it (`shortest_prefill_chunk_limit`, schedule_policy.py:418-437). HiState's
    floor must leave that room to them: before this fix a cut continuing chunk spent the whole chunk
    budget and the short requests waited a round."""
    from sglang.srt.managers.schedule_policy import SchedulePolicy

    for kind in ("stock", "histate"):
        cache, pools = _cache(kind, schedule_policy="shortest-prefill-first")
        long_prompt, shorts = _req(10_000), [_req(60_000 + 1000 * i, 200) for i in range(2)]
        adder, chunked = _prefill_round(cache, pools, None, [long_prompt])
        _run_chunk(long_prompt)
        policy = SchedulePolicy("shortest-prefill-first", tree_cache=cache, enable_hierarchical_cache=False,
                                enable_priority_scheduling=False, schedule_low_priority_values_first=False)
        limit = policy.shortest_prefill_chunk_limit(long_prompt, shorts, CHUNK, 16)
        assert limit == 576  # the budget minus two 200-token requests (208 tokens each, page-ceiled)
        adder, chunked = _prefill_round(cache, pools, chunked, shorts, chunked_req_limit=limit)
        assert adder.can_run_list == [long_prompt, *shorts], kind
        assert long_prompt.extend_end == (960 if kind == "histate" else 992) + 576
