"""HiState in SGLang's server under HiCache's write_back (issue 28, item 1), which HiState picks by itself.

With write_back the host holds what the device evicted instead of a mirror of the device (SGLang copies
nothing at insert; unified_tree_core.py:1108-1109, 1432-1433), which is what a host not much larger than the
device needs. No `--hicache-write-policy` is given: with an SSD tier and a host KV pool at most 1.8x the
device pool HiState switches HiCache to write_back at start (sglang_plugin/write_policy.py), and says so on
/metrics. A small device pool (2,048 tokens) and `--hicache-ratio 1.5` (a host KV pool 1.34x the device pool
after HiState's split): twelve 900-token prompts push the
first ones off the device (KV written back to the host; each checkpoint went to the SSD at creation, and a
historical one then leaves the device), then off the host (KV written ahead to the SSD). Every answer, and every earlier prompt asked again, extended, must equal
stock SGLang's cold answer; the probes must reuse a checkpoint from the host or the SSD.
(The same placement on SGLang's classes, with every state compared to a cold prefill and no state left
without a copy: test/sglang/test_write_back.py.)
"""
from __future__ import annotations

import random

import pytest

from .client import assert_exact, metric_sum, tokens
from .conftest import HISTATE_ARGS

NUM_PROMPTS, PROMPT_NUM_TOKENS = 12, 900


@pytest.fixture(scope="module")
def write_back_args(ssd_root) -> tuple:
    return HISTATE_ARGS + ("--max-total-tokens", "2048", "--hicache-ratio", "1.5",
                           "--histate-ssd-dir", str(ssd_root / "write_back"))


def test_write_back_answers_exactly_and_serves_from_host_and_ssd(servers, fleet, write_back_args):
    reference = servers.reference
    (server,) = fleet.get(("write_back", write_back_args))
    assert metric_sum(server.url, "histate_host_write_policy", policy="write_back", chosen_by="histate") == 1
    # the standard HiState server (SGLang's default --hicache-ratio 2: a host KV pool 1.94x the device's)
    # keeps write_through, by HiState's choice too
    assert metric_sum(servers.histate.url, "histate_host_write_policy", policy="write_through", chosen_by="histate") == 1
    rng = random.Random(21)
    prompts = [tokens(rng, PROMPT_NUM_TOKENS) for _ in range(NUM_PROMPTS)]
    for i, prompt in enumerate(prompts):
        assert_exact(reference, server, f"prompt {i}", prompt)
        if i == 1 and not metric_sum(server.url, "histate_evictions_total", tier="device"):
            # nothing left the device yet: under write_back no KV reached the host or the SSD, and each
            # checkpoint went to the SSD at creation, alone (sglang_plugin/state_writes.py)
            assert metric_sum(server.url, "histate_state_writes_total", result="stored") >= 2, \
                "no checkpoint was written to the SSD at creation"
            assert metric_sum(server.url, "histate_kv_demoted_tokens_total") == 0, "write_back wrote KV at insert"
    assert metric_sum(server.url, "histate_evictions_total", tier="device") > 0, "the device never evicted"
    assert metric_sum(server.url, "histate_ssd_written_bytes_total") > 0, "nothing was written to the SSD"
    assert metric_sum(server.url, "histate_state_writes_total", result="failed") == 0
    assert metric_sum(server.url, "histate_checkpoints_homed_total") > 0, "no historical checkpoint left the device"
    before = {tier: metric_sum(server.url, "histate_prefix_hits_total", tier=tier) for tier in ("host", "storage")}
    cached = [assert_exact(reference, server, f"prompt {i} + 100", prompt + [5 + j % 300 for j in range(100)])
              .cached_tokens for i, prompt in enumerate(prompts[:8])]
    assert min(cached) >= 512, f"an earlier prompt asked again was not served from the tiers: {cached}"
    after = {tier: metric_sum(server.url, "histate_prefix_hits_total", tier=tier) for tier in ("host", "storage")}
    assert sum(after.values()) > sum(before.values()), f"no checkpoint reused from the host or the SSD: {after}"
    fleet.stop("write_back")
