"""SGLang's own server with --enable-histate against the simulator's `histate`, request by request.

Starts SGLang 0.5.23's server on this CPU (sglang_cpu/server: tiny random Qwen3.5, stand-in kernels),
runs `histate bench`'s closed loop of a small synthetic agent workload against it (one live session,
room for everything), replays the same workload through `histate replay`'s `histate` policy, and
prints, per request, the tokens each reused. With HiState's default intervals eq. 3-6 read the
server's wall-clock flows and the replay's simulated time, so plans can differ; `--interval-pages N`
pins one interval on both sides.

    .venv/bin/python benchmark/server_vs_sim.py [--interval-pages 4]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MiB = 2**20
ROOM = dict(gpu_cache_bytes=64 * MiB, cpu_cache_bytes=256 * MiB, ssd_cache_bytes=1024 * MiB)
PAGE_NUM_TOKENS = 64


def workload():
    from histate.sim.workloads import AgentWorkloadConfig, agent_workload

    return agent_workload(AgentWorkloadConfig(
        num_sessions=3, num_turns=5, system_prompt_num_tokens=256, first_input_num_tokens=(200, 600),
        append_num_tokens=(64, 300), output_num_tokens=(2, 6), tool_gap_s=(0.01, 0.05), human_gap_probability=0.0,
        session_start_spread_s=0.1, truncation_rate=0.2, rewind_edit_rate=0.2, fork_rate=0.1, compaction_rate=0.0,
        seed=3))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval-pages", type=int, default=None,
                        help="one checkpoint interval, in 64-token pages, on both sides (default: HiState's set)")
    args = parser.parse_args()
    from histate.bench.run import BenchOptions, run_bench
    from histate.sim.engine import EngineConfig
    from histate.sim.replay import ReplayConfig, replay
    from sglang_cpu.server.launch import CpuServer

    server_flags = ["--enable-histate"]
    replay_extra = {}
    if args.interval_pages:
        server_flags += ["--histate-intervals", str(args.interval_pages * PAGE_NUM_TOKENS)]
        replay_extra["intervals_pages"] = (args.interval_pages,)
    work = workload()
    with tempfile.TemporaryDirectory() as logs, CpuServer(server_flags, log_path=Path(logs) / "server.log") as server:
        live = run_bench(work, BenchOptions(server.url, vocab_size=512, progress=False,
                                            admission=ReplayConfig(max_live_sessions=1))).run.by_uid()
    sim = replay(work, "histate", ReplayConfig(model="tiny-qwen3.5", max_live_sessions=1,
                                               engine=EngineConfig(caches_outputs=False), **ROOM, **replay_extra)).by_uid()
    same = 0
    print("| request | prompt tokens | reused: server | reused: simulator |")
    print("|---:|---:|---:|---:|")
    for uid in sorted(live):
        a, b = live[uid].reused_tokens, sim[uid].reused_tokens
        same += a == b
        print(f"| {uid} | {live[uid].input_tokens} | {a} | {b}{'' if a == b else ' (differs)'} |")
    print(f"\n{same} of {len(live)} requests reuse the same tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
