"""`histate` command line: `histate replay` answers "what hit rate and TTFT would each cache policy
give on my trace, with my GPU/CPU/SSD budgets?" (docs/results.md shows the paper preset)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .core import DEFAULT_INTERVALS_PAGES, DEFAULT_TAU_S, available_policies

GiB = 2**30


def _gib(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in GiB, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"size must be >= 0 GiB, got {text}")
    return int(value * GiB)


def _policies(text: str) -> list:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in available_policies()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; available: {', '.join(available_policies())}")
    return names


def _intervals(text: str) -> tuple:
    try:
        values = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated page counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("intervals must be positive page counts")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="histate", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "replay", help="replay a trace (or a synthetic agent workload) through every cache policy",
        description="Replay agent sessions through cache policies side by side on one simulated GPU and "
                    "print token hit rate, TTFT p50/p95/p99/mean, speedups vs vllm-marconi and the share of "
                    "unlimited's reusable tokens recovered on reuse-sensitive requests (paper §4.2). "
                    "Without --trace it replays the embedded synthetic agent workload (96 sessions x 16 turns "
                    "with truncation, rewind-and-edit, fork and compaction).")
    src = r.add_argument_group("workload")
    src.add_argument("--trace", type=Path, help="trace file or directory (Weka cc-traces JSONL(.gz), TraceLab, Mooncake)")
    src.add_argument("--format", choices=("weka", "tracelab", "mooncake"), default="weka", help="trace format (default weka)")
    src.add_argument("--synthetic", choices=("agent", "mutation"), help="synthetic workload when no --trace: agent (default) or the paper's mutation microbenchmark")
    src.add_argument("--mutation-rate", type=float, default=0.05, help="--synthetic mutation: rate of truncations (0.05)")
    src.add_argument("--max-context", type=int, default=131072, help="model max context in tokens; a session ends at its first longer request (131072)")
    src.add_argument("--max-gap", type=float, help="cap every think/tool gap at this many seconds (AIPerf's inter-turn delay cap); default: trace timing")
    src.add_argument("--max-sessions", type=int, help="admit at most this many root sessions (default: all)")
    src.add_argument("--seed", type=int, default=0, help="seed of the admission order and synthetic workloads (0)")
    sim = r.add_argument_group("system (defaults: the paper preset, Qwen3.5-9B on one H100)")
    sim.add_argument("--policies", type=_policies, default=available_policies(), help="comma-separated policies (default: all)")
    sim.add_argument("--model", default="qwen3.5-9b", help="qwen3.5-9b | qwen3-next-80b-a3b | tiny-qwen3.5")
    sim.add_argument("--hardware", default="h100", help="h100 | h200")
    sim.add_argument("--gpu-gib", type=_gib, default=45 * GiB, help="GPU cache pool shared by KV and states, GiB (45)")
    sim.add_argument("--cpu-gib", type=_gib, default=96 * GiB, help="CPU DRAM cache, GiB (96)")
    sim.add_argument("--ssd-gib", type=_gib, default=150 * GiB, help="SSD cache, GiB (150)")
    sim.add_argument("--h2d-gbps", type=float, help="host-to-device bandwidth, GB/s (preset: 64)")
    sim.add_argument("--ssd-gbps", type=float, help="SSD bandwidth, GB/s (preset: 5)")
    sim.add_argument("--max-live-sessions", type=int, default=24, help="live root sessions at once (24)")
    sim.add_argument("--tau", type=float, default=DEFAULT_TAU_S,
                     help=f"eq. 7 time scale tau, seconds ({DEFAULT_TAU_S:g}; sweep in docs/results.md)")
    sim.add_argument("--intervals", type=_intervals, default=DEFAULT_INTERVALS_PAGES,
                     help="supported checkpoint intervals in 64-token pages, comma-separated")
    sim.add_argument("--calibration", type=Path, help="CSV of measured prefill latency (num_tokens,context_num_tokens,latency_s) replacing the roofline")
    out = r.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("out/replay"), help="directory for summary.json, requests.csv and plots (out/replay)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    out.add_argument("--explain", type=_policies, metavar="POLICY[,POLICY]",
                     help="attribute every token each named policy lost against `unlimited` and against the "
                          "other named policies to its cause (KV evicted, state evicted, no checkpoint near the hit, ...); "
                          "prints a table and writes explain.json (adds `unlimited` to --policies)")
    return ap


def load_workload(args):
    from .sim.traces import LoadOptions, load_trace
    from .sim.workloads import demo_workload, mutation_microbenchmark

    if args.synthetic == "mutation":
        return mutation_microbenchmark(args.mutation_rate, seed=args.seed)
    trace = args.trace
    if trace is None:
        return demo_workload(seed=args.seed)
    if not trace.exists():
        raise FileNotFoundError(f"--trace {trace}: no such file or directory")
    options = LoadOptions(max_context_num_tokens=args.max_context, max_gap_s=args.max_gap,
                          progress=not args.no_progress)
    return load_trace(trace, args.format, options)


def build_config(args, page_num_tokens: int):
    from dataclasses import replace

    from .sim.costs import CalibratedStepCost, PrefillProfile, get_hardware, get_model
    from .sim.replay import ReplayConfig

    model, hardware = get_model(args.model), get_hardware(args.hardware)  # unknown names fail here
    config = ReplayConfig(model=args.model, hardware=args.hardware, gpu_cache_bytes=args.gpu_gib,
                          cpu_cache_bytes=args.cpu_gib, ssd_cache_bytes=args.ssd_gib,
                          max_live_sessions=args.max_live_sessions, max_sessions=args.max_sessions, seed=args.seed,
                          tau_s=args.tau, intervals_pages=args.intervals)
    if args.h2d_gbps or args.ssd_gbps:
        config = replace(config, hardware_spec=hardware.with_links(h2d_gb_s=args.h2d_gbps, ssd_gb_s=args.ssd_gbps))
    if args.calibration:
        profile = PrefillProfile.from_csv(args.calibration)
        config = replace(config, step_cost=CalibratedStepCost(model, config.resolved_hardware(), profile))
    config.cache_config(page_num_tokens)  # validates the budgets and knobs (ConfigError names the field)
    return config


def replay_command(args) -> int:
    from .sim.replay import replay_policies
    from .sim.report import build_summary, format_table, write_outputs

    try:  # bad input (trace, profile, names, budgets) is reported in one line naming its source
        workload = load_workload(args)
        config = build_config(args, workload.page_num_tokens)
    except (ValueError, OSError) as err:
        print(f"histate replay: error: {err}", file=sys.stderr)
        return 2
    stats = workload.stats
    print(f"workload {workload.name}: {stats.sessions} sessions (+{stats.subagent_sessions} subagents), "
          f"{stats.requests} requests, {stats.input_tokens / 1e6:.1f}M input tokens; dropped by max-context "
          f"{stats.requests_over_context} requests; malformed skipped {stats.malformed_skipped}")
    logs, policies = {}, list(args.policies)
    if args.explain:
        from .sim.explain import EvictionLog

        logs = {name: EvictionLog() for name in args.explain}
        policies += [p for p in (*args.explain, "unlimited") if p not in policies]
    runs = replay_policies(workload, policies, config, progress=not args.no_progress, observers=logs)
    summary = build_summary(runs)
    print(format_table(summary))
    for name, run in runs.items():
        n = len(run.records)
        print(f"  {name}: replayed {n} requests in {run.wall_s:.1f} s ({n / max(run.wall_s, 1e-9):,.0f} req/s)")
    written = write_outputs(runs, summary, args.out, plots=not args.no_plots)
    if logs:
        from .sim.explain import explain, format_explain

        report = explain(workload, runs, logs, references=("unlimited", *args.explain))
        print(format_explain(report))
        path = args.out / "explain.json"
        path.write_text(json.dumps(report, indent=1))
        written.append(path)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        return replay_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
