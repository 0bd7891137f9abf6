"""Issue 18, "Beyond one machine, by simulation": cluster mode of `histate replay` (sim/cluster.py).

Three sweeps, every number simulated:
  (a) scale-out: 1, 2, 4, 8, 16 servers at constant load per server (`--max-live-sessions` per
      server), histate vs sglang-hicache, without L3 and with an L3 of `--l3-gb` GB: cluster token
      hit rate and p95 TTFT;
  (b) failover: the cluster of `--fail-servers` servers loses server 0 at mid-run, with and without
      L3: the moved sessions' first-request TTFT next to the same requests in a run without failure.
      The failure moment is the same for every policy and L3 size (fail_time): the median arrival of
      server 0's requests in one reference run (sglang-hicache, no L3, no failure);
  (c) L3 capacity: cluster hit rate vs L3 GB at `--fail-servers` servers with the failure.
The L3 link is sim/l3_link.py's FLEET_L3_LINK (0.42 ms per operation measured on loopback, 100 Gbit/s assumed) unless --l3-link-gbps / --l3-op-latency-ms.
Workload: the synthetic agent workload (what `histate replay` runs without --trace); `--trace` uses
the Weka trace (default path below when present). Sessions scale with servers: `--sessions-per-server`
root sessions per server are admitted (the synthetic workload is regenerated with more sessions).
Resumable: every cell is one JSON file under --out/cells, skipped when present.

    .venv/bin/python benchmark/scaleout.py [--servers 1 2 4 8 16] [--l3-gb 200] [--trace]
        [--out out/scaleout] [--docs docs]   # the table to --out/scaleout.md (copied into docs/results.md
                                             # by hand), the plot to --docs/scaleout.png
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"
POLICIES = ("histate", "sglang-hicache")
RANKINGS = {"histate": ("eq7", "lru"), "sglang-hicache": ("lru",)}
"""What leaves L3 per policy (sim/cluster.py L3_RANKINGS): HiState's eq. 7 ledger, or the master's LRU
alone; stock HiCache deletes nothing, so the master's LRU alone."""
GiB = 2**30


def workload_and_config(args, num_servers: int):
    """The workload and per-server ReplayConfig of one cell (sessions scale with servers)."""
    from histate.cli.parser import build_parser
    from histate.cli.plan import plan_replay

    sessions = args.sessions_per_server * num_servers
    argv = ["replay", "--no-plots", "--no-progress", "--seed", str(args.seed), "--max-live-sessions",
            str(args.live_per_server), "--gpu-gib", str(args.gpu_gib), "--cpu-gib", str(args.cpu_gib),
            "--ssd-gib", str(args.ssd_gib), "--out", str(args.out / "unused")]
    if args.trace:
        argv += ["--trace", str(TRACE), "--max-sessions", str(sessions)]
        _, workload, config, _, _ = plan_replay(build_parser().parse_args(argv))
        return workload, config
    from histate.sim.workloads import AgentWorkloadConfig, agent_workload

    _, _, config, _, _ = plan_replay(build_parser().parse_args(argv))
    # the embedded default's shape (default_workload: sessions x 12 turns), with sessions scaled
    return agent_workload(AgentWorkloadConfig(num_sessions=sessions, seed=args.seed), name="synthetic:agent"), config


def variants(args) -> list:
    """(label, policy, L3 ranking) of every policy variant a sweep runs."""
    out = []
    for policy in POLICIES:
        for ranking in RANKINGS[policy]:
            if policy == "histate" and ranking not in args.l3_rankings:
                continue
            out.append((policy if ranking == "eq7" or policy != "histate" else f"{policy}+lru", policy, ranking))
    return out


def cluster_config(args, num_servers: int, l3_gb: float, fail: bool, ranking: str = "eq7"):
    from histate.sim.cluster import ClusterConfig
    from histate.sim.l3 import L3StoreConfig
    from histate.sim.l3_link import GBIT, FLEET_L3_LINK, L3LinkSpec

    link = L3LinkSpec(args.l3_link_gbps * GBIT if args.l3_link_gbps else FLEET_L3_LINK.bandwidth_bytes_per_s,
                      args.l3_op_latency_ms / 1e3 if args.l3_op_latency_ms is not None
                      else FLEET_L3_LINK.op_latency_s)
    return ClusterConfig(num_servers, "manual", L3StoreConfig(int(l3_gb * 1e9)), link, l3_ranking=ranking)


REFERENCE_POLICY = "sglang-hicache"


def fail_time(args, num_servers: int) -> float:
    """When server 0 fails, the same for every policy, ranking and L3 size of a `num_servers` fleet:
    the median arrival of the requests server 0 serves in one reference run (REFERENCE_POLICY, no L3,
    no failure), cached as JSON.

    Why one reference run: sessions are closed-loop (a turn arrives when the previous one finished plus
    its gap), so each policy's own median (what this took before) lands the kill at a different
    moment, and the request it catches in flight counts a different time spent on the dead server
    (seed 0, Weka, 100 GB: 3.3 s for histate vs 2.0 s for stock). The workload's nominal times are
    not a usable clock instead: with `--live-per-server` admission a session starts when a slot frees,
    far from its trace time. Why this run: stock HiCache is the comparison's baseline, and without L3
    nothing the compared L3 rules do can move it; the routing (sticky, by root id) is the same for
    every policy, so server 0 serves the same sessions in every run."""
    path = args.out / "cells" / f"failtime-n{num_servers}.json"
    if path.exists():
        return json.loads(path.read_text())["fail_at_s"]
    from histate.sim.cluster import replay_cluster

    workload, config = workload_and_config(args, num_servers)
    ref = replay_cluster(workload, REFERENCE_POLICY, config, cluster_config(args, num_servers, 0.0, False))
    # mid-run for server 0 (half the whole run's span can fall after server 0's sessions ended, on
    # heavy-tailed traces)
    arrivals = sorted(r.arrival_s for r in ref.records if ref.server_of_uid[r.uid] == 0)
    t = arrivals[len(arrivals) // 2]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fail_at_s": t, "reference": REFERENCE_POLICY, "servers": num_servers,
                                "server0_requests": len(arrivals)}, indent=1))
    return t


def moved_detail(run, baseline, t_fail: float) -> list:
    """Per moved session's first request after the failure: what it restored and how (the trace the
    docs' failover paragraphs quote)."""
    by_uid = {r.uid: r for r in run.records}
    base = {r.uid: r for r in baseline.records}
    out = []
    for uid in run.first_after_move_uids:
        r = by_uid.get(uid)
        if r is None:
            continue
        before = [q.completion_s for q in run.records if q.session_id == r.session_id and q.uid != uid
                  and not math.isnan(q.completion_s) and q.completion_s <= t_fail]
        b = base.get(uid)
        out.append({"uid": uid, "session": r.session_id, "arrival_s": r.arrival_s, "ttft_s": r.ttft_s,
                    "in_flight": uid in run.retried_uids, "input_tokens": r.input_tokens,
                    "resumed_at_tokens": r.reused_tokens, "l3_tokens": run.l3_hit_tokens_by_uid.get(uid, 0),
                    "idle_before_failure_s": t_fail - max(before) if before else None,
                    "ttft_without_failure_s": b.ttft_s if b else None,
                    "resumed_without_failure_tokens": b.reused_tokens if b else None})
    return out


def from_failure(detail: list, t_fail: float) -> dict:
    """The moved sessions' first TTFT counted from max(arrival, failure): the same failure moment still
    catches different requests in flight per policy (closed-loop: a faster policy's next turn arrives
    earlier), and a request in flight counts the time it spent on the dead server before the kill;
    this counts only what the failover costs (first token - failure for those in flight)."""
    xs = [m["ttft_s"] - max(0.0, t_fail - m["arrival_s"]) for m in detail if not math.isnan(m["ttft_s"])]
    return {"count": len(xs), "mean_s": sum(xs) / len(xs) if xs else math.nan}


def run_cell(args, name: str, policy: str, num_servers: int, l3_gb: float, fail: bool, ranking: str = "eq7") -> dict:
    """One cluster replay (and, with a failure, the paired run without it), cached as JSON. Sweeps (b)
    and (c) share their failure cells (the same policy, fleet and L3 size are one computation)."""
    key = ("fail-" + name.split("-", 1)[1]) if fail else name
    path = args.out / "cells" / f"{key}.json"
    if path.exists():
        return {**json.loads(path.read_text()), "cell": name}
    from histate.sim.cluster import replay_cluster
    from histate.sim.cluster_metrics import summarize_cluster

    workload, config = workload_and_config(args, num_servers)
    cluster = cluster_config(args, num_servers, l3_gb, fail, ranking)
    baseline = replay_cluster(workload, policy, config, cluster)
    if fail:
        t_fail = fail_time(args, num_servers)
        run = replay_cluster(workload, policy, config, replace(cluster, fail_server=(0, t_fail)))
        summary = summarize_cluster(run, baseline)
        summary["fail_at_s"] = t_fail
        summary["moved_detail"] = moved_detail(run, baseline, t_fail)
        summary["moved_first_ttft_from_failure"] = from_failure(summary["moved_detail"], t_fail)
        # the moved sessions' first requests that arrived after the failure: a request the failure
        # caught in flight also counts the time it had spent on the dead server, which depends on
        # where in its prefill the kill landed, not on what L3 restores
        by_uid = {r.uid: r for r in run.records}
        fresh = [by_uid[u].ttft_s for u in run.first_after_move_uids
                 if u in by_uid and u not in run.retried_uids and not math.isnan(by_uid[u].first_token_s)]
        summary["moved_first_ttft_arrived_after"] = {"count": len(fresh),
                                                     "mean_s": sum(fresh) / len(fresh) if fresh else math.nan}
    else:
        summary = summarize_cluster(baseline)
        run = baseline
    if run.l3_stats is not None:
        summary["l3_deleted_objects"] = run.l3_stats.deleted_objects
        summary["l3_stats"] = {k: getattr(run.l3_stats, k) for k in run.l3_stats.__dataclass_fields__}
    summary.update(cell=name, servers=num_servers, l3_gb=l3_gb, fail=fail)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, default=str))
    return summary


def cells(args) -> list:
    """(name, label, policy, L3 ranking, servers, L3 GB, failure) of every cell, sweep by sweep. Without
    L3 the ranking is moot: one cell per policy."""
    out = []

    def add(prefix: str, n: int, l3: float, fail: bool) -> None:
        for label, policy, ranking in variants(args):
            if l3 == 0 and label != policy:
                continue
            out.append((f"{prefix}-{label}-n{n}-l3{l3:g}", label, policy, ranking, n, l3, fail))

    for n in args.servers:
        for l3 in (0.0, args.l3_gb):
            add("a", n, l3, False)
    for l3 in (0.0, args.l3_gb):
        add("b", args.fail_servers, l3, True)
    for l3 in args.l3_sweep_gb:
        add("c", args.fail_servers, l3, True)
    return out


def link_words(args) -> str:
    from histate.sim.l3_link import FLEET_L3_LINK_GBPS, MEASURED_L3_OP_LATENCY_MS

    gbps = args.l3_link_gbps or FLEET_L3_LINK_GBPS
    latency_ms = args.l3_op_latency_ms if args.l3_op_latency_ms is not None else MEASURED_L3_OP_LATENCY_MS
    return f"{gbps:g} Gbit/s per server (assumed), {latency_ms:g} ms per operation (measured on loopback)"


def markdown(results: list, args) -> str:
    pct = lambda x: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f}%"
    sec = lambda x: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f} s"
    workload = "Weka trace" if args.trace else "synthetic agent workload"
    lines = [f"# Scale-out (simulated; {workload}, seed {args.seed}, {args.live_per_server} live sessions and "
             f"{args.sessions_per_server} sessions per server; L3 link: {link_words(args)})", "",
             "## (a) servers at constant load per server (simulated)", "",
             "| policy | servers | L3 GB | cluster hit rate | L3 hit Mtok | p95 TTFT | p99 TTFT |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["cell"].startswith("a-"):
            lines.append(f"| {r['policy']} | {r['servers']} | {r['l3_gb']:g} | {pct(r['token_hit_rate'])} | "
                         f"{r['l3_hit_tokens'] / 1e6:.2f} | {sec(r['ttft_p95_s'])} | {sec(r['ttft_p99_s'])} |")
    t_fail = next((r.get("fail_at_s") for r in results if r.get("fail_at_s") is not None), None)
    at = f" (t = {t_fail:.1f} s for every policy and L3 size: fail_time)" if t_fail is not None else ""
    lines += ["", f"## (b) server 0 fails at mid-run{at}, {args.fail_servers} servers (simulated)", "",
              "| policy | L3 GB | moved sessions | their first TTFT after the move (mean / p95) | of those arriving after the failure (n: mean) | same requests without failure |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["cell"].startswith("b-"):
            m, b = r.get("moved_first_ttft", {}), r.get("moved_first_ttft_without_failure", {})
            f = r.get("moved_first_ttft_arrived_after", {})
            lines.append(f"| {r['policy']} | {r['l3_gb']:g} | {r['moved_sessions']} | {sec(m.get('mean_s'))} / "
                         f"{sec(m.get('p95_s'))} | {f.get('count', '-')}: {sec(f.get('mean_s'))} | "
                         f"{sec(b.get('mean_s'))} / {sec(b.get('p95_s'))} |")
    lines += ["", f"## (c) L3 capacity, {args.fail_servers} servers with the failure (simulated)", "",
              "| policy | L3 GB | cluster hit rate | p95 TTFT | L3 hit Mtok | L3 peak GB | objects the master evicted / the servers deleted | moved first TTFT mean | arriving after the failure | counted from max(arrival, failure) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["cell"].startswith("c-"):
            lines.append(f"| {r['policy']} | {r['l3_gb']:g} | {pct(r['token_hit_rate'])} | {sec(r['ttft_p95_s'])} | "
                         f"{r['l3_hit_tokens'] / 1e6:.2f} | {r.get('l3_peak_used_bytes', 0) / 1e9:.1f} | "
                         f"{r.get('l3_evicted_objects', 0):,} / {r.get('l3_deleted_objects', 0):,} | "
                         f"{sec(r.get('moved_first_ttft', {}).get('mean_s'))} | "
                         f"{sec(r.get('moved_first_ttft_arrived_after', {}).get('mean_s'))} | "
                         f"{sec(from_failure(r['moved_detail'], r['fail_at_s'])['mean_s'] if 'moved_detail' in r else None)} |")
    return "\n".join(lines) + "\n"


def plot(results: list, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for policy in sorted({r["policy"] for r in results}):
        for l3 in sorted({r["l3_gb"] for r in results if r["cell"].startswith("a-")}):
            rows = sorted((r for r in results if r["cell"].startswith("a-") and r["policy"] == policy
                           and r["l3_gb"] == l3), key=lambda r: r["servers"])
            label = f"{policy}, L3 {l3:g} GB"
            ax1.plot([r["servers"] for r in rows], [r["token_hit_rate"] * 100 for r in rows], marker="o", label=label)
            ax2.plot([r["servers"] for r in rows], [r["ttft_p95_s"] for r in rows], marker="o", label=label)
        rows = sorted((r for r in results if r["cell"].startswith("c-") and r["policy"] == policy),
                      key=lambda r: r["l3_gb"])
        ax3.plot([r["l3_gb"] for r in rows], [r["token_hit_rate"] * 100 for r in rows], marker="o", label=policy)
    for ax, title, y in ((ax1, "cluster hit rate vs servers", "token hit rate (%)"),
                         (ax2, "p95 TTFT vs servers", "p95 TTFT (s)"), (ax3, "hit rate vs L3 size (failure)", "token hit rate (%)")):
        ax.set_title(title + " (simulated)")
        ax.set_ylabel(y)
        ax.legend(fontsize=7)
    ax1.set_xscale("log", base=2)
    ax2.set_xscale("log", base=2)
    ax3.set_xlabel("L3 GB")
    ax1.set_xlabel("servers")
    ax2.set_xlabel("servers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--servers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--fail-servers", type=int, default=4)
    ap.add_argument("--l3-gb", type=float, default=200.0)
    ap.add_argument("--l3-sweep-gb", type=float, nargs="+", default=[0, 25, 50, 100, 200, 400])
    ap.add_argument("--l3-rankings", nargs="+", choices=("eq7", "lru"), default=["eq7", "lru"],
                    help="what leaves L3 for histate: its eq. 7 ledger (core/l3_ledger.py), the master's LRU, or both side by side")
    ap.add_argument("--l3-link-gbps", type=float)
    ap.add_argument("--l3-op-latency-ms", type=float)
    ap.add_argument("--live-per-server", type=int, default=8)
    ap.add_argument("--sessions-per-server", type=int, default=24)
    ap.add_argument("--gpu-gib", type=float, default=4)
    ap.add_argument("--cpu-gib", type=float, default=8)
    ap.add_argument("--ssd-gib", type=float, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help=f"the Weka trace ({TRACE}) instead of the synthetic workload")
    ap.add_argument("--out", type=Path, default=Path("out/scaleout"))
    ap.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = ap.parse_args()
    if args.trace and not TRACE.exists():
        print(f"no trace at {TRACE}", file=sys.stderr)
        return 2
    try:
        from tqdm import tqdm
    except ImportError:
        def tqdm(it, **_):
            return it
    todo = cells(args)
    results = []
    for name, label, policy, ranking, n, l3, fail in tqdm(todo, desc="scaleout", unit="cell"):
        results.append({**run_cell(args, name, policy, n, l3, fail, ranking), "policy": label})
    args.docs.mkdir(parents=True, exist_ok=True)
    table = markdown(results, args)
    (args.out / "scaleout.md").write_text(table)
    plot(results, args.docs / "scaleout.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
