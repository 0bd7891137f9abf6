"""Short prefills before the next chunk of a long one, with aging (`--histate-short-prefill-first`).

The rule is the core's (`histate.core.ShortPrefillFirst`, core/prefill_order.py); this module wires it
into SGLang 0.5.23's scheduler at the one place SGLang asks for a cap on a continuing chunk:

  `Scheduler._get_new_batch_prefill_raw` (managers/scheduler.py:4176-4184), once per prefill pass and
  only while a chunked request continues, after `calc_priority` sorted (and, for cache-aware policies,
  matched) the waiting queue:
      adder.chunked_req_limit = self.policy.shortest_prefill_chunk_limit(
          self.chunked_req, self.waiting_queue, adder.rem_chunk_tokens or 0, self.page_size)
  and `PrefillAdder.add_chunked_req` (schedule_policy.py:1169-1171) takes min(its budget, the limit).

One AROUND hook on `SchedulePolicy.shortest_prefill_chunk_limit` (schedule_policy.py:418-437); under
upstream/series 0012 none: that method asks the tree cache first (`continuing_chunk_limiter`), and
HiState's cache answers with the same rule while the flag is on. With the
flag on and HiState's tree cache, it returns HiState's limit under every `--schedule-policy`: stock
returns None unless the policy is shortest-prefill-first, so the cap does not depend on it; under
shortest-prefill-first HiState's bounded cap replaces SGLang's unbounded one, and the queue order stays
the policy's (SGLang's sort by uncached tokens). Flag off, or another tree cache: SGLang's own method.

* `remaining`: `len(chunked_req.full_untruncated_fill_ids) - chunked_req.prefix_len`, as SGLang's.
* A waiting request's work: `prefill_work_tokens` of its tokens to compute after HiState's hit (the
  deepest checkpoint on its matched path in any tier, SSD included) plus the KV it restores from host
  or SSD at `--histate-restore-cost`, from the `MatchedReuse` HiState's match left on the request
  (runtime.py). The match is the one SGLang ran this pass when it matched the queue
  (`SchedulePolicy.waiting_queue_prefix_matched`: cache-aware policies, fast-match caches); otherwise
  (fcfs and friends on HiState's Python tree core) the hook runs the match SGLang's `calc_priority`
  runs for a cache-agnostic policy (`match_kv_cache(req, tree_cache)`, schedule_policy.py:222-228),
  lazily: only for the leading requests the rule reads, which stops at the first one not short.
* Aging: the count of capped passes in a row lives on the chunked `Req` (`YIELDS_ATTR`), advanced
  with `ShortPrefillFirst.next_yields` on every call. It clears itself: the chunk that finishes a
  prefill always runs uncapped (a capped chunk is shorter than what remains), which resets it to 0.
* Grid alignment (`--histate-chunk-align grid`, chunking.py): the capped chunk is floored to the state
  grid by `floor_chunked_tokens`; a limit under one grid would leave nothing to floor to, so the rule
  keeps at least one grid (`min_tokens`; the long request keeps one grid instead of one page; a short
  request that no longer fits waits, since chunking.py never cuts a new request next to a continuing
  one). The simulator's SGLang engine calls the rule with the same arguments (`EngineConfig.page_tokens`:
  SGLang's page, one token for Qwen3.5 on H100/H200; the 64-token grid as `min_tokens`), so both cap the
  same chunks (test_short_prefill_first.py checks it on one stream).

Deterministic: the queue, the tree and each request's count are the same on every TP rank, and so
are the matches (the tree is; time comes from the agreed clock).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

from histate.core import ShortPrefillFirst, Tier, prefill_work_tokens

from .capture import histate_cache
from .hooks import install_once
from .runtime import REUSE_ATTR

_TARGET = "sglang.srt.managers.schedule_policy.SchedulePolicy.shortest_prefill_chunk_limit"

YIELDS_ATTR = "_hs_spf_yields"
"""Underscore attribute on the chunked `Req`: capped passes in a row (ShortPrefillFirst's yields_in_row)."""


def _rule_cache(policy: Any) -> Optional[Any]:
    """The policy's HiState cache when `--histate-short-prefill-first` is on, else None."""
    cache = histate_cache(getattr(policy, "tree_cache", None))
    if cache is None or not cache.histate.config.short_prefill_first:
        return None
    return cache


def request_work_tokens(req: Any, restore_cost_tokens: dict) -> float:
    """`prefill_work_tokens` of a waiting request from its latest match (HiState's `MatchedReuse`;
    SGLang's own fields when HiState recorded none: device prefix + host hit, the host part restored)."""
    input_tokens = len(req.origin_input_ids) + len(req.output_ids)
    reuse = getattr(req, REUSE_ATTR, None)
    if reuse is None:
        reused, restored = req.num_matched_prefix_tokens, {Tier.CPU: req.host_hit_length}
    else:
        reused, restored = reuse.reused_tokens, reuse.kv_tokens_by_tier
    return prefill_work_tokens(input_tokens - reused, restored, restore_cost_tokens)


def waiting_work_tokens(policy: Any, cache: Any, waiting_queue: list) -> Iterator[float]:
    """The work of each waiting request in queue order, matched lazily when SGLang did not match the
    queue this pass (module docstring)."""
    from sglang.srt.mem_cache.common import match_kv_cache

    host_cost, ssd_cost = cache.histate.config.restore_costs
    costs = {Tier.CPU: host_cost, Tier.SSD: ssd_cost}
    matched = policy.waiting_queue_prefix_matched(waiting_queue)
    for req in waiting_queue:
        if not matched:
            match_kv_cache(req, cache)
        yield request_work_tokens(req, costs)


def histate_chunk_limit(cache: Any, chunked_req: Any, works: Iterable[float], budget: int, page_size: int) -> Optional[int]:
    """HiState's cap on the continuing chunk this pass (None: uncapped), advancing its yield count."""
    config, runtime = cache.histate.config, cache.histate
    rule = ShortPrefillFirst(max_yields=config.short_prefill_max_yields)
    remaining = len(chunked_req.full_untruncated_fill_ids) - chunked_req.prefix_len
    yields = getattr(chunked_req, YIELDS_ATTR, 0)
    min_tokens = runtime.grid_tokens if config.chunk_align == "grid" else None  # a cap the floor keeps
    limit = rule.chunk_limit(remaining, works, budget, page_size, yields, min_tokens=min_tokens)
    setattr(chunked_req, YIELDS_ATTR, rule.next_yields(yields, limit is not None))
    if limit is not None:
        runtime.metrics.record_short_prefill_pass("capped")
    elif yields >= rule.max_yields:
        runtime.metrics.record_short_prefill_pass("aged")
    return limit


def cache_chunk_limit(cache: Any, policy: Any, chunked_req: Any, waiting_queue: list, budget: int,
                      page_size: int) -> Optional[int]:
    """HiState's cap for SGLang's `shortest_prefill_chunk_limit` call (its arguments, the cache first)."""
    return histate_chunk_limit(cache, chunked_req, waiting_work_tokens(policy, cache, waiting_queue), budget,
                               page_size)


def chunk_limit_around(original: Any, policy: Any, chunked_req: Any, waiting_queue: list, budget: int,
                       page_size: int) -> Optional[int]:
    cache = _rule_cache(policy)
    if cache is None:
        return original(policy, chunked_req, waiting_queue, budget, page_size)
    return cache_chunk_limit(cache, policy, chunked_req, waiting_queue, budget, page_size)


LIMITED_BY_SGLANG = hasattr(BasePrefixCache, "continuing_chunk_limiter")
"""upstream/series 0012 applied: SGLang asks the tree cache for the cap (`HiStateRadixCache.continuing_chunk_limiter`);
no hook is installed."""


def install_short_prefill_first() -> None:
    """Register the SchedulePolicy hook (once per process; the scheduler's; stock 0.5.23 only)."""
    if not LIMITED_BY_SGLANG:
        install_once("short_prefill", [(_TARGET, chunk_limit_around, "AROUND")])
