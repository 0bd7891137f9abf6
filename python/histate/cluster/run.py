"""`histate cluster`: a loopback fleet, one workload through it three times, and what a failover costs.

One run = a Mooncake master + store service (histate.l3.services; left out for the no-L3 run), N
`histate serve` workers sharing it as their L3 (`--l3-master`), sglang-router `--policy manual` in
front (histate.cluster.router), and `histate bench` sending the workload's agent sessions through
the router with `X-SMG-Routing-Key` = root session id. When the failure is on, worker `kill_worker`
is SIGKILLed once `kill_after_fraction` of the requests have completed. Everything started is
stopped at the end of each run, also on error.

The three runs answer the issue's questions on the same sessions:
  * `l3`          L3 on, no failure: what each session hits when it never moves;
  * `l3+kill`     L3 on, the worker dies: the moved sessions' next request restores its prefix from L3;
  * `no-l3+kill`  no L3, the worker dies: the moved sessions recompute.
A session is *moved* when its root had a request served by the killed worker before the kill and
has another after it; its *next request* is the first one completed after the kill. The report
compares that request across the three runs (hit rate, L3 hit tokens, TTFT), and prints per-worker
hit rates. Routing of new keys is random in the router (manual.rs, assignment mode random), so which
sessions move differs between runs: each run's moved sessions are compared with the same requests of
the `l3` run.

Timing on this box is two CPU cores serving a tiny model; hit rates are the measurement that carries
over, TTFTs only as ratios within one run set.
"""
from __future__ import annotations

import json
import math
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from histate.bench.run import BenchOptions, RunFailed, run_bench
from histate.bench.sessions import RetryPolicy
from histate.cluster.router import Router
from histate.cluster.workers import WorkerPool
from histate.sim.replay import ReplayConfig
from histate.sim.request import Workload

RUN_NAMES = ("l3", "l3+kill", "no-l3+kill")


@dataclass(frozen=True)
class ClusterOptions:
    num_workers: int = 2
    kill_worker: int = 0
    kill_after_fraction: float = 0.5
    max_live_sessions: int = 4
    seed: int = 0
    l3_segment_bytes: int = 512 * 2**20
    worker_args: tuple = ()            # extra `histate serve` flags (tier budgets, policy)
    request_timeout_s: float = 120.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.num_workers < 2:
            raise ValueError(f"--workers: a failover needs at least 2 workers, got {self.num_workers}")
        if not 0 <= self.kill_worker < self.num_workers:
            raise ValueError(f"--kill-worker {self.kill_worker}: workers are 0..{self.num_workers - 1}")
        if not 0 < self.kill_after_fraction < 1:
            raise ValueError(f"--kill-after must be in (0, 1), got {self.kill_after_fraction}")


@dataclass
class RunResult:
    name: str
    records: list
    worker_urls: list
    roots: dict                           # session id -> its root session id (the routing key)
    killed_url: Optional[str] = None
    kill_s: Optional[float] = None        # bench clock (seconds since its start) at the kill
    kill_after_records: Optional[int] = None  # records completed when the kill fired (the simulator's trigger)

    def moved_next_requests(self) -> dict:
        """{root session id: the record of its first request completed after the kill}, for roots that
        the killed worker served before it died. Subagents share their root's routing key, so a
        session tree moves as one: its records are grouped by root."""
        if self.killed_url is None:
            return {}
        killed = self.killed_url.removeprefix("http://")
        before = {self.roots[r.session_id] for r in self.records
                  if r.server == killed and r.completion_s <= self.kill_s}
        nxt = {}
        for r in sorted(self.records, key=lambda r: r.completion_s):
            root = self.roots[r.session_id]
            if root in before and r.completion_s > self.kill_s and root not in nxt:  # a retried one too
                nxt[root] = r
        return nxt


def root_ids(workload: Workload) -> dict:
    """session id -> root session id, for every session of the workload (subagents route with their root)."""
    return {s.session_id: root.session_id for root in workload.sessions for s in root.iter_sessions()}


def _one_run(name: str, workload: Workload, options: ClusterOptions, with_l3: bool, kill: bool,
             log_dir: Path) -> RunResult:
    from histate.l3.services import LoopbackMooncake

    mooncake = LoopbackMooncake(options.l3_segment_bytes, log_dir=str(log_dir / name / "mooncake")) if with_l3 else None
    pool = router = None
    try:
        worker_args = list(options.worker_args)
        if mooncake is not None:
            mooncake.start()
            worker_args += ["--l3-master", mooncake.master_address]
        pool = WorkerPool(options.num_workers, extra_args=worker_args)
        pool.start()
        router = Router(pool.urls)
        router.start()
        result = RunResult(name, [], list(pool.urls), root_ids(workload))
        total = workload.num_requests
        trigger = threading.Lock()

        def on_record(record) -> None:
            done = len(result.records) + 1
            result.records.append(record)
            if kill and result.killed_url is None and done >= options.kill_after_fraction * total:
                with trigger:
                    if result.killed_url is None:
                        result.kill_s = record.completion_s
                        result.kill_after_records = done
                        result.killed_url = pool.kill(options.kill_worker).url

        bench = BenchOptions(router.url, label=name, progress=options.progress, on_record=on_record,
                             admission=ReplayConfig(max_live_sessions=options.max_live_sessions, seed=options.seed),
                             retry=RetryPolicy(max_attempts=4, backoff_s=0.5),
                             request_timeout_s=options.request_timeout_s)
        try:
            bench_result = run_bench(workload, bench)
        except RunFailed as failed:
            raise RuntimeError(f"cluster run {name!r} failed: {failed.result.summary['bench'].get('error')}") from None
        result.records = list(bench_result.run.records)
        return result
    finally:
        if router is not None:
            router.stop()
        if pool is not None:
            pool.stop()
        if mooncake is not None:
            mooncake.stop()


def run_cluster(workload: Workload, options: ClusterOptions, log_dir: Path) -> dict:
    """The three runs of the module docstring: {name: RunResult}."""
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = {"l3": (True, False), "l3+kill": (True, True), "no-l3+kill": (False, True)}
    return {name: _one_run(name, workload, options, *plan[name], log_dir) for name in RUN_NAMES}


def _hit_rate(records) -> float:
    tokens = sum(r.input_tokens for r in records)
    return sum(r.reused_tokens for r in records) / tokens if tokens else math.nan


def summarize(runs: dict) -> dict:
    """Per-worker hit rates per run, and the moved sessions' next requests against the same requests
    in the `l3` run (no failure)."""
    baseline = {r.uid: r for r in runs["l3"].records}
    out = {"runs": {}}
    for name, run in runs.items():
        per_worker = {}
        for url in run.worker_urls:
            mine = [r for r in run.records if r.server == url.removeprefix("http://")]
            per_worker[url] = {"requests": len(mine), "hit_rate": _hit_rate(mine),
                               "l3_hit_tokens": sum(r.l3_hit_tokens for r in mine)}
        moved = list(run.moved_next_requests().values())
        same = [baseline[r.uid] for r in moved if r.uid in baseline]
        out["runs"][name] = {
            "requests": len(run.records), "hit_rate": _hit_rate(run.records), "per_worker": per_worker,
            "killed": run.killed_url, "kill_after_records": run.kill_after_records, "moved_sessions": len(moved),
            "moved_next_uids": sorted(r.uid for r in moved),
            "moved_next_hit_rate": _hit_rate(moved), "moved_next_l3_hit_tokens": sum(r.l3_hit_tokens for r in moved),
            "moved_next_mean_ttft_s": statistics.fmean(r.ttft_s for r in moved) if moved else math.nan,
            "same_requests_without_failure_hit_rate": _hit_rate(same),
            "same_requests_without_failure_mean_ttft_s": statistics.fmean(r.ttft_s for r in same) if same else math.nan,
        }
    return out


def format_report(summary: dict) -> str:
    lines = ["| run | requests | hit rate | per worker (hit rate, requests) | moved sessions | their next request: "
             "hit rate | L3 hit tokens | mean TTFT | same requests without failure: hit rate | mean TTFT |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary["runs"].items():
        workers = ", ".join(f"{url.rsplit(':', 1)[-1]}: {w['hit_rate']:.1%} ({w['requests']})"
                            for url, w in s["per_worker"].items())
        lines.append(f"| {name} | {s['requests']} | {s['hit_rate']:.1%} | {workers} | {s['moved_sessions']} | "
                     f"{s['moved_next_hit_rate']:.1%} | {s['moved_next_l3_hit_tokens']} | "
                     f"{s['moved_next_mean_ttft_s']:.3f} s | {s['same_requests_without_failure_hit_rate']:.1%} | "
                     f"{s['same_requests_without_failure_mean_ttft_s']:.3f} s |")
    return "\n".join(lines)


def write_report(summary: dict, runs: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    with open(out_dir / "requests.csv", "w") as f:
        f.write("run,uid,session_id,session_index,server,input_tokens,reused_tokens,l3_hit_tokens,arrival_s,ttft_s\n")
        for name, run in runs.items():
            for r in sorted(run.records, key=lambda r: r.uid):
                f.write(f"{name},{r.uid},{r.session_id},{r.session_index},{r.server},{r.input_tokens},"
                        f"{r.reused_tokens},{r.l3_hit_tokens},{r.arrival_s:.6f},{r.ttft_s:.6f}\n")
    (out_dir / "report.md").write_text(format_report(summary) + "\n")
