"""Sim vs live: the simulator's TTFT and hit rate against a real server running the same workload.

For each policy, `histate serve` (the reference executor on CPU: tiny Qwen3.5, the policy placing KV and
checkpoints in GPU/CPU/SSD tiers, SSD on disk) is started as a subprocess and `histate bench` replays a
scaled-down Weka workload against it (or the synthetic agent workload when ../shared's traces are
absent). The simulator then replays the same scaled workload, calibrated to that server:
  * prefill latency: a profile measured from the server over HTTP (`histate bench --calibrate`);
  * decode: the measured time per decode step as the engine's per-step cost;
  * one request at a time (`EngineConfig(max_running_requests=1)`), one chunk per prefill, as the
    server runs them; the same byte budgets per tier, the same admission (seed, live sessions);
  * no output caching (`caches_outputs=False`): the server decodes its own greedy tokens, which the
    next prompt (built from the trace's hash ids) never contains.
Policy "none" is simulated as vllm-marconi with an empty GPU pool (nothing can be reused).

    .venv/bin/python benchmark/sim_vs_live.py                     # ~15 min on the 2-core CI box
    .venv/bin/python benchmark/sim_vs_live.py --calibration out/sim_vs_live/calibration.csv   # reuse it

Writes out/sim_vs_live/{calibration.csv, live/, sim/, compare/} and prints the table of docs/results.md
("Sim vs live"). Rerun after simulator changes: only the sim side depends on them
(--skip-live reuses out/sim_vs_live/live).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from histate.bench.calibrate import DEFAULT_CONTEXTS, DEFAULT_LENGTHS, calibrate_server, decode_step_s
from histate.bench.compare import compare, format_comparison, write_comparison
from histate.bench.run import BenchOptions, run_bench
from histate.bench.scaling import scale_workload
from histate.sim.costs import CalibratedStepCost, PrefillProfile, get_hardware, get_model
from histate.sim.engine import EngineConfig
from histate.sim.metrics import PolicyRun
from histate.sim.replay import ReplayConfig, replay
from histate.sim.report import build_summary, write_outputs
from histate.sim.traces import LoadOptions, load_weka
from histate.sim.workloads import AgentWorkloadConfig, agent_workload

MiB = 2**20
WEKA = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"
POLICIES = ("histate", "vllm-marconi", "sglang-hicache", "none")
MODEL = "tiny-qwen3.5"  # the simulator's spec of histate serve's model


def load_workload(args):
    trace = Path(args.trace) if args.trace else WEKA
    if trace.exists():
        workload = load_weka(trace, LoadOptions(max_context_num_tokens=args.max_context, max_gap_s=args.max_gap))
    else:
        print(f"{trace} not found: using the synthetic agent workload")
        workload = agent_workload(AgentWorkloadConfig(num_sessions=args.sessions, num_turns=16, seed=args.seed),
                                  name="synthetic:agent")
    return scale_workload(workload, args.token_scale, args.time_scale)


class Server:
    """`histate serve` in a subprocess, on a free port, its log in the output directory."""

    def __init__(self, policy: str, args, log_dir: Path, budgets_mib=None, name: str = "") -> None:
        gpu, cpu, ssd = budgets_mib or (args.gpu_mib, args.cpu_mib, args.ssd_mib)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = (log_dir / f"serve-{name or policy}.log").open("w")
        cmd = [sys.executable, "-m", "histate.cli", "serve", "--policy", policy, "--port", str(port),
               "--gpu-mib", str(gpu), "--cpu-mib", str(cpu), "--ssd-mib", str(ssd), "--ssd-backend", args.ssd_backend]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"histate serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"histate serve did not come up in 180 s; see {self.log.name}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def admission(args) -> ReplayConfig:
    return ReplayConfig(model=MODEL, gpu_cache_bytes=int(args.gpu_mib * MiB), cpu_cache_bytes=int(args.cpu_mib * MiB),
                        ssd_cache_bytes=int(args.ssd_mib * MiB), max_live_sessions=args.live_sessions,
                        max_sessions=args.sessions, seed=args.seed)


def measure_calibration(args, out: Path) -> Path:
    path = out / "calibration.csv"
    server = Server("histate", args, out, budgets_mib=(1024, 1024, 1024), name="calibration")  # all on "GPU"
    try:
        options = BenchOptions(server.url, admission=admission(args), progress=not args.no_progress)
        calibrate_server(options, DEFAULT_CONTEXTS, DEFAULT_LENGTHS, args.calibrate_reps, path)
    finally:
        server.close()
    return path


def run_live(workload, args, out: Path) -> dict:
    runs = {}
    for policy in args.policies:
        server = Server(policy, args, out)
        try:
            result = run_bench(workload, BenchOptions(server.url, label=policy, admission=admission(args),
                                                      progress=not args.no_progress))
        finally:
            server.close()
        if result.interrupted:
            raise KeyboardInterrupt
        runs[policy] = result.run
        print(f"  live {policy}: {len(result.run.records)} requests in {result.run.wall_s:.0f} s")
    return runs


def run_sim(workload, args, calibration: Path) -> dict:
    profile = PrefillProfile.from_csv(calibration)
    step_s = decode_step_s(calibration) * args.slowdown
    if args.slowdown != 1:  # a uniformly slower server (e.g. a loaded machine): every latency x slowdown
        profile = PrefillProfile.fit([(n, ctx, s * args.slowdown) for n, ctx, s in profile.points], str(calibration))
    config = replace(admission(args), engine=EngineConfig(token_budget_per_step=1 << 30, max_running_requests=1,
                                                                   caches_outputs=False),
                     step_cost=CalibratedStepCost(get_model(MODEL), get_hardware("h100"), profile, step_overhead_s=step_s))
    print(f"calibration: {profile.num_points} points, fit max relative error {profile.max_relative_error:.1%}, "
          f"decode step {step_s * 1e3:.1f} ms")
    runs = {}
    for policy in args.policies:
        if policy == "none":  # no reuse at all: a GPU-only policy with an empty pool
            run = replay(workload, "vllm-marconi", replace(config, gpu_cache_bytes=0))
            run = PolicyRun("none", run.records, run.cache_stats, run.engine_stats, run.wall_s)
        else:
            run = replay(workload, policy, config)
        runs[policy] = run
    return runs


def markdown(table: dict) -> str:
    lines = ["| policy | hit rate live | hit rate sim | TTFT p50 live | p50 sim | sim/live p50 | TTFT p95 live | "
             "p95 sim | sim/live p95 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for policy, rows in table.items():
        by_run = {r["run"]: r for r in rows}
        live, sim = by_run.get("live"), by_run.get("sim")
        if not live or not sim:
            continue
        lines.append(f"| {policy} | {live['token_hit_rate']:.1%} | {sim['token_hit_rate']:.1%} | "
                     f"{live['ttft_p50_s']:.3f} s | {sim['ttft_p50_s']:.3f} s | {sim['ttft_p50_ratio']:.2f} | "
                     f"{live['ttft_p95_s']:.3f} s | {sim['ttft_p95_s']:.3f} s | {sim['ttft_p95_ratio']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="Weka trace (default ../shared/traces/cc-traces-weka-042026/traces.jsonl.gz)")
    ap.add_argument("--sessions", type=int, default=3, help="root sessions admitted (3)")
    ap.add_argument("--live-sessions", type=int, default=2, help="live sessions at once (2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-scale", type=float, default=1 / 16, help="16 trace pages -> 1 page (0.0625)")
    ap.add_argument("--time-scale", type=float, default=0.05, help="gaps x 0.05 (after --max-gap)")
    ap.add_argument("--max-gap", type=float, default=60.0, help="cap trace gaps at 60 s first (the paper preset)")
    ap.add_argument("--max-context", type=int, default=131072, help="trace max context before scaling")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    ap.add_argument("--gpu-mib", type=float, default=8.0, help="'GPU' tier budget (8 MiB: one scaled context)")
    ap.add_argument("--cpu-mib", type=float, default=16.0)
    ap.add_argument("--ssd-mib", type=float, default=512.0)
    ap.add_argument("--ssd-backend", default="file", choices=("auto", "file", "nixl"))
    ap.add_argument("--calibration", type=Path, help="reuse this profile instead of measuring one")
    ap.add_argument("--calibrate-reps", type=int, default=2)
    ap.add_argument("--skip-live", action="store_true", help="reuse OUT/live (rerun only the simulator)")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="simulate a server this many times slower than calibrated (sensitivity; sim side only)")
    ap.add_argument("--out", type=Path, default=Path("out/sim_vs_live"))
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    workload = load_workload(args)
    print(f"workload {workload.name}: admitting {args.sessions} sessions, {args.live_sessions} live")
    calibration = args.calibration or measure_calibration(args, args.out)
    live_dir = args.out / "live"
    sim_dir = args.out / ("sim" if args.slowdown == 1 else f"sim-x{args.slowdown:g}")
    if not args.skip_live:
        live = run_live(workload, args, args.out)
        write_outputs(live, build_summary(live), live_dir)
    sim = run_sim(workload, args, calibration)
    write_outputs(sim, build_summary(sim), sim_dir)
    table = compare([live_dir, sim_dir], ["live", "sim"])
    print(format_comparison(table))
    write_comparison(table, [live_dir, sim_dir], ["live", "sim"], args.out / f"compare{sim_dir.name[3:]}")
    print()
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
