"""`histate bench` (a workload against a live server, or --calibrate) and `histate compare` (run
directories side by side)."""
from __future__ import annotations

import sys

from histate.cli import plan
from histate.cli.parser import DEFAULT_SIM_MODEL


def bench_command(args) -> int:
    from histate.bench.backends import BenchError
    from histate.bench.run import BenchOptions, RunFailed, check_base_url, report, run_bench
    from histate.bench.scaling import scale_workload
    from histate.bench.sessions import RetryPolicy, admitted_requests
    from histate.sim.replay import ReplayConfig
    from histate.sim.report import check_writable

    try:
        check_base_url(args.base_url)
        if args.retries < 0:
            raise BenchError(f"--retries must be >= 0, got {args.retries}")
        # bench's --model names the server's model; traces are clipped at the simulator's default model's
        # native context unless --max-context says otherwise (docs/bench.md)
        settings = plan.resolve_workload_settings(args, DEFAULT_SIM_MODEL)
        admission = ReplayConfig(max_live_sessions=args.max_live_sessions, max_sessions=settings["max_sessions"],
                                 seed=args.seed, session_sampling=settings["session_sampling"],
                                 stagger_s=settings["stagger_s"])
        options = BenchOptions(args.base_url, args.backend, args.model, args.vocab_size, args.label, admission,
                               RetryPolicy(max_attempts=args.retries + 1), args.request_timeout,
                               flush_cache=not args.no_flush, progress=not args.no_progress)
        if args.calibrate:
            return _calibrate(args, options)
        check_writable(args.out)  # before the run, not after it (the reports are written at the end)
        workload = scale_workload(plan.load_workload(args, settings), args.token_scale, args.time_scale)
        if not admitted_requests(workload, admission):
            raise BenchError(plan.nothing_to_run(workload, settings, "send"))
    except (BenchError, ValueError, OSError) as err:
        print(f"histate bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("histate bench: interrupted before the run; nothing was sent or written", file=sys.stderr)
        return 130
    stats = workload.stats
    print(f"workload {workload.name}: {stats.sessions} sessions (+{stats.subagent_sessions} subagents), "
          f"{stats.requests} requests, {stats.input_tokens / 1e6:.2f}M input tokens")
    try:
        result = run_bench(workload, options)
    except RunFailed as failed:  # the run started, then failed: write what it measured, as Ctrl-C does
        report(failed.result, args.out, plots=not args.no_plots)
        print(f"histate bench: error: {failed} (wrote the {len(failed.result.run.records)} requests completed "
              f"before it)", file=sys.stderr)
        return 2
    except BenchError as err:
        print(f"histate bench: error: {err}", file=sys.stderr)
        return 2
    report(result, args.out, plots=not args.no_plots)
    return 130 if result.interrupted else 0


def _calibrate(args, options) -> int:
    from histate.bench.calibrate import DEFAULT_CONTEXTS, DEFAULT_LENGTHS, calibrate_server
    from histate.sim.costs import PrefillProfile

    contexts = args.calibrate_contexts or DEFAULT_CONTEXTS
    lengths = args.calibrate_lengths or DEFAULT_LENGTHS
    if min(lengths) < 1:
        raise ValueError("--calibrate-lengths: every new-token count must be >= 1")
    calibrate_server(options, contexts, lengths, args.calibrate_reps, args.calibrate)
    profile = PrefillProfile.from_csv(args.calibrate)
    print(f"wrote {args.calibrate}: {profile.num_points} points, fit max relative error "
          f"{profile.max_relative_error:.1%}")
    return 0


def compare_command(args) -> int:
    from histate.bench.compare import compare, format_comparison, write_comparison

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else []
    try:
        warnings: list = []
        table = compare(args.dirs, labels, warnings)
        for line in warnings:
            print(line, file=sys.stderr)
        print(format_comparison(table))
        if args.out:
            written = write_comparison(table, args.dirs, labels, args.out, plots=not args.no_plots)
            print("wrote " + ", ".join(str(p) for p in written))
    except (ValueError, OSError) as err:
        print(f"histate compare: error: {err}", file=sys.stderr)
        return 2
    return 0
