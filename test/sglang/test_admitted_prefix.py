"""A request's hit and miss reasons count the prefix its first pass runs from, not what its match promised.

A match can promise more than the request gets: a checkpoint restored from SSD to the host is an ordinary
host hit, and SGLang loads it back to the device only if the device makes room (`load_back`,
unified_radix_cache.py:1820-1934); if not, the request prefills from its device prefix
(schedule_policy.py:1516-1561) and SGLang's `cached_tokens` says so. HiState's hit counters and miss
reasons must then agree with `cached_tokens` (the uncached tokens it could not bring back are
`not_restored`, docs/misses.md), as `histate bench` and the server tests check on every response. Before,
both were taken at the match, and a load-back that did not go through (the device short of room while
other requests ran) left the reasons summing to more reuse than the response reported (a CI failure of
test/server/test_clients_and_metrics.py).

Here: a request A with an application-placed checkpoint at 512 tokens (docs/hints.md) whose state goes
to SSD alone once A moves past it; then a request B on A's first 512 tokens. Without a fault B resumes at
512 from the restored state (a storage hit); with the load-back refused (the fault, counted) B recomputes
from 0, and the 512 tokens are `not_restored`. Expectations come from how the prompts were built.
"""
from __future__ import annotations

import random

import pytest

from histate.core import SSD_BIT
from histate.sglang_plugin.checkpoint_hints import HINTS_KEY
from histate.sglang_plugin.config import resolve_config
from histate.sglang_plugin.core_nodes import core_of

from ._scheduler_round import serve_request
from sglang_cpu import gdn_kernels
from sglang_cpu.gdn_rig import GRID, GdnRig
from sglang_cpu.pools import key

HINT_TOKENS = 8 * GRID  # where A asks for a checkpoint
A_TOKENS = 16 * GRID + 10
B_NEW_TOKENS = 3 * GRID + 5


def _tokens(rng: random.Random, n: int) -> list:
    return [rng.randrange(512) for _ in range(n)]


def _rig(tmp_path):
    config = resolve_config({"enable": True, "ssd_dirs": [str(tmp_path / "ssd")], "ssd_backend": "file",
                             "ssd_size_bytes": "64MiB", "intervals_tokens": "1024", "miss_reasons": True}, {})
    return GdnRig("fp32", config, mamba_slots=64, kv_tokens=1 << 13, hicache_ratio=4.0, clock=lambda: 0.0,
                  kv_heads=4, kv_head_dim=32)


def _node_at(cache, tokens: list):
    node, depth = cache.tree_core.root_node, 0
    while depth < len(tokens):
        node = next(c for c in node.children.values()
                    if list(c.key.token_ids[:len(c.key)]) == tokens[depth:depth + len(c.key)])
        depth += len(node.key)
    assert depth == len(tokens), "no node ends there"
    return node


def _serve_a_then_b(tmp_path, refuse_load_back: bool):
    rig = _rig(tmp_path)
    cache = rig.cache
    rng = random.Random(7)
    a_tokens = _tokens(rng, A_TOKENS)
    a = rig.request("a", a_tokens)
    a.sampling_params.custom_params = {HINTS_KEY: [HINT_TOKENS]}
    serve_request(rig, a, chunk_tokens=4096)
    cache.check_hicache_events()  # the step after the SSD write was acknowledged homes the state
    assert core_of(_node_at(cache, a_tokens[:HINT_TOKENS])).ckpt_mask == SSD_BIT  # on SSD alone
    b_tokens = a_tokens[:HINT_TOKENS] + _tokens(rng, B_NEW_TOKENS)
    b = rig.request("b", b_tokens)
    refused = []
    if refuse_load_back:  # the device could not make room for the restored state (the fault)
        cache.load_back = lambda *args, **kwargs: (refused.append(args), False)[1]
    serve_request(rig, b, chunk_tokens=4096)
    return cache, b, refused


@pytest.mark.parametrize("refuse_load_back", [False, True], ids=["loaded", "load_back_refused"])
def test_hit_and_misses_count_the_prefix_the_first_pass_ran_from(sglang_plugins, monkeypatch, tmp_path,
                                                                 refuse_load_back):
    gdn_kernels.install(monkeypatch)
    cache, b, refused = _serve_a_then_b(tmp_path, refuse_load_back)
    totals = cache.histate.metrics.totals
    misses = dict(b._hs_misses.tokens_by_reason)
    b_tokens = HINT_TOKENS + B_NEW_TOKENS
    # SGLang matches at most the first L-1 tokens: the new whole grid pages are no_prefix, the rest past
    # the last whole page page_boundary
    new_pages = (b_tokens - 1) // GRID - HINT_TOKENS // GRID
    assert misses["no_prefix"] == new_pages * GRID
    assert misses["page_boundary"] == b_tokens - (b_tokens - 1) // GRID * GRID
    assert sum(misses.values()) == b_tokens - b.cached_tokens  # what the response reports
    assert totals[("ssd_restores_total", "ok")] == 1  # the state came back to the host either way
    if refuse_load_back:
        assert refused, "the fault did not fire"
        assert b.cached_tokens == 0
        assert misses["not_restored"] == HINT_TOKENS
        assert totals.get(("prefix_hits_total", "storage"), 0) == 0
        assert totals.get("reused_tokens_total", 0) == 0
    else:
        assert b.cached_tokens == HINT_TOKENS
        assert misses["not_restored"] == 0
        assert totals[("prefix_hits_total", "storage")] == 1  # restored before admission
        assert totals["reused_tokens_total"] == HINT_TOKENS
    # the response carries the settled reasons
    (meta,) = b.customized_info["histate_miss"]
    assert meta["tokens"] == misses
    # matched again (a retracted request queued again), it keeps its first admission's, as SGLang keeps
    # its cached_tokens (schedule_batch.py:2965-2968); the prefix is now on the device, a different match
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    def hit_counters():
        return {k: v for k, v in totals.items()
                if (k if isinstance(k, str) else k[0]) in ("reused_tokens_total", "prefix_hits_total")}

    before = hit_counters()
    cache.match_prefix(MatchPrefixParams(key=key(list(b.origin_input_ids)[:-1]), req=b))
    assert dict(b._hs_misses.tokens_by_reason) == misses and hit_counters() == before


def test_a_checkpoint_homed_to_the_ssd_after_the_requests_first_match_is_restored_before_it_runs(
        sglang_plugins, monkeypatch, tmp_path):
    """SGLang holds a request for HiState's restore before its admission match (scheduler.py:4240-4258). B
    is queued before A has run; A then leaves a checkpoint on B's path that is homed to the SSD alone
    before B's admission, so only B's admission match sees it. B skips that round
    (restore_recheck.py, SGLang's own `_prefetch_after_device_hit_loss` point), the next round's hold
    restores the state, and B resumes at 512 instead of recomputing it (before: cached_tokens 0)."""
    from types import SimpleNamespace

    from histate.sglang_plugin.restore_recheck import MAX_RECHECKS, prefetch_after_device_hit_loss_around

    gdn_kernels.install(monkeypatch)
    rig = _rig(tmp_path)
    cache = rig.cache
    rng = random.Random(7)
    a_tokens = _tokens(rng, A_TOKENS)
    b = rig.request("b", a_tokens[:HINT_TOKENS] + _tokens(rng, B_NEW_TOKENS))
    b.init_next_round_input(cache, cow_mamba=False)  # queued (Scheduler._prefetch_kvcache): nothing cached
    assert b.prefix_len == 0
    a = rig.request("a", a_tokens)
    a.sampling_params.custom_params = {HINTS_KEY: [HINT_TOKENS]}
    serve_request(rig, a, chunk_tokens=4096)
    cache.check_hicache_events()
    assert core_of(_node_at(cache, a_tokens[:HINT_TOKENS])).ckpt_mask == SSD_BIT
    # B's admission round, in the scheduler's order: the hold, the admission match, SGLang's re-check
    assert cache.check_prefetch_progress(b.cache_request_handle)  # nothing its earlier match noted
    b.init_next_round_input(cache)
    assert b.prefix_len == 0  # SGLang's match sees no state at 512: admitted now, B would recompute it
    scheduler = SimpleNamespace(tree_cache=cache)
    not_lost = lambda scheduler, req: False  # SGLang's own re-check (no L3 lookup of its own here)
    assert prefetch_after_device_hit_loss_around(not_lost, scheduler, b)  # B waits a round
    serve_request(rig, b, chunk_tokens=4096)  # the next rounds: the hold restores, B is admitted
    assert b.cached_tokens == HINT_TOKENS
    assert cache.histate.metrics.totals[("ssd_restores_total", "ok")] == 1
    assert cache.histate.metrics.totals["ssd_restore_rechecks_total"] == 1
    assert b._hs_misses.tokens_by_reason["not_restored"] == 0
    # bounded: a request is skipped at most MAX_RECHECKS times
    cache.check_hicache_events()  # B moved on: the state is homed to the SSD alone again
    assert core_of(_node_at(cache, a_tokens[:HINT_TOKENS])).ckpt_mask == SSD_BIT
    c = rig.request("c", a_tokens[:HINT_TOKENS] + _tokens(rng, B_NEW_TOKENS))
    c.init_next_round_input(cache)
    skips = [prefetch_after_device_hit_loss_around(not_lost, scheduler, c) for _ in range(MAX_RECHECKS + 1)]
    assert skips == [True] * MAX_RECHECKS + [False]
    assert cache.histate.metrics.totals["ssd_restore_rechecks_total"] == 1 + MAX_RECHECKS


def test_a_first_pass_deeper_than_its_match_is_attributed_again():
    """`settle`'s other branch: SGLang resumes deeper than HiState's latest match promised (not expected,
    but SGLang's prefix is the truth `cached_tokens` reports): the reasons are attributed again at that
    depth, so they still add up to the prompt less the prefix run from. Counted by hand: a 300-token prompt
    matched with no checkpoint (no reuse promised), whose first pass runs from 128 tokens."""
    from types import SimpleNamespace

    from histate.sglang_plugin.miss_tracker import MISS_ATTR
    from histate.sglang_plugin.runtime import HiStateRuntime

    runtime = HiStateRuntime(resolve_config({"enable": True, "miss_reasons": True}, {}), grid_tokens=64,
                             kv_bytes_per_token=1024, checkpoint_bytes=1 << 20, device_bytes=1 << 30,
                             clock=lambda: 1.0)
    prompt = list(range(300))
    req = SimpleNamespace(origin_input_ids=prompt, prefix_len=0)
    runtime._attribute_misses(req, key(prompt[:299]), kv_match_tokens=256, ckpt_node=None, now_s=1.0)
    assert sum(getattr(req, MISS_ATTR).tokens_by_reason.values()) == 300  # nothing promised
    req.prefix_len = 128
    runtime.settle(req, now_s=2.0)
    settled = getattr(req, MISS_ATTR).tokens_by_reason
    assert sum(settled.values()) == 300 - 128, settled
    assert settled["not_restored"] == 0  # the match did not promise more than the pass used
