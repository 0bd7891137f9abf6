"""Chunk ends on planned checkpoint positions: the pure rule, its pass count, and the hooks on
SGLang's real `PrefillAdder` with real `Req`s, admitted the way the scheduler admits them."""
from __future__ import annotations

from array import array

import pytest

from histate.sglang_plugin.chunking import align_chunk_end, count_prefill_passes

from ._scheduler_round import prefill_round
from sglang_cpu.pools import PAGE, build_cache, build_pools, publish_server_args

PLAN = [3072, 6144, 9216, 12288, 15360, 18432, 20480]  # interval 3072 over a 20480-token prompt


@pytest.mark.parametrize("prefix, extend, mode, expected", [
    (0, 8192, "floor", 6144),     # a cut moves back to the last planned position inside it
    (6144, 8192, "floor", 6144),  # ... from 6144 to 12288
    (12288, 8192, "floor", 8192),  # the final chunk (ends at 20480) is never shortened
    (0, 2000, "floor", 2000),     # no planned position inside: SGLang's own cut
    (0, 8192, "split", 3072),     # split: every planned position ends a chunk
    (18432, 2048, "split", 2048),
    (0, 8192, "off", 8192),
])
def test_align_chunk_end(prefix, extend, mode, expected):
    assert align_chunk_end(prefix, extend, 20480, PLAN, mode) == expected


def test_pass_counts_document_the_cost_of_each_mode():
    assert count_prefill_passes(0, 20480, 8192, PLAN, "off") == (3, [8192, 16384, 20480])
    assert count_prefill_passes(0, 20480, 8192, PLAN, "floor") == (3, [6144, 12288, 20480])
    assert count_prefill_passes(0, 20480, 8192, PLAN, "split") == (7, PLAN)
    # floor can add a pass when the interval is a large share of the chunk:
    sparse = [6144, 12288, 18432, 24576]
    assert count_prefill_passes(0, 24576, 8192, sparse, "off")[0] == 3
    assert count_prefill_passes(0, 24576, 8192, sparse, "floor") == (4, sparse)


CHUNK = 1000  # --chunked-prefill-size of these tests (not a page multiple, like a user's value)
PROMPT = 4000  # HiState plans 512, 1024, ..., 3584, 4000 for it (asserted below)


def _cache(kind, mode="floor"):
    from histate.sglang_plugin.chunking import install_chunk_planning
    from histate.sglang_plugin.config import resolve_config

    publish_server_args()
    install_chunk_planning()
    pools = build_pools(16 * 1024, 16)
    if kind == "stock":
        return build_cache("stock", pools), pools
    return build_cache("histate", pools, histate_config=resolve_config({"enable": True, "chunk_align": mode}, {})), pools


def _req(first_token, num_tokens=PROMPT):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=f"r{first_token}", origin_input_text="",
               origin_input_ids=array("q", range(first_token, first_token + num_tokens)),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=8))


def _prefill_round(cache, pools, chunked_req, waiting):
    return prefill_round(cache, pools.allocator, PAGE, chunked_req, waiting, rem_chunk_tokens=CHUNK)


def _truncated(adder):
    return [r for r in adder.can_run_list if r.extend_end < len(r.full_untruncated_fill_ids)]


def _run_chunk(req):
    """What the chunk's forward pass leaves for admission: `checkpoint_kv_cache` advances the
    prefix to the chunk end (common.py:280). (No model runs here; the tree insert is not needed
    for admission.)"""
    req.prefix_len = req.extend_end


def test_histate_plans_the_positions_these_tests_assume(sglang_plugins):
    cache, _ = _cache("histate")
    assert cache.plan_checkpoints(0, PROMPT) == [512, 1024, 1536, 2048, 2560, 3072, 3584, 4000]


@pytest.mark.parametrize("kind, mode, first_end", [
    ("stock", None, 992),        # SGLang: the chunk budget, page-floored
    ("histate", "floor", 512),   # the last planned position inside that chunk
    ("histate", "split", 512),   # the first planned position
])
def test_one_truncated_request_per_batch_and_it_is_the_chunked_one(sglang_plugins, kind, mode, first_end):
    """Two long prompts wait. The first is truncated; the batch must stop there, so that the
    one truncated request is the scheduler's `chunked_req`. Before the fix HiState's floor left
    488 tokens of chunk budget, admitted the second prompt truncated too (new_chunked_req
    overwritten), and the first ran as if fully prefilled: decode from a cut prompt."""
    cache, pools = _cache(kind, mode)
    first, second = _req(10_000), _req(50_000)
    adder, chunked = _prefill_round(cache, pools, None, [first, second])
    assert adder.can_run_list == [first] and first.extend_end == first_end
    assert _truncated(adder) == [first] and chunked is first


def test_split_cuts_a_prompt_that_fits_and_still_ends_the_batch(sglang_plugins):
    """`split` cuts a 900-token prompt (fits the chunk) at its first planned position; the next
    prompt must wait for the next round (before the fix it joined the batch)."""
    cache, pools = _cache("histate", "split")
    short, other = _req(10_000, 900), _req(50_000, 300)
    adder, chunked = _prefill_round(cache, pools, None, [short, other])
    assert cache.plan_checkpoints(0, 900)[0] == short.extend_end < 900
    assert adder.can_run_list == [short] and chunked is short


@pytest.mark.parametrize("kind, ends", [
    ("stock", [992, 1992, 2992, 3992, 4000]),  # first chunk page-floored, continuations not
    ("histate", [512, 1024, 1536, 2048, 2560, 3072, 4000]),  # 3584 is inside the final chunk
])
def test_continuing_chunks_never_share_a_batch_with_a_new_chunked_request(sglang_plugins, kind, ends):
    """A long prompt runs chunk by chunk while a second long prompt waits (it arrives after the
    first round). Each round the
    continuing chunk is admitted first; when it is cut again the round must end. Before the fix
    HiState's cut of the continuing chunk left budget, the waiting prompt was admitted and
    chunked, and the scheduler's `assert self.chunked_req is None` fired (here: AssertionError
    from `prefill_round`). The chunk ends are SGLang's cuts (stock) or the planned positions
    (HiState, floor), and the last chunk is never shortened."""
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
    if kind == "histate":  # every chunk but the last was moved back onto a planned position
        assert cache.histate.metrics.totals[("prefill_chunk_cuts_total", "floor")] == len(ends) - 1
