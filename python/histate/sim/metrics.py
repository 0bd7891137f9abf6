"""Per-request records of a replay and the paper's metrics over them (§4.1-4.2).

- token hit rate = sum of reused tokens / sum of input tokens (a KV match without a usable state does
  not count: reused = c, DESIGN.md hit accounting);
- TTFT percentiles over all requests (queueing + restore + recompute), and p95/p99 over the
  non-first requests of their session (`session_index > 0`, root or subagent) side by side: a
  session's first request is cold for every policy (no cache holds its context yet), so on agent
  traces the first requests fill a large part of the top 1% and compress every policy's p99 toward
  the `unlimited` ceiling; the non-first figure shows what the cache can change;
- the reuse-sensitive cohort: requests whose `vllm-disk` hit rate is at least 5 points below
  `unlimited`, or whose hit rate differs by at least 5 points between `histate` and `vllm-disk`;
- the fraction of `unlimited`'s reusable tokens a policy recovers on that cohort (sum over the cohort,
  then divide).
Pure Python over plain records; no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

from ..core import DEFAULT_CHUNK_PAGES, MISS_REASONS, STATE_GRID_TOKENS


@dataclass(slots=True)
class RequestRecord:
    uid: int
    session_id: str
    flags: int
    arrival_s: float
    input_tokens: int
    kv_hit_tokens: int  # m * P
    reused_tokens: int  # c * P
    restore_s: float = 0.0
    first_token_s: float = math.nan
    completion_s: float = math.nan
    session_index: int = 0  # position of the request in its session (0: the session's first, cold)
    server: str = ""        # which server served it, where there are several (live: the worker's URL)
    l3_hit_tokens: int = 0  # of reused_tokens, those restored from the shared L3 store
    output_digest: str = ""  # live runs: BLAKE2b of the output token ids (exactness checks across runs)
    matched_s: Optional[float] = None  # when its first admission matched the cache (None: at arrival)
    miss_tokens: Optional[dict] = None  # uncached tokens by reason (core/misses.py); None: not attributed
    kv_held_tokens: Optional[int] = None  # KV held on its path before a block floor (MatchResult.num_held_kv_pages)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0


@dataclass
class PolicyRun:
    """Everything one policy's replay produced."""

    policy: str
    records: list
    cache_stats: object = None
    engine_stats: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def by_uid(self) -> dict:
        return {r.uid: r for r in self.records}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: PolicyRun, uids: Optional[Iterable[int]] = None) -> dict:
    wanted = None if uids is None else set(uids)
    records = run.records if wanted is None else [r for r in run.records if r.uid in wanted]
    served = [r for r in records if not math.isnan(r.first_token_s)]
    ttfts = [r.ttft_s for r in served]
    later = [r.ttft_s for r in served if r.session_index > 0]
    input_tokens = sum(r.input_tokens for r in records)
    reused = sum(r.reused_tokens for r in records)
    arrivals = [r.arrival_s for r in records]
    ends = [r.completion_s for r in records if not math.isnan(r.completion_s)]
    return {
        "policy": run.policy,
        "requests": len(records),
        "non_first_requests": sum(1 for r in records if r.session_index > 0),
        "input_tokens": input_tokens,
        "reused_tokens": reused,
        "token_hit_rate": reused / input_tokens if input_tokens else 0.0,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p95_non_first_s": percentile(later, 95),
        "ttft_p99_non_first_s": percentile(later, 99),
        "simulated_span_s": max(ends) - min(arrivals) if ends else math.nan,
    }


def miss_tokens_by_reason(run: PolicyRun) -> Optional[dict]:
    """Uncached prompt tokens of the run by reason (core/misses.py), summed over its requests; None
    when its records carry no attribution (a cluster replay)."""
    attributed = [r.miss_tokens for r in run.records if r.miss_tokens is not None]
    if not attributed:
        return None
    return {reason: sum(m[reason] for m in attributed) for reason in MISS_REASONS}


LONG_PREFILL_TOKENS = DEFAULT_CHUNK_PAGES * STATE_GRID_TOKENS
"""A prefill computing more than one pass's budget (SGLang's 8192-token `--chunked-prefill-size` on
H100/H200) is chunked: the requests a short-prefill-first order makes wait (core/prefill_order.py)."""


def long_prefill_uids(run: PolicyRun, threshold_tokens: int = LONG_PREFILL_TOKENS) -> list:
    """Requests of `run` that computed more than `threshold_tokens` (input not reused)."""
    return [r.uid for r in run.records if r.input_tokens - r.reused_tokens > threshold_tokens]


def reuse_sensitive_uids(runs: Mapping[str, PolicyRun], ours: str = "histate", base: str = "vllm-disk",
                         ceiling: str = "unlimited", threshold: float = 0.05) -> list:
    """Paper §4.2 cohort; empty when one of the three policies was not replayed."""
    if not all(name in runs for name in (ours, base, ceiling)):
        return []
    o, b, c = runs[ours].by_uid(), runs[base].by_uid(), runs[ceiling].by_uid()
    cohort = []
    for uid, rb in b.items():
        if uid not in o or uid not in c:
            continue
        if rb.hit_rate <= c[uid].hit_rate - threshold or abs(o[uid].hit_rate - rb.hit_rate) >= threshold:
            cohort.append(uid)
    return sorted(cohort)


def recovered_fraction(runs: Mapping[str, PolicyRun], policy: str, uids: Sequence[int],
                       ceiling: str = "unlimited") -> float:
    """Reused tokens of `policy` over the cohort / reused tokens of `ceiling` over the cohort."""
    if ceiling not in runs or policy not in runs or not uids:
        return math.nan
    got, top = runs[policy].by_uid(), runs[ceiling].by_uid()
    denom = sum(top[u].reused_tokens for u in uids)
    return sum(got[u].reused_tokens for u in uids) / denom if denom else math.nan


SPEEDUP_KEYS = ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_p95_non_first_s",
                "ttft_p99_non_first_s")


def speedups(summaries: Mapping[str, dict], baseline: str = "vllm-marconi") -> dict:
    """baseline percentile / policy percentile, per policy, for p50, p95, p99 (all requests and
    non-first ones) and the mean; NaN where either side is undefined."""
    if baseline not in summaries:
        return {}
    base = summaries[baseline]
    out = {}
    for name, s in summaries.items():
        out[name] = {k: (base[k] / s[k] if s[k] and not math.isnan(s[k]) else math.nan) for k in SPEEDUP_KEYS}
    return out

