"""`--histate-miss-reasons` in SGLang's own server: meta_info["histate_miss"] and /metrics.

Three requests on the shared HiState server, each with reasons computed here from how its prompt was
built and from SGLang's own `cached_tokens` (docs/misses.md; the state grid is 64 tokens, and SGLang
matches at most the first L-1 prompt tokens):
  1. a new 700-token prompt: 640 tokens no_prefix (10 whole grid pages of its first 699), 60
     page_boundary, nothing cached;
  2. the same prompt again: resumes at its terminal checkpoint (640), the 60 tokens past it are
     page_boundary;
  3. its first 400 tokens and 300 new ones: KV held through 384 (the last grid page end inside the
     shared prefix), so the new pages 7-10 (256 tokens) are no_prefix and the KV from the resume point to
     384 is no_checkpoint (HiState keeps no state there unless eq. 5 placed one: `cached_tokens` says).
The reasons add up to prompt_tokens - cached_tokens (SGLang's), and sglang:histate_miss_tokens_total
{reason} on /metrics grows by exactly the three responses' reasons.
"""
from __future__ import annotations

import random

from .client import metric_series, post_json, tokens

GRID = 64


def _ask(url: str, prompt: list) -> dict:
    out = post_json(url + "/generate", {"input_ids": prompt,
                                        "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}})
    meta = out["meta_info"]
    (miss,) = meta["histate_miss"]  # one request-level entry
    assert sum(miss["tokens"].values()) == meta["prompt_tokens"] - meta["cached_tokens"], meta
    return {"cached": meta["cached_tokens"], **miss["tokens"], "gap": miss["state_gap_tokens"]}


def _counters(url: str) -> dict:
    out: dict = {}
    for labels, value in metric_series(url, "histate_miss_tokens_total").items():
        reason = labels.split('reason="')[1].split('"')[0]
        out[reason] = out.get(reason, 0) + value
    return out


def test_each_response_says_why_its_tokens_missed_and_metrics_count_them(servers):
    url = servers.histate.url
    before = _counters(url)
    rng = random.Random(31)
    prompt = tokens(rng, 700)
    first = _ask(url, prompt)
    assert first == {"cached": 0, "no_prefix": 640, "never_cached": 0, "kv_evicted": 0, "state_evicted": 0,
                     "no_checkpoint": 0, "not_restored": 0, "page_boundary": 60, "gap": 0}
    again = _ask(url, prompt)
    assert again["cached"] == 640 and again["page_boundary"] == 60 and again["no_prefix"] == 0
    branch = _ask(url, prompt[:400] + tokens(rng, 300))
    assert branch["cached"] % GRID == 0 and branch["cached"] <= 384
    assert (branch["no_prefix"], branch["page_boundary"]) == (256, 60)
    assert branch["no_checkpoint"] == branch["gap"] == 384 - branch["cached"]
    after = _counters(url)
    grown = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in after}
    want = {reason: first[reason] + again[reason] + branch[reason] for reason in first if reason not in ("cached", "gap")}
    assert {r: v for r, v in grown.items() if v} == {r: v for r, v in want.items() if v}
