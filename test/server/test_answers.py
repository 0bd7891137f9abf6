"""Greedy answers of `--enable-histate` equal stock SGLang's cold answers, on SGLang's own server.

Both servers are `python -m sglang.launch_server` processes on this CPU (sglang_cpu/server: the same
tiny fp32 Qwen3.5, torch stand-ins for the sgl-kernel ops). The reference runs with the radix cache
disabled, so every answer there is a cold prefill; HiState resumes from whatever it kept (device, host
or SSD, in-pass captures included). Three agent sessions of six turns each, interleaved: every turn
extends, truncates, forks or edits the context the previous turns built. Expectations are computed
here, independently of HiState: the reference's answers, and bounds on `cached_tokens` from the
request stream alone (page-aligned, never beyond the longest prefix shared with an earlier context);
and what users see in `cached_tokens` must be what HiState's tree matched (its own counter).
"""
from __future__ import annotations

import random

from .client import PAGE_NUM_TOKENS, AgentSession, metric_sum, serve_turn, tokens

NUM_SESSIONS, NUM_TURNS = 3, 6


def test_multi_turn_sessions_answer_as_stock_sglang_cold(servers):
    reference, histate = servers.reference, servers.histate
    system_prompt = tokens(random.Random(7), 5 * PAGE_NUM_TOKENS + 17)  # shared by every session
    sessions = [AgentSession(s, system_prompt) for s in range(NUM_SESSIONS)]
    seen: list = []  # every context (prompt + answer) the servers have been sent so far
    report, hits, cached_total = [], 0, 0
    reused_before = metric_sum(histate.url, "histate_reused_tokens_total")
    for turn in range(NUM_TURNS):
        for session in sessions:
            # cold 0, same ids, 1e-5, page-aligned; reuse within what an earlier context shared
            where, served, bound = serve_turn(reference, histate, session, turn, seen, f"session {session.session} ")
            hits += served.cached_tokens > 0
            cached_total += served.cached_tokens
            report.append(f"{where}: cached {served.cached_tokens} of a {bound}-token shared prefix")
    print("\n".join(report))
    # Every turn after the first shares at least the system prompt: a cache that served nothing would
    # make the comparison above vacuous.
    assert hits >= NUM_SESSIONS * (NUM_TURNS - 1), report
    # What users see in `cached_tokens` is what HiState's tree matched at admission (its metric counts
    # the depth of the checkpoint each match used): the two never drift apart.
    assert metric_sum(histate.url, "histate_reused_tokens_total") - reused_before == cached_total

