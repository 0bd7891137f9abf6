"""Chunk ends on planned checkpoint positions: the pure rule, its pass count, the PrefillAdder hooks."""
from __future__ import annotations

import types

import pytest

from histate.sglang_plugin.chunking import align_chunk_end, count_prefill_passes

from ._urc_fixtures import build_cache, build_pools, publish_server_args

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


@pytest.fixture
def histate_cache(sglang_plugins):
    publish_server_args()
    return build_cache("histate", build_pools(1024, 8))


def _req(num_tokens, prefix_len=0):
    return types.SimpleNamespace(full_untruncated_fill_ids=list(range(num_tokens)), prefix_len=prefix_len)


def test_new_request_admission_is_cut_on_its_plan(histate_cache):
    from sglang.srt.managers.schedule_policy import _PrefillAdmission

    from histate.sglang_plugin.chunking import commit_admission_around

    committed = []
    adder = types.SimpleNamespace(tree_cache=histate_cache, new_chunked_req=None)
    req = _req(4000)
    plan = histate_cache.plan_checkpoints(0, 4000)
    assert plan[-1] == 4000 and len(plan) > 2  # intermediate checkpoints planned for this segment
    admission = _PrefillAdmission(prefix_len=0, extend_len=1000, max_new_tokens=0, is_chunked=True, replay_len=0)
    commit_admission_around(lambda a, r, adm, *rest: committed.append(adm), adder, req, admission, 0)
    expected = max(p for p in plan if p <= 1000)
    assert committed[0].extend_len == expected and committed[0].is_chunked
    assert req._hs_plan == plan
    assert histate_cache.histate.metrics.totals[("prefill_chunk_cuts_total", "floor")] == 1


def test_continuing_chunk_hook_through_sglang_prefill_adder(histate_cache):
    """Installed through HookRegistry on SGLang's PrefillAdder; a final chunk is never shortened."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    from histate.sglang_plugin import chunking

    chunking.install_chunk_planning()
    adder = types.SimpleNamespace(tree_cache=histate_cache, mamba_chunk_grid=1)
    req = _req(4000, prefix_len=640)
    req._hs_plan = [1280, 1920, 2560, 3200, 4000]
    token = chunking._current_req.set(req)
    try:
        assert PrefillAdder.floor_chunked_tokens(adder, 1500, 3360) == 1920 - 640
        assert PrefillAdder.floor_chunked_tokens(adder, 3360, 3360) == 3360  # last chunk: unchanged
    finally:
        chunking._current_req.reset(token)
    assert PrefillAdder.floor_chunked_tokens(adder, 1500, 3360) == 1500  # no HiState request in flight
