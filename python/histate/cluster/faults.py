"""`histate cluster --faults`: every L3 fault on one loopback cluster; each must be a miss, never a wrong answer.

One cluster for all scenarios (a Mooncake master + store service, N `histate serve` workers with
`--l3-master`, sglang-router `--policy manual`): its start is most of the cost, and each scenario
uses prompts of its own (its own seed), so what one scenario left in L3 is never read by another.

A scenario runs its small workload twice through the router. The first run (*populate*) writes each
request's terminal bundle to L3. Then the fault is injected, and the second run (*measure*) sends
the same sessions again: `histate bench` flushes the workers' local tiers first, so every session's
first turn can only resume from L3 -- the reads the fault is aimed at. Both runs' answers are
compared with a cold recompute of each prompt (greedy tokens on the same reference model).

  none            no fault: what the measure run reads from L3 when nothing goes wrong
  garbage         every L3 object overwritten (upsert, through a raw Mooncake client) with the same
                  number of bytes: HiState's frame header kept, every payload byte flipped, so only
                  the BLAKE2b-128 checksum can tell (histate/l3/client.py)
  truncated       every L3 object overwritten with its first half (the frame's size check)
  full            the store filled with hard-pinned junk (never evicted) before the populate run:
                  every put is refused (NO_SPACE) after the client's bounded retries, so the
                  measure run finds nothing to read
  slow            the store service SIGSTOPped for PAUSE_S during the measure run: reads hang (30 s
                  in Mooncake's transfer engine), the client gives up after its op timeout
  store-kill      the store service SIGKILLed before the measure run (restarted, empty, after it)
  master-restart  the master SIGKILLed before the measure run and restarted RESTART_AFTER_S into
                  it; a third run (*after*) checks that the workers' clients write to the new master

Each scenario reports its requests, answers checked against the cold recompute and how many were
wrong (must be 0), the measure run's L3 lookups that hit and missed (worker counters), the fault's
own count (it fired), and the longest TTFT of the measure run, which must stay under STALL_BOUND_S.
"""
from __future__ import annotations

import json
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from histate.l3.client import DEFAULT_DOWN_FOR_S, FRAME_HEADER_SIZE_BYTES, connect_store

SCENARIOS = ("none", "garbage", "truncated", "full", "slow", "store-kill", "master-restart")
PAUSE_S = 3.0
RESTART_AFTER_S = 2.0
STALL_BOUND_S = 5.0
"""No request of a faulted run may take longer than this to its first token. The workers' L3 client
waits at most 1 s for a store call and then skips the store for 2 s (l3/client.py); without that, a
read from the paused store waits 30 s and each call to a dead master 4.3 s."""
WORKER_KEY_PREFIX = "histate/"     # `histate serve --l3-key-prefix` default, + the client's separator
JUNK_PREFIX = "fault-junk-"
JUNK_OBJECT_BYTES = (2**20, 2**16, 2**12)   # large first, then the gaps
RECONNECT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class FaultOptions:
    num_workers: int = 2
    sessions: int = 4
    turns: int = 2
    seed: int = 0
    l3_segment_bytes: int = 64 * 2**20
    scenarios: tuple = SCENARIOS
    progress: bool = False


@dataclass
class ScenarioResult:
    name: str
    requests: int = 0                 # answers, all runs of the scenario
    checked: int = 0                  # of those, compared with a cold recompute
    wrong: int = 0
    l3_lookups: int = 0               # measure run: worker lookups beyond the local resume point
    l3_hits: int = 0                  # ... that restored something from L3
    l3_hit_tokens: int = 0            # measure run, from the answers
    fired: dict = field(default_factory=dict)   # the fault's own counts (see `fired_count`)
    max_ttft_s: float = 0.0           # measure run
    after: dict = field(default_factory=dict)   # master-restart: the last after run's worker counters
    after_runs: int = 0               # master-restart: after runs sent until the workers' puts landed

    @property
    def l3_misses(self) -> int:
        return self.l3_lookups - self.l3_hits


FIRED_KEY = {"none": None, "garbage": "client_corrupt", "truncated": "client_corrupt",
             "full": "object_put_failures", "slow": "client_timeouts", "store-kill": "shortened_hits",
             "master-restart": "object_put_failures"}
"""Which worker counter says the fault fired (summed over workers, from the injection to the end of
the measure run); the injector's own count (`objects_damaged`, `junk_objects`) is reported beside it.
`shortened_hits`: lookups whose reads came back shorter than the master's listing. A dead master is
seen as failed puts: whether a call to it also marks the store down (`client_down_events`) depends on
how it fails, at once (connection refused: a fast failure, no down event) or after the RPC's own
timeout (a down event), which varies from run to run on the same cluster."""


def fired_count(result: ScenarioResult) -> Optional[int]:
    key = FIRED_KEY[result.name]
    return None if key is None else result.fired.get(key, 0)


def worker_l3_counters(urls) -> dict:
    """The workers' L3 counters summed (GET /server_info histate_stats.l3: tier and client)."""
    total: dict = {}
    for url in urls:
        with urllib.request.urlopen(url + "/server_info", timeout=10) as resp:
            l3 = json.loads(resp.read())["histate_stats"]["l3"]
        client = {f"client_{k}": v for k, v in l3.pop("client").items()}
        for name, value in {**l3, **client}.items():
            if isinstance(value, int):
                total[name] = total.get(name, 0) + value
    return total


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items()}


class FaultCluster:
    """The cluster the scenarios share, and the injector's raw Mooncake client."""

    def __init__(self, options: FaultOptions, log_dir: Path) -> None:
        self.options, self.log_dir = options, log_dir
        self.mooncake = self.pool = self.router = self.raw = None

    def __enter__(self) -> "FaultCluster":
        from histate.cluster.router import Router
        from histate.cluster.workers import WorkerPool
        from histate.l3.services import LoopbackMooncake

        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.mooncake = LoopbackMooncake(self.options.l3_segment_bytes, log_dir=str(self.log_dir / "mooncake"))
            self.mooncake.start()
            self.pool = WorkerPool(self.options.num_workers, extra_args=["--l3-master", self.mooncake.master_address],
                                   base_dir=self.log_dir)
            self.pool.start()
            self.router = Router(self.pool.urls, log_dir=self.log_dir)
            self.router.start()
            self.raw = connect_store(self.mooncake.master_address)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for part in (self.router, self.pool, self.mooncake):
            if part is not None:
                part.stop()

    # --- injections ------------------------------------------------------------------------------
    def worker_keys(self) -> list:
        return [k for k in self.mooncake.all_keys() if k.startswith(WORKER_KEY_PREFIX)]

    def damage_objects(self, damage: Callable[[bytes], bytes]) -> int:
        """Overwrite every worker object with `damage(its bytes)`; returns how many were overwritten."""
        done = 0
        for key in self.worker_keys():
            blob = self.raw.get(key)
            if blob and self.raw.upsert(key, damage(bytes(blob))) == 0:
                done += 1
        return done

    def fill_with_pinned_junk(self) -> int:
        """Remove every worker object, then put hard-pinned objects (never evicted) until the store
        refuses even the smallest: from then on every put is refused. Returns how many junk objects."""
        from mooncake.store import ReplicateConfig

        self.raw.remove_by_regex(f"^{WORKER_KEY_PREFIX}.*", True)
        pinned = ReplicateConfig()
        pinned.with_hard_pin = True
        num_objects = 0
        for size_bytes in JUNK_OBJECT_BYTES:
            while self.raw.put(f"{JUNK_PREFIX}{num_objects}", b"\0" * size_bytes, pinned) == 0:
                num_objects += 1
        return num_objects

    def remove_junk(self) -> int:
        return self.raw.remove_by_regex(f"^{JUNK_PREFIX}.*", True)

    def wait_store_writable(self) -> float:
        """Seconds until a put lands again (a restarted master or store service: the segment is mounted
        within a heartbeat)."""
        started = time.monotonic()
        probe = f"{JUNK_PREFIX}probe"
        while self.raw.put(probe, b"probe") != 0:
            if time.monotonic() - started > RECONNECT_TIMEOUT_S:
                raise RuntimeError(f"the L3 store took no put within {RECONNECT_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        self.raw.remove(probe, True)
        return time.monotonic() - started


def garble_payload(blob: bytes) -> bytes:
    """Same size, HiState's frame header intact, every payload byte changed: only the checksum can tell."""
    return blob[:FRAME_HEADER_SIZE_BYTES] + bytes(b ^ 0x5A for b in blob[FRAME_HEADER_SIZE_BYTES:])


def truncate(blob: bytes) -> bytes:
    return blob[:len(blob) // 2]


def _workload(options: FaultOptions, seed: int):
    from .workload import cluster_workload

    return cluster_workload(options.sessions, options.turns, seed)


def _bench(cluster: FaultCluster, workload, seed: int, label: str, progress: bool):
    from histate.bench.run import BenchOptions, RunFailed, run_bench
    from histate.bench.sessions import RetryPolicy
    from histate.sim.replay import ReplayConfig

    options = BenchOptions(cluster.router.url, label=label, progress=progress,
                           admission=ReplayConfig(max_live_sessions=len(workload.sessions), seed=seed),
                           retry=RetryPolicy(max_attempts=2, backoff_s=0.5), request_timeout_s=60.0)
    try:
        return list(run_bench(workload, options).run.records)
    except RunFailed as failed:
        raise RuntimeError(f"fault scenario run {label!r} failed: {failed.result.summary['bench'].get('error')}") \
            from None


def run_scenario(cluster: FaultCluster, name: str, seed: int) -> ScenarioResult:
    from histate.cluster.run import cold_output_digests

    options, mooncake = cluster.options, cluster.mooncake
    workload = _workload(options, seed)
    result = ScenarioResult(name)
    start = worker_l3_counters(cluster.pool.urls)
    if name == "full":  # before the populate run: its puts are the ones refused
        result.fired["junk_objects"] = cluster.fill_with_pinned_junk()
    records = _bench(cluster, workload, seed, f"{name}/populate", options.progress)

    before = worker_l3_counters(cluster.pool.urls)
    timer = None
    if name == "garbage":
        result.fired["objects_damaged"] = cluster.damage_objects(garble_payload)
    elif name == "truncated":
        result.fired["objects_damaged"] = cluster.damage_objects(truncate)
    elif name == "slow":
        mooncake.pause_store()
        timer = threading.Timer(PAUSE_S, mooncake.resume_store)
    elif name == "store-kill":
        mooncake.kill_store()
    elif name == "master-restart":
        mooncake.kill_master()
        timer = threading.Timer(RESTART_AFTER_S, mooncake.start_master)
    if timer is not None:
        timer.start()
    try:
        measured = _bench(cluster, workload, seed, f"{name}/measure", options.progress)
    finally:
        if timer is not None:
            timer.join()
    end = worker_l3_counters(cluster.pool.urls)
    counters = _delta(end, start if name == "full" else before)
    result.fired.update({k: counters.get(k, 0) for k in (
        "client_corrupt", "client_corrupt_removed", "object_put_failures", "client_put_retries",
        "client_timeouts", "client_down_events", "client_skipped_down", "shortened_hits")})
    measure = _delta(end, before)
    result.l3_lookups, result.l3_hits = measure.get("lookups", 0), measure.get("hits", 0)
    result.l3_hit_tokens = sum(r.l3_hit_tokens for r in measured)
    result.max_ttft_s = max(r.ttft_s for r in measured)
    records += measured

    if name == "full":
        result.fired["junk_removed"] = cluster.remove_junk()
    elif name == "store-kill":
        mooncake.start_store()
        cluster.wait_store_writable()
    elif name == "master-restart":
        result.fired["reconnect_s"] = round(cluster.wait_store_writable(), 2)
        # The workers' own clients reconnect by themselves, on their own schedule (a fresh client of
        # this process can put 0.2-0.8 s after the restart; a worker's can take longer): resend the
        # sessions until a run's puts all land, within RECONNECT_TIMEOUT_S.
        started_s = time.monotonic()
        while True:
            before = worker_l3_counters(cluster.pool.urls)
            records += _bench(cluster, workload, seed, f"{name}/after", options.progress)
            result.after = _delta(worker_l3_counters(cluster.pool.urls), before)
            result.after_runs += 1
            landed = result.after.get("objects_put", 0) > 0 and result.after.get("object_put_failures", 0) == 0
            if landed or time.monotonic() - started_s > RECONNECT_TIMEOUT_S:
                break
            time.sleep(1.0)
        result.fired["workers_reconnect_s"] = round(time.monotonic() - started_s, 2)
    if name in ("slow", "store-kill", "master-restart"):
        time.sleep(DEFAULT_DOWN_FOR_S)  # the workers' down windows lapse: the next scenario starts clean

    cold = cold_output_digests(workload, seed)
    result.requests = len(records)
    result.checked = sum(r.uid in cold for r in records)
    result.wrong = sum(r.uid in cold and cold[r.uid] != r.output_digest for r in records)
    return result


def run_faults(options: FaultOptions, log_dir: Optional[Path] = None) -> list:
    """Every scenario of `options.scenarios` on one cluster, in order: [ScenarioResult]."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="histate-faults-"))
    with FaultCluster(options, log_dir) as cluster:
        return [run_scenario(cluster, name, options.seed + 1000 * (i + 1))
                for i, name in enumerate(options.scenarios)]


def format_line(r: ScenarioResult) -> str:
    fired = fired_count(r)
    extra = {k: v for k, v in r.fired.items() if v}
    line = (f"{r.name:<15} requests {r.requests:3d}  checked {r.checked:3d}  wrong {r.wrong}  "
            f"L3 hits {r.l3_hits:2d} misses {r.l3_misses:2d} ({r.l3_hit_tokens} tokens)  "
            f"fired {'-' if fired is None else fired} ({FIRED_KEY[r.name] or 'no fault'})  "
            f"max TTFT {r.max_ttft_s:.2f} s  {extra}")
    if r.after:
        line += (f"  after restart ({r.after_runs} run(s)): objects put {r.after.get('objects_put', 0)}, "
                 f"failed {r.after.get('object_put_failures', 0)}, L3 hits {r.after.get('hits', 0)}")
    return line
