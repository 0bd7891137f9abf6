"""HiState's default device pool (SGLang's unified pool, page-major KV) answers as stock SGLang cold (R3).

`--histate-device-pool unified` implies SGLang's `--enable-unified-memory` and its page-major KV layout,
where a KV slot's virtual id (`req_to_token`) and physical id (where the pool keeps it) differ, so
attention must write through the iteration's `KVLocPlan` and read through the `KVIndexTranslator`.
SGLang's CPU backend, torch_native, does neither and is refused (test_launch_refusals.py). This server
runs `--attention-backend triton`, which on this CPU is the stand-in
`sglang_cpu.server.unified_attention.TranslatingTorchAttnBackend` (torch_native's SDPA, KV written with
the plan's physical write ids and read through `KVIndexTranslator.read_table`; patches.py), with SGLang's
and HiState's allow-lists unchanged. The unified allocator's Triton kernels and the host tier's copies
run as torch stand-ins too (patches.py).

Compared with stock SGLang's cold answers (torch_native, static pool, radix cache disabled) to 1e-5 in
fp32: in-pass capture patterns on the untouched tree (as test_captures_exact.py; the interval one found
HiState sizing a KV token at 1 byte on this pool, fixed in `tree_cache.kv_bytes_per_token`), then a
multi-turn agent session (as test_answers.py) with hits on every later turn.
"""
from __future__ import annotations

import random
import time

import pytest

from .client import (PAGE_NUM_TOKENS, AgentSession, assert_branch_point_capture_serves, assert_exact,
                     assert_interval_capture_serves, generate, metric_sum, serve_turn, tokens)
from .conftest import REFERENCE_ARGS

# What the stand-in logs in the scheduler (unified_attention.STAND_IN_NOTICE, TRANSLATED_READ_NOTICE;
# that module imports SGLang, which this process does not)
STAND_IN_NOTICE = "attention backend 'triton' is the CPU stand-in sglang_cpu.server.unified_attention"
TRANSLATED_READ_NOTICE = "unified pool: attention read physical ids that differ from req_to_token's"
# A small device pool (KV and states share its bytes: the unified pool): 1,024 tokens of KV and 8 states,
# so that one prompt pushes another's KV and state to the host (`test_a_prefix_that_left_the_device_...`);
# the host is 4x that.
UNIFIED_ARGS = ("--enable-histate", "--histate-device-pool", "unified", "--attention-backend", "triton",
                "--enable-metrics", "--max-total-tokens", "1024", "--max-mamba-cache-size", "8",
                "--hicache-ratio", "4")


@pytest.fixture(scope="module")
def pair(fleet):
    """(stock cold reference, HiState on the unified pool); the reference is shared with other files. The
    capture test comes first: which states its hits can come from follows from its stream only on a tree
    nobody touched, and HiState's interval plan reads the server's history (test_captures_exact.py)."""
    return fleet.get(("reference", REFERENCE_ARGS), ("unified", UNIFIED_ARGS))


def test_resuming_from_a_branch_point_captured_inside_a_pass_is_exact(pair):
    """S (320 tokens), X2 = S + 192, Y2 = S + 149 (diverges from X2 at 320, inside Y2's pass), V2 = S + 144:
    V2 can resume at 320 only from the state Y2's pass captured at its branch point (neither prompt
    ends there), written by the GDN layers into a unified-pool slot and read back through it."""
    reference, unified = pair
    assert_branch_point_capture_serves(reference, unified, random.Random(5))


def test_resuming_from_an_interval_capture_inside_a_pass_is_exact(pair):
    """X (512 new tokens), then Y = X[:256] + 149: a hit of Y strictly inside (0, 512) can only be a
    state captured inside X's pass (test_captures_exact.py). This found HiState sizing a KV token on
    the unified pool at 1 byte (SGLang's unified sub-pools report 0 from `get_kv_size_bytes()`), which
    planned no interval checkpoint at all (`tree_cache.kv_bytes_per_token`)."""
    reference, unified = pair
    assert_interval_capture_serves(reference, unified, random.Random(3))


def test_a_multi_turn_session_on_the_unified_pool_answers_as_stock_cold(pair):
    reference, unified = pair
    session = AgentSession(0, tokens(random.Random(7), 2 * PAGE_NUM_TOKENS + 17))
    seen: list = []
    report = []
    for turn in range(len(AgentSession.KINDS)):
        where, served, bound = serve_turn(reference, unified, session, turn, seen)
        if turn > 0:
            assert served.cached_tokens > 0, f"{where}: nothing served from the cache"
        report.append(f"{where}: cached {served.cached_tokens} of a {bound}-token shared prefix")
    print("\n".join(report))


def test_a_prefix_that_left_the_device_is_loaded_back_from_the_host_exactly(pair):
    """A (640 tokens), then a 640-token prompt, which cannot fit next to A in the 1,024-token device pool
    and so pushes A off it, then A + 24: served from the host tier (its KV copied back into the unified
    pool's strided per-layer rows, its state into a unified-pool slot) and answered as stock cold."""
    reference, unified = pair
    rng = random.Random(1)
    a = tokens(rng, 640)
    backed_up = metric_sum(unified.url, "hicache_backup_tokens_total", pool="kv")
    assert_exact(reference, unified, "A", a)
    # The precondition: A's KV is on the host (write-through is asynchronous; under load its ack can come
    # after the next request has already pushed A off the device, which then reuses less: slower, never wrong).
    deadline = time.monotonic() + 60
    while metric_sum(unified.url, "hicache_backup_tokens_total", pool="kv") < backed_up + len(a):
        assert time.monotonic() < deadline, "A's KV was not backed up to the host within 60 s"
        time.sleep(0.2)
    generate(unified.url, tokens(rng, 640))
    host_hits, loaded = metric_sum(unified.url, "histate_prefix_hits_total", tier="host"), \
        metric_sum(unified.url, "load_back_tokens_total", pool="kv")
    served = assert_exact(reference, unified, "A + 24", a + tokens(rng, 24))
    # All of A (640) when its terminal state is still on the host; the host's state slots are a few staging
    # slots the second prompt's backups compete for, ranked by eq. 7 at wall-clock times, so on a loaded
    # machine that state can go first and A + 24 resumes from A's checkpoint at 512 (seen once in a full
    # suite run; slower, never wrong). Either way the reuse is a host hit, loaded back, checked below.
    assert served.cached_tokens in (512, len(a)), f"A + 24 reused {served.cached_tokens} tokens"
    assert metric_sum(unified.url, "histate_prefix_hits_total", tier="host") > host_hits, "the hit was not the host's"
    assert metric_sum(unified.url, "load_back_tokens_total", pool="kv") >= loaded + served.cached_tokens


def test_the_server_runs_the_unified_pool_through_the_translating_stand_in(pair):
    _, unified = pair
    log = unified.log_path.read_text(errors="replace")
    assert "'enable_unified_memory': True" in log and "'enable_page_major_kv_layout': True" in log
    assert "UNIFIED MEMORY POOL ENABLED" in log
    assert STAND_IN_NOTICE in log, "the 'triton' backend is not the CPU stand-in"
    # The pool's physical ids differ from the virtual ones the scheduler stores, so a read of raw
    # req_to_token rows (what torch_native does) would read other slots than the ones written.
    assert TRANSLATED_READ_NOTICE in log
