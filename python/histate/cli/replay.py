"""`histate replay`: every policy on one simulated server (or a simulated cluster), the table, the
outputs, and what Ctrl-C leaves written."""
from __future__ import annotations

import json
import sys

from histate.cli.plan import plan_replay, settings_record


def replay_command(args) -> int:
    from histate.sim.report import build_summary, format_misses, format_table, strict_json, write_outputs

    try:  # bad input is one line naming its source, and all of it is found before the replay starts
        settings, workload, config, admitted, num_drawn_empty = plan_replay(args)
    except (ValueError, OSError) as err:
        print(f"histate replay: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("histate replay: interrupted while loading the workload; nothing was replayed or written",
              file=sys.stderr)
        return 130
    stats = workload.stats
    record = settings_record(args, settings, workload, config, admitted, num_drawn_empty)
    clip = settings["max_context_num_tokens"]
    print(f"workload {workload.name}: {stats.sessions} sessions (+{stats.subagent_sessions} subagents), "
          f"{stats.requests} requests, {stats.input_tokens / 1e6:.1f}M input tokens; "
          + (f"dropped by the {clip:,}-token max context: {stats.requests_over_context} requests; " if clip else "")
          + f"malformed skipped {stats.malformed_skipped}")
    print(f"preset {settings['preset']}: admitting {len(admitted)} sessions"
          + (f" (+{num_drawn_empty} drawn but emptied by the clip)" if num_drawn_empty else "")
          + f", {record['admitted_requests']} requests; "
          + ("" if args.trace is None else "think/tool gaps as recorded; " if settings["max_gap_s"] is None
             else f"think/tool gaps capped at {settings['max_gap_s']:g} s; ")
          + f"first wave released one every {settings['stagger_s']:g} s")
    logs, policies = {}, list(args.policies)
    drawn = getattr(args, "plot_policies", None)
    if isinstance(drawn, list) and (missing := [p for p in drawn if p not in policies]):
        print(f"histate replay: error: --plot-policies {','.join(missing)}: not among --policies", file=sys.stderr)
        return 2
    if args.explain:
        from histate.sim.explain import EvictionLog

        logs = {name: EvictionLog() for name in args.explain}
        policies += [p for p in (*args.explain, "unlimited") if p not in policies]
    try:
        cluster = cluster_config(args)
    except ValueError as err:
        print(f"histate replay: error: {err}", file=sys.stderr)
        return 2
    cluster_summaries = None
    if cluster is not None:
        if logs:
            print("histate replay: error: --explain runs on one server only (no --servers/--l3-size-gb/--fail-server)",
                  file=sys.stderr)
            return 2
        print(f"cluster mode: {cluster.num_servers} servers, router {cluster.router}, "
              f"{cluster.num_servers * args.max_live_sessions} live sessions, "
              f"L3 {cluster.l3_store.capacity_bytes / 1e9:g} GB"
              + (f" (link {cluster.l3_link.bandwidth_bytes_per_s / 1.25e8:g} Gbit/s, "
                 f"{cluster.l3_link.op_latency_s * 1e3:g} ms/op)" if cluster.has_l3 else "")
              + (f", server {cluster.fail_server[0]} fails at {cluster.fail_server[1]:g} s" if cluster.fail_server else ""))
        runs, cluster_summaries = replay_cluster_runs(workload, policies, config, cluster, not args.no_progress)
        interrupted = None
    else:
        runs, interrupted = replay_until_interrupted(workload, policies, config, not args.no_progress, logs)
    if interrupted and not runs:
        print(f"histate replay: interrupted during {interrupted}, before any policy finished; nothing written",
              file=sys.stderr)
        return 130
    summary = {**build_summary(runs), "settings": record, "workload_stats": stats.as_dict()}
    if interrupted:
        summary["interrupted"] = {"policy": interrupted, "not_replayed": policies[len(runs):]}
    print(format_table(summary))
    misses = format_misses(summary)
    if misses:
        print(misses)
    if cluster_summaries is not None:
        from histate.sim.cluster_metrics import format_cluster_table

        summary["cluster"] = cluster_summaries
        print(format_cluster_table(cluster_summaries))
    for name, run in runs.items():
        n = len(run.records)
        span_h = summary["policies"][name]["simulated_span_s"] / 3600
        print(f"  {name}: replayed {n} requests ({span_h:.2f} h simulated) in {run.wall_s:.1f} s "
              f"({n / max(run.wall_s, 1e-9):,.0f} req/s)")
    written = write_outputs(runs, summary, args.out, plots=not args.no_plots,
                            plot_policies=list(runs) if drawn == "all" else drawn)
    if interrupted:
        print(f"histate replay: interrupted during {interrupted}; wrote the {len(runs)} policies that finished "
              f"({', '.join(runs)}) to {args.out}", file=sys.stderr)
        return 130
    if logs:
        from histate.sim.explain import explain, format_explain

        report = explain(workload, runs, logs, references=("unlimited", *args.explain))
        print(format_explain(report))
        path = args.out / "explain.json"
        path.write_text(json.dumps(strict_json(report), indent=1) + "\n")
        written.append(path)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def replay_until_interrupted(workload, policies: list, config, progress: bool, observers: dict) -> tuple:
    """(runs of the policies that finished, the policy Ctrl-C interrupted or None): policies run one
    after another, so an interrupted replay still has every policy it completed to report."""
    from histate.sim.replay import replay_policies

    runs: dict = {}
    for name in policies:
        try:
            runs.update(replay_policies(workload, [name], config, progress=progress, observers=observers))
        except KeyboardInterrupt:
            if progress:
                print(file=sys.stderr)  # end the progress bar's line
            return runs, name
    return runs, None


def cluster_config(args):
    """The ClusterConfig the cluster flags ask for, or None when they ask for one plain server."""
    from histate.sim.cluster import ClusterConfig
    from histate.sim.l3 import DEFAULT_EVICTION_HIGH_WATERMARK_RATIO, DEFAULT_EVICTION_RATIO, L3StoreConfig
    from histate.sim.l3_link import GBIT, FLEET_L3_LINK, L3LinkSpec

    if args.servers == 1 and not args.l3_size_gb and args.fail_server is None:
        return None
    link = L3LinkSpec(args.l3_link_gbps * GBIT if args.l3_link_gbps else FLEET_L3_LINK.bandwidth_bytes_per_s,
                      args.l3_op_latency_ms / 1e3 if args.l3_op_latency_ms is not None
                      else FLEET_L3_LINK.op_latency_s)
    store = L3StoreConfig(int(args.l3_size_gb * 1e9),
                          args.eviction_high_watermark_ratio or DEFAULT_EVICTION_HIGH_WATERMARK_RATIO,
                          args.eviction_ratio or DEFAULT_EVICTION_RATIO)
    return ClusterConfig(args.servers, args.router, store, link, fail_server=args.fail_server)


def replay_cluster_runs(workload, policies: list, config, cluster, progress: bool) -> tuple:
    """(PolicyRun view per policy, cluster summary per policy): each policy in cluster mode, and
    without the failure too when one is asked for (moved sessions' paired TTFTs)."""
    from dataclasses import replace

    from histate.sim.cluster import replay_cluster
    from histate.sim.cluster_metrics import as_policy_run, summarize_cluster

    runs, summaries = {}, {}
    for name in policies:
        run = replay_cluster(workload, name, config, cluster)
        baseline = replay_cluster(workload, name, config, replace(cluster, fail_server=None)) \
            if cluster.fail_server is not None else None
        runs[name] = as_policy_run(run)
        summaries[name] = summarize_cluster(run, baseline)
        if progress:
            print(f"  {name}: cluster replay of {len(run.records)} requests in {run.wall_s:.1f} s", file=sys.stderr)
    return runs, summaries
