"""`histate cluster`: a loopback fleet, one workload through it four times, and what a failover costs.

One run = a Mooncake master + store service (histate.l3.services; left out for the no-L3 run), N
`histate serve` workers sharing it as their L3 (`--l3-master`), sglang-router `--policy manual` in
front (histate.cluster.router), and `histate bench` sending the workload's agent sessions through
the router with `X-SMG-Routing-Key` = root session id. When the failure is on, a worker (`kill_worker`,
by default the one that has served the most sessions so far) is SIGKILLed once `kill_after_fraction`
of the requests have completed. Everything started is
stopped at the end of each run, also on error.

The four runs answer the issue's questions on the same sessions:
  * `l3`             L3 on, no failure: what each session hits when it never moves;
  * `l3+kill`        L3 on, a worker dies: the moved sessions' next request restores its prefix from L3;
  * `no-l3+kill`     no L3, the same kill: the moved sessions recompute;
  * `l3+store-kill`  L3 on, the store service dies instead (every L3 object gone, reads fail):
                     later requests must still be served, and served right.
Every answer of every run is checked against a cold recompute of its prompt on the reference model
in this process (greedy tokens; `exact` in the report): a fault may cost hits, never correctness.
A session is *moved* when its root had a request served by the killed worker before the kill and
has another after it; its *next request* is the first one completed after the kill (on another
worker, necessarily). The report
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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from histate.bench.run import BenchOptions, RunFailed, run_bench
from histate.bench.sessions import RetryPolicy
from histate.cluster.router import Router
from histate.cluster.workers import WorkerPool
from histate.sim.replay import ReplayConfig
from histate.sim.request import Workload

RUN_PLAN = {  # name: (L3 on, kill a worker, kill the store service)
    "l3": (True, False, False), "l3+kill": (True, True, False), "no-l3+kill": (False, True, False),
    "l3+store-kill": (True, False, True)}
RUN_NAMES = tuple(RUN_PLAN)


@dataclass(frozen=True)
class ClusterOptions:
    num_workers: int = 2
    kill_worker: Optional[int] = None  # None: the worker that has served the most sessions at the kill
    kill_after_fraction: float = 0.5
    max_live_sessions: int = 4
    seed: int = 0
    l3_segment_bytes: int = 512 * 2**20
    worker_args: tuple = ()            # extra `histate serve` flags (tier budgets, policy)
    request_timeout_s: float = 120.0
    progress: bool = True
    router_policy: str = "manual"      # or round_robin (cache_aware is refused: cluster/policies.py)

    def __post_init__(self) -> None:
        if self.num_workers < 2:
            raise ValueError(f"--workers: a failover needs at least 2 workers, got {self.num_workers}")
        if self.kill_worker is not None and not 0 <= self.kill_worker < self.num_workers:
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
    kill_after_requests: Optional[int] = None  # requests completed when the worker or store died
    store_killed: bool = False

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
            # completed after the kill, elsewhere: a new request, or one in flight on the dead worker
            # and resent (its arrival is the resend's), or one already queued elsewhere
            if root in before and root not in nxt and r.completion_s > self.kill_s and r.server != killed:
                nxt[root] = r
        return nxt


def root_ids(workload: Workload) -> dict:
    """session id -> root session id, for every session of the workload (subagents route with their root)."""
    return {s.session_id: root.session_id for root in workload.sessions for s in root.iter_sessions()}


def _busiest(records, worker_urls: list, roots: dict) -> int:
    """Index of the worker that has served the most root sessions (ties: the lower index)."""
    sessions = {url: set() for url in worker_urls}
    for r in records:
        url = "http://" + r.server
        if url in sessions:
            sessions[url].add(roots[r.session_id])
    return max(range(len(worker_urls)), key=lambda i: (len(sessions[worker_urls[i]]), -i))


def _one_run(name: str, workload: Workload, options: ClusterOptions, log_dir: Path) -> RunResult:
    from histate.l3.services import LoopbackMooncake

    with_l3, kill_worker, kill_store = RUN_PLAN[name]
    mooncake = LoopbackMooncake(options.l3_segment_bytes, log_dir=str(log_dir / name / "mooncake")) if with_l3 else None
    pool = router = None
    try:
        worker_args = list(options.worker_args)
        if mooncake is not None:
            mooncake.start()
            worker_args += ["--l3-master", mooncake.master_address]
        pool = WorkerPool(options.num_workers, extra_args=worker_args)
        pool.start()
        router = Router(pool.urls, policy=options.router_policy)
        router.start()
        result = RunResult(name, [], list(pool.urls), root_ids(workload))
        threshold = options.kill_after_fraction * workload.num_requests

        def on_record(record) -> None:
            result.records.append(record)
            if not (kill_worker or kill_store) or result.kill_after_requests is not None \
                    or len(result.records) < threshold:
                return
            result.kill_s, result.kill_after_requests = record.completion_s, len(result.records)
            if kill_worker:
                index = options.kill_worker
                if index is None:
                    index = _busiest(result.records, result.worker_urls, result.roots)
                result.killed_url = pool.kill(index).url
            if kill_store:
                mooncake.kill_store()
                result.store_killed = True

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


def cold_output_digests(workload: Workload, seed: int) -> dict:
    """{uid: digest of the greedy output of a cold recompute of the request's prompt}, on the same
    reference model the workers serve (fp32, same weights), with the prompts histate bench sent."""
    from histate.bench.backends import output_digest
    from histate.bench.prompts import PromptBuilder
    from histate.reference.runner import ModelRunner

    runner = ModelRunner("fp32")
    prompts = PromptBuilder(workload.page_num_tokens, runner.model.config.vocab_size, salt=seed)
    digests = {}
    for root in workload.sessions:
        for session in root.iter_sessions():
            for req in session.requests:
                tokens = runner.cold_run(prompts.prompt(req), req.output_num_tokens).decode_tokens
                digests[req.uid] = output_digest(list(tokens))
    return digests


def run_cluster(workload: Workload, options: ClusterOptions, log_dir: Path) -> dict:
    """The three runs of the module docstring: {name: RunResult}."""
    log_dir.mkdir(parents=True, exist_ok=True)
    return {name: _one_run(name, workload, options, log_dir) for name in RUN_NAMES}


def _hit_rate(records) -> float:
    tokens = sum(r.input_tokens for r in records)
    return sum(r.reused_tokens for r in records) / tokens if tokens else math.nan


def summarize(runs: dict, cold_digests: Optional[dict] = None) -> dict:
    """Per-worker hit rates per run, the moved sessions' next requests against the same requests in
    the `l3` run (no failure), L3 hits after a store kill, and how many answers equal a cold
    recompute (when `cold_digests` is given)."""
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
            "killed": run.killed_url, "moved_sessions": len(moved),
            "moved_next_uids": sorted(r.uid for r in moved),
            "moved_next_hit_rate": _hit_rate(moved), "moved_next_l3_hit_tokens": sum(r.l3_hit_tokens for r in moved),
            "moved_next_mean_ttft_s": statistics.fmean(r.ttft_s for r in moved) if moved else math.nan,
            "same_requests_without_failure_hit_rate": _hit_rate(same),
            "same_requests_without_failure_mean_ttft_s": statistics.fmean(r.ttft_s for r in same) if same else math.nan,
            "kill_after_requests": run.kill_after_requests, "store_killed": run.store_killed,
            "l3_hit_tokens_after_store_kill": sum(r.l3_hit_tokens for r in run.records
                                                  if run.store_killed and r.arrival_s >= run.kill_s),
            "exact": (sum(cold_digests.get(r.uid) == r.output_digest for r in run.records)
                      if cold_digests is not None else None),
        }
    return out


def format_report(summary: dict) -> str:
    lines = ["| run | requests | equal to cold | hit rate | per worker (hit rate, requests) | moved sessions | "
             "their next request: hit rate | L3 hit tokens | mean TTFT | same requests without failure: hit rate | "
             "mean TTFT |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summary["runs"].items():
        workers = ", ".join(f"{url.rsplit(':', 1)[-1]}: {w['hit_rate']:.1%} ({w['requests']})"
                            for url, w in s["per_worker"].items())
        exact = "-" if s["exact"] is None else f"{s['exact']}/{s['requests']}"
        lines.append(f"| {name} | {s['requests']} | {exact} | {s['hit_rate']:.1%} | {workers} | {s['moved_sessions']} | "
                     f"{s['moved_next_hit_rate']:.1%} | {s['moved_next_l3_hit_tokens']} | "
                     f"{s['moved_next_mean_ttft_s']:.3f} s | {s['same_requests_without_failure_hit_rate']:.1%} | "
                     f"{s['same_requests_without_failure_mean_ttft_s']:.3f} s |")
    return "\n".join(lines)


def write_report(summary: dict, runs: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    with open(out_dir / "requests.csv", "w") as f:
        f.write("run,uid,session_id,session_index,server,input_tokens,reused_tokens,l3_hit_tokens,arrival_s,ttft_s,"
                "output_digest\n")
        for name, run in runs.items():
            for r in sorted(run.records, key=lambda r: r.uid):
                f.write(f"{name},{r.uid},{r.session_id},{r.session_index},{r.server},{r.input_tokens},"
                        f"{r.reused_tokens},{r.l3_hit_tokens},{r.arrival_s:.6f},{r.ttft_s:.6f},{r.output_digest}\n")
    (out_dir / "report.md").write_text(format_report(summary) + "\n")
