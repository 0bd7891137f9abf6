"""Engines under memory pressure: SGLang's reserve rule, vLLM's block allocation with preemption by
recompute, align-mode step ends, and what a finished request leaves in the cache (admission.py).

Exact times use the stub step cost of test_engine.py (1/1024 s per prefill token, 1/128 s per decode
step); caches use the tiny sizes of test/core/helpers.py (1 byte of KV per token, 64-token pages,
a state = 4 pages)."""
import math

import pytest

from histate.core import HybridPrefixCache, ItemKind, Tier, make_policy
from histate.sim.admission import CacheGate, EngineProfile
from histate.sim.costs import H100_SXM, QWEN35_9B
from histate.sim.engine import Engine, EngineConfig, EngineRequest, MemoryGate
from histate.sim.replay import GiB, ReplayConfig, replay
from histate.sim.request import Request, Session, Workload, WorkloadStats

from ..core.helpers import tiny_config
from .test_engine import DECODE_S, TOKEN_S, StubCost, drain

P = 64


def request(uid, num_pages, out, sid=None, keys=None):
    keys = keys if keys is not None else tuple((uid, i) for i in range(num_pages))
    return Request(uid=uid, session_id=sid or f"s{uid}", index=0, input_num_tokens=num_pages * P,
                   output_num_tokens=out, page_keys=keys, gap_before_s=0.0)


def setup(policy, profile, **cache_kw):
    cache = HybridPrefixCache(tiny_config(**cache_kw), make_policy(policy))
    gate = CacheGate(cache, profile)
    engine = Engine(QWEN35_9B, H100_SXM, profile.engine, step_cost=StubCost(), gate=gate)
    return cache, gate, engine


def submit(engine, gate, req, t):
    gate.register(req)
    return engine.submit(EngineRequest(req.uid, req.input_num_tokens, req.input_num_tokens, req.output_num_tokens), t)


def run(engine, gate):
    """Drain the engine, handing every finished request to the gate as the replay driver does."""
    events = []
    while True:
        batch = engine.advance_until(math.inf)
        if not batch:
            return events
        for ev in batch:
            events.append((ev.kind.name, ev.request_id, ev.time_s))
            if ev.kind.name == "FINISHED":
                gate.finish(ev.request_id, ev.timing.step_end_tokens, ev.time_s)


SGLANG = EngineProfile("sglang", EngineConfig(token_budget_per_step=8192, mixed_batches=False), 1, 3, grows=False)


def vllm_profile(block_tokens=P, budget=1024):
    return EngineProfile("vllm", EngineConfig(token_budget_per_step=budget, mixed_batches=True, chunk_rule="vllm",
                                              block_num_tokens=block_tokens), block_tokens, 1, grows=True)


def test_sglang_admits_a_prefill_only_when_its_kv_and_decode_fit_next_to_running_requests():
    """KV pool 60 pages: A promises 40 pages of prompt + 1 of output, so B (20 + 1 pages) waits until
    A finishes and its KV becomes evictable cache."""
    cache, gate, engine = setup("sglang-hicache", SGLANG, gpu_pages=100, state_fraction={Tier.GPU: 0.4})
    assert cache.ledger.capacity_bytes[(Tier.GPU, ItemKind.KV)] == 60 * P
    a = submit(engine, gate, request(1, 40, out=3), 0.0)
    assert cache.ledger.reserved_bytes[(Tier.GPU, ItemKind.KV)] == 40 * P + 3
    assert cache.ledger.reserved_bytes[(Tier.GPU, ItemKind.CHECKPOINT)] == 3 * 4 * P  # 3 state slots
    b = submit(engine, gate, request(2, 20, out=1), 0.1)
    assert b.admitted_s is None and engine.stats.admissions_deferred == 1
    run(engine, gate)
    a_finish = 40 * P * TOKEN_S + 2 * DECODE_S
    assert a.finish_s == a_finish and b.admitted_s == a_finish == b.prefill_start_s
    assert b.ttft_s == a_finish + 20 * P * TOKEN_S - 0.1
    assert all(v == 0 for v in cache.ledger.reserved_bytes.values())
    cache.check_invariants()


def test_without_memory_pressure_both_run_at_once():
    cache, gate, engine = setup("sglang-hicache", SGLANG, gpu_pages=400, state_fraction={Tier.GPU: 0.2})
    submit(engine, gate, request(1, 40, out=3), 0.0)
    b = submit(engine, gate, request(2, 20, out=1), 0.1)
    assert b.admitted_s == 0.1


def test_vllm_preempts_the_latest_request_when_a_running_one_cannot_grow_and_recomputes_it():
    """Pool 50 pages, budget 1024 tokens: A (30 pages) and B (20 pages) are both admitted with their
    first step's blocks; A's second step needs 14 more pages, so B (admitted last) is preempted
    (vLLM `self.running.pop()`), then admitted again and recomputed once A is done."""
    cache, gate, engine = setup("marconi", vllm_profile(), gpu_pages=50)
    a = submit(engine, gate, request(1, 30, out=2), 0.0)
    b = submit(engine, gate, request(2, 20, out=2), 0.0)
    assert a.admitted_s == b.admitted_s == 0.0
    events = run(engine, gate)
    assert b.num_preemptions == 1 and a.num_preemptions == 0 and engine.stats.preemptions == 1
    assert gate.stats.preemptions == 1
    assert [e[:2] for e in events] == [("FIRST_TOKEN", 1), ("FINISHED", 1), ("FIRST_TOKEN", 2), ("FINISHED", 2)]
    assert b.prefill_start_s is None or b.first_token_s > a.finish_s
    cache.check_invariants()


def test_a_preempted_vllm_request_leaves_its_computed_blocks_in_the_cache():
    cache = HybridPrefixCache(tiny_config(gpu_pages=200), make_policy("marconi"))
    gate = CacheGate(cache, vllm_profile())
    req = request(7, 40, out=2)
    gate.register(req)
    admitted = gate.admit(EngineRequest(7, 40 * P, 40 * P, 2), 40 * P, 0.0, idle=False)
    assert admitted.num_compute_tokens == 40 * P
    gate.preempt(7, 21 * P, [6 * P, 21 * P], 1.0)  # two steps ran: 0..384, 384..1344 tokens
    assert all(v == 0 for v in cache.ledger.reserved_bytes.values())
    again = gate.admit(EngineRequest(7, 40 * P, 40 * P, 2), 40 * P, 2.0, idle=False)
    assert again.num_compute_tokens == 19 * P  # resumes from the state at its last step end
    cache.check_invariants()


def test_vllm_align_mode_ends_steps_on_block_boundaries_and_at_the_last_one():
    """Block 576 tokens, budget 2000: steps of 1728 (3 blocks), then forced to end at 2880 (the last
    block boundary of a 3000-token prompt), then the 120-token tail."""
    eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(token_budget_per_step=2000, chunk_rule="vllm", block_num_tokens=576),
                 step_cost=StubCost())
    t = eng.submit(EngineRequest("a", 3000, 3000, 1), 0.0)
    drain(eng)
    assert t.step_end_tokens == [1728, 2880, 3000]
    assert t.first_token_s == 3000 * TOKEN_S


def test_vllm_rule_skips_a_request_when_the_budget_left_is_under_one_block():
    eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(token_budget_per_step=1000, chunk_rule="vllm", block_num_tokens=576),
                 step_cost=StubCost())
    a = eng.submit(EngineRequest("a", 700, 700, 1), 0.0)   # 576, then the 124-token tail
    b = eng.submit(EngineRequest("b", 1200, 1200, 1), 0.0)  # 424 left in step 1: under a block, skipped
    drain(eng)
    assert a.step_end_tokens == [576, 700]
    assert b.step_end_tokens[0] == 576 and b.prefill_start_s == 576 * TOKEN_S


class _Refuse(MemoryGate):
    def admit(self, req, context_num_tokens, now_s, idle):
        return req if idle else None


def test_a_gate_that_refuses_keeps_fifo_order_and_an_idle_engine_always_admits():
    eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(), step_cost=StubCost(), gate=_Refuse())
    a = eng.submit(EngineRequest("a", 64, 64, 1), 0.0)
    b = eng.submit(EngineRequest("b", 64, 64, 1), 0.0)
    c = eng.submit(EngineRequest("c", 64, 64, 1), 0.01)
    drain(eng)
    assert a.admitted_s == 0.0 and b.admitted_s == a.finish_s and c.admitted_s == b.finish_s


def _turns(sid, pages, outs):
    """One session whose turn i + 1 carries turn i's prompt and output verbatim (append)."""
    reqs, keys = [], ()
    for i, (n, out) in enumerate(zip(pages, outs)):
        keys = keys + tuple((sid, i, j) for j in range(n - len(keys)))
        reqs.append((keys, out))
    built = []
    for i, (keys, out) in enumerate(reqs):
        nxt = reqs[i + 1][0] if i + 1 < len(reqs) else ()
        out_keys = nxt[len(keys):len(keys) + (len(keys) * P + out) // P - len(keys)]
        built.append(Request(uid=100 * i + hash(sid) % 97, session_id=sid, index=i, input_num_tokens=len(keys) * P,
                             output_num_tokens=out, page_keys=keys, gap_before_s=1.0, output_page_keys=out_keys))
    return Session(sid, tuple(built))


@pytest.mark.parametrize("policy, reused_pages", [
    ("unlimited", 25),       # every full page of KV: 640 + 999 tokens (the last token has none)
    ("histate", 25),         # --enable-histate tracks decode states on the 64-token grid: page 25
    ("sglang-hicache", 24),  # the last 256-token decode state: 1536 tokens
    ("vllm-marconi", 18),    # the last 576-token block boundary decode crossed: 1152 tokens
    ("marconi", 25),         # the state after the last decoded token
    ("sglang-tuned", 24),    # as sglang-hicache: the last 256-token decode state, 1536 tokens
    ("vllm-current", 10),    # the replay boundary of the prompt only: no decode state with retention interval 0
])
def test_a_later_turn_reuses_the_previous_output_as_each_engine_cached_it(policy, reused_pages):
    session = _turns("s", [10, 30], [1000, 10])
    w = Workload("t", [session], WorkloadStats(sessions=1, requests=2))
    run_ = replay(w, policy, ReplayConfig(gpu_cache_bytes=4 * GiB, cpu_cache_bytes=4 * GiB, ssd_cache_bytes=4 * GiB))
    second = max(run_.records, key=lambda r: r.arrival_s)
    assert second.reused_tokens == reused_pages * P


@pytest.mark.parametrize("policy", ["unlimited", "histate", "sglang-hicache", "vllm-marconi"])
def test_an_engine_that_caches_no_output_reuses_only_the_previous_prompt(policy):
    """`histate serve` decodes its own tokens, which the next (trace-built) prompt never contains."""
    session = _turns("s", [10, 30], [1000, 10])
    w = Workload("t", [session], WorkloadStats(sessions=1, requests=2))
    config = ReplayConfig(gpu_cache_bytes=4 * GiB, cpu_cache_bytes=4 * GiB, ssd_cache_bytes=4 * GiB,
                          engine=EngineConfig(caches_outputs=False))
    second = max(replay(w, policy, config).records, key=lambda r: r.arrival_s)
    assert second.reused_tokens == (9 if policy == "vllm-marconi" else 10) * P


def test_request_keys_through_the_output_are_deterministic_and_private_where_unknown():
    r = Request(uid=5, session_id="s", index=0, input_num_tokens=2 * P, output_num_tokens=300, page_keys=(1, 2),
                gap_before_s=0.0, output_page_keys=(3,))
    assert r.keys_through(5) == (1, 2, 3, ("out", 5, 3), ("out", 5, 4))
    assert r.keys_through(1) == (1,)


class _Never(MemoryGate):
    def admit(self, req, context_num_tokens, now_s, idle):
        return None


def test_a_gate_that_refuses_an_idle_engine_is_an_error_not_a_hang():
    eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(), step_cost=StubCost(), gate=_Never())
    with pytest.raises(RuntimeError, match="idle GPU"):
        eng.submit(EngineRequest("a", 64, 64, 1), 0.0)


def test_engine_profiles_follow_the_policy_unless_overridden():
    from histate.sim.admission import engine_profile
    base = EngineConfig()
    assert engine_profile(make_policy("histate"), QWEN35_9B, base, P).engine.mixed_batches is False
    vllm = engine_profile(make_policy("vllm-disk"), QWEN35_9B, base, P)
    assert (vllm.engine.chunk_rule, vllm.block_num_tokens, vllm.working_states) == ("vllm", 576, 1)
    assert engine_profile(make_policy("marconi"), QWEN35_9B, base, P).block_num_tokens == P
    what_if = engine_profile(make_policy("histate"), QWEN35_9B, base, P, engine="vllm")
    assert what_if.grows and what_if.block_num_tokens == P  # page-granular policy on vLLM's scheduler
    with pytest.raises(ValueError, match="unknown engine"):
        engine_profile(make_policy("histate"), QWEN35_9B, base, P, engine="trt")


def test_enable_mixed_chunk_mixes_decodes_into_sglang_prefill_steps_only():
    """SGLang's --enable-mixed-chunk (scheduler.py:1376-1378) turns on the engine's mixed steps for the
    policies SGLang serves (decodes ride in prefill steps, each taking a token of the chunk budget:
    test_engine.py pins that rule); vLLM's scheduler always mixes, flag or not."""
    from histate.cli.parser import build_parser
    from histate.cli.plan import build_config, resolve_workload_settings
    from histate.sim.admission import engine_profile

    def engines(flags):
        args = build_parser().parse_args(["replay", "--synthetic", "agent", *flags])
        config = build_config(args, resolve_workload_settings(args, args.model), P)
        return {name: engine_profile(make_policy(name), QWEN35_9B, config.engine, P).engine.mixed_batches
                for name in ("histate", "sglang-tuned", "vllm-disk")}

    assert engines([]) == {"histate": False, "sglang-tuned": False, "vllm-disk": True}
    assert engines(["--enable-mixed-chunk"]) == {"histate": True, "sglang-tuned": True, "vllm-disk": True}


def test_host_restores_overlap_the_forward_only_on_sglang():
    """HiCache's load-back runs layer by layer under the forward (cache_controller.py:1028-1069); vLLM's
    connector loads before it schedules the request (test_engine.py pins both timings)."""
    from histate.sim.admission import engine_profile
    from histate.sim.engine import EngineConfig

    layerwise = {name: engine_profile(make_policy(name), QWEN35_9B, EngineConfig(), P).engine.layerwise_load
                 for name in ("histate", "sglang-hicache", "sglang-tuned", "vllm-disk", "vllm-current-cpu", "marconi")}
    assert layerwise == {"histate": True, "sglang-hicache": True, "sglang-tuned": True, "vllm-disk": False,
                         "vllm-current-cpu": False, "marconi": False}


def test_the_simulator_captures_every_planned_position_with_grid_cuts():
    from histate.sim.workloads import demo_workload

    """HiState's SGLang engine floors its cuts, so no planned position falls off the chunk grid; the
    gate counts planned and captured interior positions (what benchmark/capture_realised.py reports)."""
    run = replay(demo_workload(seed=0), "histate", ReplayConfig(max_live_sessions=8, max_sessions=16))
    stats = run.engine_stats["admission"]
    assert stats.planned_interior > 0
    assert stats.captured_interior == stats.planned_interior and stats.off_grid == 0


def test_each_engine_gets_only_its_own_step_sharing_option():
    """The chunk cap is SGLang's (core/prefill_order.py): vLLM's scheduler never gets it."""
    from histate.core import ShortPrefillFirst
    from histate.sim.admission import engine_profile

    rule = ShortPrefillFirst(max_yields=3)
    base = EngineConfig(short_prefill_first=rule)
    assert engine_profile(make_policy("histate"), QWEN35_9B, base, 64).engine.short_prefill_first == rule
    assert engine_profile(make_policy("sglang-hicache"), QWEN35_9B, base, 64).engine.short_prefill_first == rule
    assert engine_profile(make_policy("vllm-disk"), QWEN35_9B, base, 64).engine.short_prefill_first is None
    assert engine_profile(make_policy("histate"), QWEN35_9B, base, 64, engine="vllm").engine.short_prefill_first is None
    capped = EngineConfig(long_prefill_token_threshold=2048)   # and vLLM's per-request cap never reaches SGLang
    assert engine_profile(make_policy("vllm-disk"), QWEN35_9B, capped, 64).engine.long_prefill_token_threshold == 2048
    assert engine_profile(make_policy("histate"), QWEN35_9B, capped, 64).engine.long_prefill_token_threshold == 0
