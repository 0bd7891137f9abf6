"""Engine: exact event times for queueing, head-of-line blocking, restores and background writes.

Most tests use a stub step cost with dyadic constants (1/1024 s per prefill token, 1/128 s per
decode step), so every expected time is exact in binary floating point.
"""
import random

import pytest

from histate.sim.costs import CPU_TIER, GPU_TIER, H100_SXM, QWEN35_9B, SSD_TIER, PrefillChunk, RooflineStepCost
from histate.sim.engine import Engine, EngineConfig, EngineRequest, _cumulative

TOKEN_S = 1 / 1024
DECODE_S = 1 / 128


class StubCost:
    """Prefill: TOKEN_S per token; a step with decode tokens adds DECODE_S; no overhead."""

    def step_time_s(self, chunks, num_decode=0, decode_context_sum=0):
        return TOKEN_S * sum(c.num_tokens for c in chunks) + (DECODE_S if num_decode else 0.0)

    def decode_coefficients(self, num_decode, context_sum):
        return 0.0, DECODE_S, 0.0, 0.0, 0.0


def engine(**config):
    return Engine(QWEN35_9B, H100_SXM, EngineConfig(**config), step_cost=StubCost())


def req(rid, n, out=1, ctx=None, **kw):
    return EngineRequest(rid, n, ctx if ctx is not None else n, out, **kw)


def drain(eng, until=float("inf")):
    """All events up to `until`, as (kind, request id, time)."""
    out = []
    while True:
        events = eng.advance_until(until)
        if not events:
            return out
        out += [(e.kind.name, e.request_id, e.time_s) for e in events]


def test_lone_request_chunked_prefill_then_decode():
    eng = engine(token_budget_per_step=8192)
    timing = eng.submit(req("a", 16384, out=3), 0.0)
    assert eng.advance_until(10.0) == [] and eng.now_s == 10.0       # first chunk ends at 8, second at 16
    assert drain(eng) == [("FIRST_TOKEN", "a", 16.0), ("FINISHED", "a", 16.0 + 2 * DECODE_S)]
    assert (timing.ttft_s, timing.restore_s, timing.queue_s, timing.prefill_s) == (16.0, 0.0, 0.0, 16.0)
    assert (eng.stats.prefill_steps, eng.stats.decode_only_steps, eng.stats.prefill_tokens) == (2, 2, 16384)
    assert not eng.has_work() and eng.next_event_time() == float("inf")
    assert eng.advance_until(float("inf")) == [] and eng.now_s == 16.0 + 2 * DECODE_S   # idle: clock stays


def test_head_of_line_blocking_behind_a_long_prefill():
    eng = engine(token_budget_per_step=8192)
    eng.submit(req("long", 16384, out=2), 0.0)
    assert eng.advance_until(1.0) == []
    short = eng.submit(req("short", 128), 1.0)      # arrives during the first chunk
    # Step 2 (8..16) is all "long"; step 3 carries long's decode token and short's 128 tokens.
    end3 = 16.0 + 128 * TOKEN_S + DECODE_S
    assert drain(eng) == [("FIRST_TOKEN", "long", 16.0), ("FINISHED", "long", end3),
                          ("FIRST_TOKEN", "short", end3), ("FINISHED", "short", end3)]
    assert short.ttft_s == end3 - 1.0 and short.queue_s == 15.0 and short.prefill_start_s == 16.0


def test_short_request_shares_the_last_chunk_when_budget_remains():
    eng = engine(token_budget_per_step=8192)
    eng.submit(req("long", 16000), 0.0)
    eng.advance_until(1.0)
    eng.submit(req("short", 100), 1.0)
    end2 = 8192 * TOKEN_S + (7808 + 100) * TOKEN_S
    assert drain(eng) == [("FIRST_TOKEN", "long", end2), ("FINISHED", "long", end2),
                          ("FIRST_TOKEN", "short", end2), ("FINISHED", "short", end2)]


def test_a_request_never_joins_a_running_step():
    eng = engine()
    eng.submit(req("a", 1024), 0.0)                 # one step: 0 .. 1.0
    eng.advance_until(0.5)
    eng.submit(req("b", 64), 0.5)
    assert drain(eng) == [("FIRST_TOKEN", "a", 1.0), ("FINISHED", "a", 1.0),
                          ("FIRST_TOKEN", "b", 1.0 + 64 * TOKEN_S), ("FINISHED", "b", 1.0 + 64 * TOKEN_S)]


@pytest.mark.parametrize("mixed", [True, False])
def test_decode_interleaves_with_prefill_only_in_mixed_batches(mixed):
    eng = engine(token_budget_per_step=8192, mixed_batches=mixed)
    a = eng.submit(req("a", 128, out=1000), 0.0)    # first token at 0.125, then 1/128 s per token
    assert drain(eng, 1.0) == [("FIRST_TOKEN", "a", 0.125)]
    eng.submit(req("b", 16384), 1.0)                # 112 decode steps fit in 0.125 .. 1.0 exactly
    events = drain(eng)
    b_first = dict(((k, r), t) for k, r, t in events)[("FIRST_TOKEN", "b")]
    if mixed:   # each of b's steps also decodes one token of a, and b gets budget 8191
        assert b_first == 1.0 + 16384 * TOKEN_S + 3 * DECODE_S
        assert a.finish_s == b_first + (999 - 112 - 3) * DECODE_S
    else:       # prefill steps run alone: a stalls for 16 s
        assert b_first == 1.0 + 16.0
        assert a.finish_s == 17.0 + (999 - 112) * DECODE_S
    assert a.first_token_s == 0.125


def test_max_running_requests_holds_back_new_prefills():
    eng = engine(max_running_requests=1)
    a = eng.submit(req("a", 64, out=3), 0.0)
    b = eng.submit(req("b", 64), 0.0)
    drain(eng)
    assert a.finish_s == 64 * TOKEN_S + 2 * DECODE_S
    assert b.prefill_start_s == a.finish_s and b.first_token_s == a.finish_s + 64 * TOKEN_S


def test_a_slot_is_held_until_the_step_that_finishes_its_request_ends():
    """With one slot, b arrives while a's decode steps, already committed, run until a's finish: b is
    admitted when a finishes, not at its arrival (a's slot, memory and cache insert come with its
    FINISHED event). Before the fix b was admitted at 0.07 and matched the cache before a's insert."""
    eng = engine(max_running_requests=1)
    a = eng.submit(req("a", 64, out=11), 0.0)               # first token at 1/16, then 10 decode steps
    assert drain(eng, 0.0625) == [("FIRST_TOKEN", "a", 0.0625)]
    finish_a = 0.0625 + 10 * DECODE_S
    arrival_b = finish_a - DECODE_S / 2                      # during a's last decode step
    assert eng.advance_until(arrival_b) == []                # the steps up to a's finish are committed
    b = eng.submit(req("b", 64), arrival_b)
    assert drain(eng) == [("FINISHED", "a", finish_a), ("FIRST_TOKEN", "b", finish_a + 64 * TOKEN_S),
                          ("FINISHED", "b", finish_a + 64 * TOKEN_S)]
    assert a.finish_s == finish_a and b.admitted_s == finish_a


# ------------------------------------------------------------------------------------- restores
def test_restore_follows_eq2_and_overlaps_cpu_with_ssd_reads():
    eng = engine()
    kv = 32768 * QWEN35_9B.kv_bytes_per_token
    ckpt = QWEN35_9B.ssm_state_bytes
    t = eng.submit(req("a", 64, ctx=32768 + 64, kv_restore_bytes_by_tier={CPU_TIER: kv, GPU_TIER: 10**12},
                       checkpoint_restore_bytes=ckpt, checkpoint_tier=SSD_TIER), 0.0)
    cpu_part, ssd_read, ssd_h2d = kv / 64e9, ckpt / 5e9, ckpt / 64e9
    assert t.restore_done_s == pytest.approx(max(cpu_part + ssd_h2d, ssd_read + ssd_h2d), rel=1e-12)
    assert t.restore_transfer_s == t.restore_done_s
    drain(eng)
    assert t.ttft_s == pytest.approx(t.restore_done_s + 64 * TOKEN_S, rel=1e-12)
    # A lone checkpoint from SSD: the paper's 10.9 ms (48 MiB SSM state).
    t2 = engine().submit(req("b", 1, ctx=10, checkpoint_restore_bytes=ckpt, checkpoint_tier=SSD_TIER), 0.0)
    assert round(t2.restore_done_s * 1e3, 1) == 10.9


def test_concurrent_restores_queue_on_the_links():
    eng = engine()
    size = 64 * 10**7                                  # 10 ms over H2D at 64 GB/s
    a = eng.submit(req("a", 1, ctx=2, kv_restore_bytes_by_tier={CPU_TIER: size}), 0.0)
    b = eng.submit(req("b", 1, ctx=2, kv_restore_bytes_by_tier={CPU_TIER: size}), 0.0)
    assert a.restore_done_s == pytest.approx(0.01) and b.restore_done_s == pytest.approx(0.02)
    assert b.restore_transfer_s == pytest.approx(0.01) and b.restore_s == pytest.approx(0.02)
    assert eng.h2d.stats.foreground_wait_s == pytest.approx(0.01)


def test_background_writes_delay_a_restore_by_at_most_the_unit_in_flight():
    unit = 5 * 10**7                                   # 10 ms of SSD time at 5 GB/s
    eng = engine(io_unit_bytes=unit)
    eng.submit_transfer(10 * unit, GPU_TIER, SSD_TIER, 0.0)          # 100 ms of checkpoint writes
    eng.advance_until(0.015)
    t = eng.submit(req("r", 1, ctx=2, checkpoint_restore_bytes=unit, checkpoint_tier=SSD_TIER), 0.015)
    # The second write unit (10..20 ms) finishes, then the read (10 ms), then its H2D hop.
    assert t.restore_done_s == pytest.approx(0.020 + 0.010 + unit / 64e9, rel=1e-12)
    assert eng.ssd.stats.waited_on_background_s == pytest.approx(0.005)
    # Background resumes after the read: 8 units left at 30 ms, done at 110 ms.
    assert eng.ssd.backlog_s(0.030) == pytest.approx(0.080)
    assert eng.ssd.backlog_s(0.111) == 0.0
    assert eng.d2h.stats.background_bytes == 10 * unit and eng.ssd.stats.background_bytes == 10 * unit
    eng.submit_transfer(unit, CPU_TIER, None, 0.2)                   # a drop moves nothing
    assert eng.ssd.stats.background_bytes == 10 * unit


# ------------------------------------------------------------------------- SGLang's layer-wise load-back
LAYERS = 32  # Qwen3.5-9B: HiCache's load-back is a pipeline of one copy per layer
HALF_SECOND_H2D = 32 * 10**9  # bytes: 0.5 s over H2D at 64 GB/s


@pytest.mark.parametrize("layerwise, n, ttft", [
    (False, 256, 0.5 + 0.25),                  # the copy, then the step (vLLM's connector; the default)
    (True, 256, 0.5 + 0.25 / LAYERS),          # load-bound: the last layer's copy, then one layer of compute
    (True, 1024, 0.5 / LAYERS + 1.0),          # compute-bound: the first layer's copy, then the whole step
])
def test_a_host_restore_overlaps_the_forward_layer_by_layer(layerwise, n, ttft):
    eng = engine(layerwise_load=layerwise)
    t = eng.submit(req("a", n, ctx=n + 4096, kv_restore_bytes_by_tier={CPU_TIER: HALF_SECOND_H2D}), 0.0)
    drain(eng)
    assert t.ttft_s == pytest.approx(ttft, rel=1e-12)
    assert t.restore_done_s == pytest.approx(0.5, rel=1e-12)  # the data is resident when its copy ends


def test_a_batch_waits_for_its_members_layers():
    """SGLang's forward waits per layer for the batch's load-back: a request with nothing to load that
    shares the step ends when the loading one does (without the overlap it would run first, alone)."""
    eng = engine(layerwise_load=True)
    a = eng.submit(req("a", 256, ctx=4096, kv_restore_bytes_by_tier={CPU_TIER: HALF_SECOND_H2D}), 0.0)
    b = eng.submit(req("b", 256), 0.0)
    drain(eng)
    end = 0.5 + 0.5 / LAYERS                   # 512 tokens: 0.5 s of compute, load-bound
    assert a.ttft_s == pytest.approx(end, rel=1e-12) and b.ttft_s == pytest.approx(end, rel=1e-12)
    assert eng.stats.prefill_steps == 1 and eng.stats.busy_s == pytest.approx(end, rel=1e-12)
    assert eng.stats.load_wait_s == pytest.approx(end - 0.5, rel=1e-12)
    eng = engine()
    a, b = (eng.submit(req("a", 256, ctx=4096, kv_restore_bytes_by_tier={CPU_TIER: HALF_SECOND_H2D}), 0.0),
            eng.submit(req("b", 256), 0.0))
    drain(eng)
    assert (b.ttft_s, a.ttft_s) == (0.25, pytest.approx(0.75, rel=1e-12))


def test_ssd_bytes_reach_host_memory_before_the_request_runs():
    """An SSD checkpoint is read into host memory first (SGLang's storage prefetch), then loaded
    layer by layer like any host hit; later chunks of the same prompt find their prefix resident."""
    ckpt = QWEN35_9B.ssm_state_bytes
    read_s, load_s = ckpt / 5e9, ckpt / 64e9
    eng = engine(layerwise_load=True, token_budget_per_step=1024)
    t = eng.submit(req("a", 2048, ctx=2048 + 640, checkpoint_restore_bytes=ckpt, checkpoint_tier=SSD_TIER), 0.0)
    drain(eng)
    first = max(read_s + load_s / LAYERS + 1.0, read_s + load_s + 1.0 / LAYERS)
    assert t.prefill_start_s == pytest.approx(read_s, rel=1e-12)
    assert t.ttft_s == pytest.approx(first + 1.0, rel=1e-12)   # the second 1,024-token chunk is not stretched


# ------------------------------------------------------------------------- fast-forward exactness
def test_fast_forward_matches_step_by_step_roofline():
    cost = RooflineStepCost(QWEN35_9B, H100_SXM)
    for probe in (None, 0.3):
        eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(), step_cost=cost)
        a = eng.submit(req("a", 1, out=300, ctx=5000), 0.0)
        b = eng.submit(req("b", 1, out=100, ctx=20000), 0.0)
        if probe is not None:                       # split the decode run at an arbitrary time
            assert drain(eng, probe) == [("FIRST_TOKEN", "a", a.first_token_s), ("FIRST_TOKEN", "b", b.first_token_s)]
            assert eng.now_s == probe
        drain(eng)
        t = cost.step_time_s([PrefillChunk(1, 4999, True), PrefillChunk(1, 19999, True)])
        assert a.first_token_s == b.first_token_s == pytest.approx(t, rel=1e-12)
        for j in range(99):
            t += cost.step_time_s([], 2, 25000 + 2 * j)
        assert b.finish_s == pytest.approx(t, rel=1e-12)
        for j in range(200):
            t += cost.step_time_s([], 1, 5099 + j)
        assert a.finish_s == pytest.approx(t, rel=1e-12)
        assert eng.stats.decode_tokens == 299 + 99


def test_cumulative_sum_of_max_of_two_lines_is_exact():
    rng = random.Random(7)
    for _ in range(300):
        o, a, b, c, d = (rng.uniform(0, 2) for _ in range(5))
        if rng.random() < 0.5:
            b = -b / 50
        k = rng.randint(0, 60)
        brute = sum(o + max(a + b * j, c + d * j) for j in range(k))
        assert _cumulative(o, a, b, c, d, k) == pytest.approx(brute, rel=1e-9, abs=1e-12)


def test_arrival_during_decode_splits_the_fast_forward_exactly():
    eng = engine()
    a = eng.submit(req("a", 128, out=100), 0.0)
    drain(eng, 0.5)                                   # decode steps start at 0.125 + j / 128
    eng.submit(req("b", 64), 0.5)                     # arrives exactly at a step boundary (j = 48)
    events = drain(eng)
    start_b = 0.125 + 48 * DECODE_S
    assert ("FIRST_TOKEN", "b", start_b + 64 * TOKEN_S + DECODE_S) in events
    # a produced 48 tokens before b's step, one inside it, and its last 50 after it.
    assert a.finish_s == start_b + 64 * TOKEN_S + DECODE_S + 50 * DECODE_S


def test_input_validation():
    eng = engine()
    eng.advance_until(5.0)
    with pytest.raises(ValueError, match="backwards"):
        eng.submit(req("a", 1), 4.0)
    with pytest.raises(ValueError, match="exceeds"):
        eng.submit(EngineRequest("b", 10, 5, 1), 5.0)
    with pytest.raises(ValueError, match="unknown tier"):
        eng.submit(req("c", 1, kv_restore_bytes_by_tier={7: 1}), 5.0)
    t = eng.submit(EngineRequest("d", 0, 640, 1), 5.0)   # a full hit still computes one token
    assert t.num_compute_tokens == 1
    assert drain(eng) == [("FIRST_TOKEN", "d", 5.0 + TOKEN_S), ("FINISHED", "d", 5.0 + TOKEN_S)]


def test_core_tier_enums_are_accepted_as_tiers():
    core_types = pytest.importorskip("histate.core.types")
    Tier = core_types.Tier
    kv = {Tier.GPU: 10**9, Tier.CPU: 64 * 10**6, Tier.SSD: 5 * 10**6}
    a = engine().submit(req("a", 1, ctx=2, kv_restore_bytes_by_tier=kv, checkpoint_restore_bytes=10**6,
                            checkpoint_tier=Tier.SSD), 0.0)
    b = engine().submit(req("b", 1, ctx=2, kv_restore_bytes_by_tier={GPU_TIER: 10**9, CPU_TIER: 64 * 10**6,
                                                                      SSD_TIER: 5 * 10**6},
                            checkpoint_restore_bytes=10**6, checkpoint_tier=SSD_TIER), 0.0)
    assert a.restore_done_s == b.restore_done_s == pytest.approx(max(70e6 / 64e9, 6e6 / 5e9 + 6e6 / 64e9))


def test_short_prefill_first_runs_a_short_prefill_beside_the_long_chunk():
    # The head-of-line case above with the cap (core/prefill_order.py), pages of 64 tokens: in step 2
    # the short request's 128 tokens (2 pages) go first and long takes 8192 - 128 = 8064; long's last
    # 128 tokens run in step 3, which ends at 16 + 128 TOKEN_S like before (it carries no decode: long
    # had none yet, short finished in step 2).
    from histate.core import ShortPrefillFirst

    eng = engine(token_budget_per_step=8192, mixed_batches=False, short_prefill_first=ShortPrefillFirst(max_yields=4),
                 block_num_tokens=64)
    long_t = eng.submit(req("long", 16384, out=1), 0.0)
    assert eng.advance_until(1.0) == []
    short = eng.submit(req("short", 128), 1.0)
    end2 = 8.0 + (128 + 8064) * TOKEN_S
    end3 = end2 + 128 * TOKEN_S
    assert drain(eng) == [("FIRST_TOKEN", "short", end2), ("FINISHED", "short", end2),
                          ("FIRST_TOKEN", "long", end3), ("FINISHED", "long", end3)]
    assert short.ttft_s == end2 - 1.0
    assert long_t.step_end_tokens == [8192, 16256, 16384]


def test_short_prefill_first_ages_out_after_max_yields():
    # Every step is 8 s of 8192 tokens. A 64-token request arrives at 8k + 0.5 s, during step k+1, so
    # shorts wait before every step. max_yields=1: long is capped, then runs uncapped, and so on.
    #   step 1 (0-8):   long 8192                 (nothing waited)
    #   step 2 (8-16):  s0 64,      long 8128     (capped, 1 yield)
    #   step 3 (16-24): long 8192                 (aged out: uncapped; s1 waits, no budget left)
    #   step 4 (24-32): s1, s2 128, long 8064     (capped again)
    #   step 5 (32-):   long's last 192, s3 64    (aged out; both fit anyway)
    from histate.core import ShortPrefillFirst

    eng = engine(token_budget_per_step=8192, mixed_batches=False, short_prefill_first=ShortPrefillFirst(max_yields=1),
                 block_num_tokens=64)
    long_t = eng.submit(req("long", 4 * 8192, out=1), 0.0)
    for k in range(4):
        drain(eng, 8 * k + 0.5)
        eng.submit(req(f"s{k}", 64), 8 * k + 0.5)
    drain(eng)
    ends = long_t.step_end_tokens
    assert [b - a for a, b in zip([0] + ends, ends)] == [8192, 8128, 8192, 8064, 192]
    assert long_t.first_token_s == 32.0 + (192 + 64) * TOKEN_S   # 0.25 s later than alone


def test_long_prefill_token_threshold_caps_every_prefill_per_step():
    # vLLM's --long-prefill-token-threshold 4096: long takes 4096 tokens a step; the short request that
    # arrived during step 1 joins step 2 beside long's 4096 instead of waiting for long to finish.
    eng = engine(token_budget_per_step=8192, long_prefill_token_threshold=4096)
    long_t = eng.submit(req("long", 16384), 0.0)
    eng.advance_until(1.0)
    short = eng.submit(req("short", 128), 1.0)
    end2 = 4.0 + (4096 + 128) * TOKEN_S
    assert drain(eng) == [("FIRST_TOKEN", "short", end2), ("FINISHED", "short", end2),
                          ("FIRST_TOKEN", "long", end2 + 8.0), ("FINISHED", "long", end2 + 8.0)]
    assert long_t.step_end_tokens == [4096, 8192, 12288, 16384] and short.ttft_s == end2 - 1.0
    with pytest.raises(ValueError):
        EngineConfig(long_prefill_token_threshold=-1)
