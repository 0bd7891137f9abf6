"""`--histate-tool-wait-prefetch on` in SGLang's own server (docs/tool_wait.md).

One HiState server with the flag and a small device pool (2,048 tokens, so unrelated prompts evict),
serving an agent session through `/generate` with real pauses between its turns, against stock SGLang
answering cold:
  * every answer is exact (the holds change eviction order, never a state);
  * the session's continuations resume from its previous turn (cached_tokens past its first prompt);
  * /metrics counts the holds: after the first observed wait every finished turn is held
    (`sglang:histate_tool_wait_turns_total{event="held"}`), and a hold whose turn does not come back
    within its deadline (here at most twice the longest wait, a few seconds of wall clock) is let go
    at the next request's match (`event="expired"`).
Which unit a hold keeps and when it lets go is checked decision by decision in test/sglang/test_tool_wait.py
on SGLang's cache with a logical clock; here the clock is the server's agreed wall clock.
"""
from __future__ import annotations

import random
import time

import pytest

from .client import assert_exact, metric_sum, tokens
from .conftest import HISTATE_ARGS

WAIT_S = 1.5  # the pause between the session's turns (its tool call)


@pytest.fixture(scope="module")
def server(fleet):
    (server,) = fleet.get(("toolwait", HISTATE_ARGS + ("--max-total-tokens", "2048",
                                                       "--histate-tool-wait-prefetch", "on")))
    yield server
    fleet.stop("toolwait")  # nothing else uses it


def test_a_session_through_pauses_is_held_answered_exactly_and_let_go(servers, server):
    reference, rng = servers.reference, random.Random(4242)
    held = lambda: metric_sum(server.url, "histate_tool_wait_turns_total", event="held")  # noqa: E731
    expired = lambda: metric_sum(server.url, "histate_tool_wait_turns_total", event="expired")  # noqa: E731
    before_held, before_expired = held(), expired()
    prompt = tokens(rng, 500)
    first = assert_exact(reference, server, "turn 1", prompt)
    for turn in range(2, 5):
        time.sleep(WAIT_S)
        prompt = prompt + list(first.output_ids) + tokens(rng, 150)
        first = assert_exact(reference, server, f"turn {turn}", prompt)
        assert first.cached_tokens >= 448, f"turn {turn} did not resume its session: {first.cached_tokens}"
        assert assert_exact(reference, server, f"unrelated after turn {turn}", tokens(rng, 600)).cached_tokens == 0
    # turns 2-4 and the unrelated prompts after the first observed wait are held
    assert held() - before_held >= 3
    # nothing comes back to the last turn: past its deadline (waits here are seconds, deadlines at most
    # twice the longest), the next request's match lets it go
    time.sleep(4 * WAIT_S + 10)
    assert_exact(reference, server, "after the waits", tokens(rng, 300))
    assert expired() - before_expired >= 1
