"""Application-placed checkpoints in `histate replay` (docs/hints.md; `--checkpoint-hints system-prompt`).

The synthetic agent workload names its shared system prompt's end on every request that carries all of
it; its variates are unchanged, so the hinted and plain workloads are the same requests. Replayed one
session at a time, a later session's first turn shares exactly the system prompt with the cache: with
hints HiState resumes every such turn at the system prompt's end; without them the second session
resumes below it (nothing planned that position yet: 4,096 tokens is not where eq. 5 put a state in
the first session's 8K+-token prompt, which the test checks), as `unlimited`'s dense states do not need.
"""
from __future__ import annotations

import pytest

from histate.cli import main as cli_main
from histate.sim.replay import ReplayConfig, replay
from histate.sim.workloads import AgentWorkloadConfig, agent_workload, demo_workload

SYSTEM_TOKENS = 4096


def test_hints_name_the_system_prompt_end_and_change_no_request():
    plain, hinted = demo_workload(seed=1), demo_workload(seed=1, hint_system_prompt=True)
    pairs = list(zip(plain.iter_requests(), hinted.iter_requests()))
    assert len(pairs) == plain.stats.requests
    system_keys = pairs[0][0].page_keys[:SYSTEM_TOKENS // 64]
    named = 0
    for a, b in pairs:
        assert (a.page_keys, a.input_num_tokens, a.gap_before_s, a.flags) == (b.page_keys, b.input_num_tokens,
                                                                             b.gap_before_s, b.flags)
        assert a.checkpoint_hint_tokens == ()
        carries = b.page_keys[:len(system_keys)] == system_keys and b.input_num_tokens > SYSTEM_TOKENS
        assert b.checkpoint_hint_tokens == ((SYSTEM_TOKENS,) if carries else ())
        named += carries
    assert named > 0.9 * len(pairs)


def _first_turn_resumes(hinted: bool, policy: str) -> list:
    config = AgentWorkloadConfig(num_sessions=5, num_turns=2, first_input_num_tokens=(8192, 16384),
                                 seed=4, hint_system_prompt=hinted)
    workload = agent_workload(config)
    run = replay(workload, policy, ReplayConfig(max_live_sessions=1))
    first = {r.uid for r in workload.iter_requests() if r.index == 0}
    return [rec.reused_tokens for rec in sorted(run.records, key=lambda r: r.matched_s) if rec.uid in first]


def test_with_hints_every_later_session_resumes_at_the_system_prompt_end():
    plain = _first_turn_resumes(False, "histate")
    assert plain[0] == 0 and plain[1] < SYSTEM_TOKENS  # the precondition: nothing planned it without hints
    assert _first_turn_resumes(True, "histate") == [0] + [SYSTEM_TOKENS] * 4
    assert _first_turn_resumes(False, "unlimited") == [0] + [SYSTEM_TOKENS] * 4  # the ceiling, with or without
    assert _first_turn_resumes(True, "vllm-disk") == _first_turn_resumes(False, "vllm-disk")  # no such API


@pytest.mark.parametrize("argv", [["--trace", "nowhere.jsonl"], ["--synthetic", "mutation"]])
def test_the_flag_is_refused_where_no_workload_names_positions(argv, capsys):
    assert cli_main(["replay", *argv, "--checkpoint-hints", "system-prompt", "--policies", "histate",
                     "--no-progress"]) == 2
    assert "--checkpoint-hints system-prompt: applies to the synthetic agent workload only" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--trace", "nowhere.jsonl", "--system-prompt-tokens", "4992"], "--system-prompt-tokens: applies to the synthetic agent"),
    (["--system-prompt-tokens", "5000"], "--system-prompt-tokens 5000: must be a multiple of the 64-token page"),
])
def test_the_system_prompt_length_is_checked(argv, message, capsys):
    assert cli_main(["replay", *argv, "--policies", "histate", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_the_system_prompt_length_sets_the_shared_prefix_and_the_hint():
    workload = demo_workload(seed=0, hint_system_prompt=True, system_prompt_num_tokens=4992)
    first = [r for r in workload.iter_requests() if r.index == 0]
    assert len({r.page_keys[:78] for r in first}) == 1 and len({r.page_keys[78] for r in first}) == len(first)
    assert all(r.checkpoint_hint_tokens == (4992,) for r in first)
