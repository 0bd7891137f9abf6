"""The agent workload the loopback cluster sends (`histate cluster`, its `--faults` scenarios, the router
policy comparison, and the simulator twin that replays it): one builder, so that every run that is
compared with another sends the same sessions for the same seed."""
from __future__ import annotations

from ..sim.request import Workload
from ..sim.workloads import AgentWorkloadConfig, agent_workload


def cluster_workload(num_sessions: int, num_turns: int, seed: int) -> Workload:
    """Short contexts so a CPU worker serves a turn in well under a second, and no idle gaps (what moves
    a session here is a kill or a fault, not time)."""
    return agent_workload(AgentWorkloadConfig(
        num_sessions=num_sessions, num_turns=num_turns, system_prompt_num_tokens=256,
        first_input_num_tokens=(256, 512), append_num_tokens=(64, 192), output_num_tokens=(2, 4),
        tool_gap_s=(0.0, 0.05), human_gap_probability=0.0, session_start_spread_s=0.1, truncation_rate=0.0,
        rewind_edit_rate=0.0, fork_rate=0.0, compaction_rate=0.0, seed=seed), name="synthetic:cluster")
