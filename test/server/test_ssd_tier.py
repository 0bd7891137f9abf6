"""HiState's SSD tier inside SGLang's server: hits after a flush, after a restart, after a SIGKILL.

One HiState server with a small device pool (2,048 tokens) so that prompts leave the device and the
host: the SSD is the host's victim tier for KV (host KV is written ahead of its eviction), and every
checkpoint is written through. Then, in order, each step answering exactly as stock SGLang cold:
  1. after `POST /flush_cache` (device and host emptied; SSD objects kept), an earlier prompt extended
     is served from the SSD: its KV pages and a state, through SGLang's L3 prefetch;
  2. after a restart on the same SSD directory, the same;
  3. the scheduler is SIGKILLed while a burst of new prompts is being served and written; a restart on
     the same directory answers exactly (a torn write is a miss, never a wrong state).
"""
from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from .client import assert_exact, flush_cache, generate, metric_sum, tokens
from .conftest import HISTATE_ARGS

NUM_PROMPTS, PROMPT_NUM_TOKENS = 16, 900


@pytest.fixture(scope="module")
def small_args(ssd_root) -> tuple:
    # write_through named: with a host this small HiState would pick write_back (test_write_back.py covers it)
    return HISTATE_ARGS + ("--max-total-tokens", "2048", "--hicache-ratio", "1", "--hicache-write-policy", "write_through",
                           "--histate-ssd-dir", str(ssd_root / "small"))


@pytest.fixture(scope="module")
def prompts() -> list:
    rng = random.Random(11)
    return [tokens(rng, PROMPT_NUM_TOKENS) for _ in range(NUM_PROMPTS)]


def _probe(prompt: list) -> list:
    return prompt + [5 + i % 300 for i in range(100)]


def _ssd_hits(reference, server, prompts: list) -> list:
    """cached_tokens of each earlier prompt, extended, asked again (each answer checked exact)."""
    return [assert_exact(reference, server, f"prompt {i} + 100", _probe(p)).cached_tokens
            for i, p in enumerate(prompts[:4])]


def test_flush_restart_and_sigkill_leave_hits_and_exact_answers(servers, fleet, small_args, prompts):
    reference = servers.reference
    (small,) = fleet.get(("small", small_args))
    assert metric_sum(small.url, "histate_host_write_policy", policy="write_through", chosen_by="operator") == 1
    for i, prompt in enumerate(prompts):
        assert_exact(reference, small, f"prompt {i}", prompt)
    assert metric_sum(small.url, "histate_kv_demoted_tokens_total") > 0, "no host KV reached the SSD"

    flush_cache(small.url)
    after_flush = _ssd_hits(reference, small, prompts)
    assert max(after_flush) >= 512, f"nothing served from the SSD after a flush: {after_flush}"
    assert metric_sum(small.url, "histate_ssd_read_bytes_total") > 0

    fleet.stop("small")
    (small,) = fleet.get(("small", small_args))
    after_restart = _ssd_hits(reference, small, prompts)
    assert max(after_restart) >= 512, f"nothing served from the SSD after a restart: {after_restart}"

    rng = random.Random(12)
    burst = [tokens(rng, PROMPT_NUM_TOKENS) for _ in range(6)]
    threads = [threading.Thread(target=lambda p=p: _swallow(small.url, p)) for p in burst]
    for thread in threads:
        thread.start()
    (scheduler,) = small.child_pids("sglang::scheduler")
    _wait_for_ssd_writes(small.url)
    os.kill(scheduler, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=120)
    fleet.stop("small")
    (small,) = fleet.get(("small", small_args))
    for i, prompt in enumerate(burst + [_probe(p) for p in prompts[:4]]):
        assert_exact(reference, small, f"after the SIGKILL, request {i}", prompt)
    fleet.stop("small")  # nothing else uses it: give its memory back to the rest of the session


def _swallow(url: str, prompt: list) -> None:
    try:
        generate(url, prompt)
    except Exception:  # the server is killed under it
        pass


def _wait_for_ssd_writes(url: str, timeout_s: float = 60.0) -> None:
    """Until the server has written to the SSD since the burst began (so the kill lands mid-write)."""
    import time

    start = metric_sum(url, "histate_ssd_written_bytes_total")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and metric_sum(url, "histate_ssd_written_bytes_total") <= start:
        time.sleep(0.05)
