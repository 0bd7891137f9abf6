"""HiState's default device pool (SGLang's unified pool) with an SSD tier and a short host keeps write_through.

Without `--hicache-write-policy`, with an SSD tier and a host KV pool at most 1.8x the device pool, HiState
switches HiCache to write_back at start, but only on the static device pool (sglang_plugin/write_policy.py):
on the unified pool (test_unified_pool.py's server: the CPU stand-in attention that writes through the
pool's `KVLocPlan` and reads through its `KVIndexTranslator`) SGLang's scheduler ran out of mamba slots
under write_back ("Not enough space for mamba ping pong idx", docs/results.md "HiState picks the write
policy"), so write_back is refused there and this server, with a small device pool (1,024 tokens of KV, 8
states) and `--hicache-ratio 1.5`, must say write_through by HiState's choice on /metrics, and answer a
multi-turn session and prompts that push each other off the device as stock SGLang does cold.
"""
from __future__ import annotations

import random

import pytest

from .client import PAGE_NUM_TOKENS, AgentSession, assert_exact, common_prefix_len, metric_sum, tokens
from .conftest import REFERENCE_ARGS
from .test_unified_pool import UNIFIED_ARGS


def _short_host(args: tuple) -> tuple:
    at = args.index("--hicache-ratio")
    return args[:at + 1] + ("1.5",) + args[at + 2:]


@pytest.fixture(scope="module")
def pair(fleet, ssd_root):
    return fleet.get(("reference", REFERENCE_ARGS),
                     ("unified_short_host", _short_host(UNIFIED_ARGS) + ("--histate-ssd-dir", str(ssd_root / "unified"))))


def test_the_unified_pool_on_a_short_host_keeps_write_through_and_answers_as_stock_cold(pair, fleet):
    reference, server = pair
    assert metric_sum(server.url, "histate_host_write_policy", policy="write_through", chosen_by="histate") == 1
    assert "HiState: --hicache-write-policy not given: write_through" in server.log_path.read_text(errors="replace")
    session = AgentSession(1, tokens(random.Random(8), 2 * PAGE_NUM_TOKENS + 17))
    seen: list = []
    for turn, kind in enumerate(AgentSession.KINDS):
        prompt = session.next_prompt(turn)
        where = f"turn {turn} ({kind}, {len(prompt)} tokens)"
        served = assert_exact(reference, server, where, prompt)
        bound = max((common_prefix_len(prompt, context) for context in seen), default=0)
        assert served.cached_tokens <= min(bound, len(prompt) - 1), f"{where}: {served.cached_tokens} cached"
        session.record(prompt, served)
        seen.extend([prompt, session.contexts[-1]])
    rng = random.Random(2)
    prompts = [tokens(rng, 640) for _ in range(4)]  # each pushes the one before off the 1,024-token device
    for i, prompt in enumerate(prompts):
        assert_exact(reference, server, f"prompt {i}", prompt)
    assert metric_sum(server.url, "histate_evictions_total", tier="device") > 0, "the device never evicted"
    for i, prompt in enumerate(prompts[:3]):
        assert_exact(reference, server, f"prompt {i} + 24", prompt + tokens(rng, 24))
    fleet.stop("unified_short_host")
