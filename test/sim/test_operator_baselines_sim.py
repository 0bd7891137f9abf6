"""Engine- and replay-side pieces of the operator-tuned baselines (issue 17): vLLM's internal prefill
checkpoints (no forced step end at the last block boundary), the int8 checkpoint size SGLang's
`--enable-int8-mamba-checkpoint` would give, and sessions that the replay closes (what a later turn
reuses on each: test_admission.py's later-turn test). Hand-computed expectations; sources in the policy modules and docs/policies.md."""
import pytest

from histate.core import make_policy
from histate.sim.admission import engine_profile
from histate.sim.costs import H100_SXM, QWEN35_9B
from histate.sim.engine import Engine, EngineConfig, EngineRequest
from histate.sim.replay import GiB, ReplayConfig, _Replay
from histate.sim.request import Workload, WorkloadStats

from .test_admission import P, _turns
from .test_engine import TOKEN_S, StubCost, drain


@pytest.mark.parametrize("rule, steps", [("vllm", [1728, 2880, 3000]), ("vllm-internal", [1728, 3000])])
def test_internal_prefill_checkpoints_remove_the_forced_step_end_at_the_last_block_boundary(rule, steps):
    """Block 576, budget 2,000, a 3,000-token prompt: both rules end the first step on a block (1,728 =
    3 blocks). Align mode then forces a step end at 2,880 (its last block boundary, to cache the state
    there) and runs the 120-token tail alone; with internal checkpoints (#52789) the state at 2,880 is
    read out of the one forward that runs on to 3,000."""
    eng = Engine(QWEN35_9B, H100_SXM, EngineConfig(token_budget_per_step=2000, chunk_rule=rule, block_num_tokens=576),
                 step_cost=StubCost())
    t = eng.submit(EngineRequest("a", 3000, 3000, 1), 0.0)
    drain(eng)
    assert t.step_end_tokens == steps
    assert t.first_token_s == 3000 * TOKEN_S


def test_vllm_current_runs_on_vllms_scheduler_with_internal_checkpoints():
    base = EngineConfig()
    current = engine_profile(make_policy("vllm-current"), QWEN35_9B, base, P)
    assert (current.engine.chunk_rule, current.block_num_tokens, current.grows) == ("vllm-internal", 576, True)
    assert engine_profile(make_policy("vllm-marconi"), QWEN35_9B, base, P).engine.chunk_rule == "vllm"
    tuned = engine_profile(make_policy("sglang-tuned"), QWEN35_9B, base, P)
    assert (tuned.name, tuned.engine.chunk_rule, tuned.working_states) == ("sglang", "none", 3)


def test_int8_checkpoint_bytes_by_hand():
    """Qwen3.5-9B: 24 GDN layers, 32 value heads, 128 x 128 state per head, FP32 (4 B); conv window
    8,192 channels x 3 columns x 2 B per layer. FP32 state: 24 x 32 x 128 x 128 x 4 = 50,331,648 B +
    1,179,648 B conv = 51,511,296 B. int8: 12,582,912 B of state + a 4-byte scale per (layer, head, key
    channel) 24 x 32 x 128 x 4 = 393,216 B + the same conv = 14,155,776 B (3.64x fewer bytes; ~2x
    against a BF16 state, the figure SGLang quotes)."""
    assert QWEN35_9B.checkpoint_size_bytes == 50_331_648 + 1_179_648
    assert QWEN35_9B.int8_checkpoint_size_bytes == 12_582_912 + 393_216 + 1_179_648
    int8 = type("Int8", (type(make_policy("sglang-hicache")),), {"name": "int8", "int8_checkpoints": True})()
    assert ReplayConfig().cache_config(P, int8).checkpoint_size_bytes == 14_155_776
    assert ReplayConfig().cache_config(P, make_policy("sglang-tuned")).checkpoint_size_bytes == 51_511_296


def test_the_replay_closes_every_session_so_no_reference_outlives_its_session():
    """Two sessions of two turns each: while a session runs its path is referenced; once the replay is
    done every session has been closed and no node keeps a reference."""
    sessions = [_turns("s1", [10, 20], [100, 10]), _turns("s2", [12, 24], [100, 10])]
    w = Workload("t", sessions, WorkloadStats(sessions=2, requests=4))
    config = ReplayConfig(gpu_cache_bytes=4 * GiB, cpu_cache_bytes=4 * GiB, ssd_cache_bytes=4 * GiB)
    run = _Replay(w, "sglang-tuned", config, lambda: None)
    seen = []
    close = run.gate.close_session

    def spy(session_id, now_s):
        seen.append((session_id, sum(n.session_ref for n in run.cache.tree.iter_nodes())))
        close(session_id, now_s)

    run.gate.close_session = spy
    run.run()
    assert sorted(sid for sid, _ in seen) == ["s1", "s2"]
    assert all(refs > 0 for _, refs in seen)  # each session still referenced its path when it closed
    assert all(n.session_ref == 0 and n.state_session_ref == 0 for n in run.cache.tree.iter_nodes())
    assert not run.cache.sessions.kv_leaves and not run.cache.sessions.state_leaves
