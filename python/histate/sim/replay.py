"""Replay driver: a workload through one cache policy and the GPU engine model, in simulated time.

Admission follows the paper (§4.1): at most `max_live_sessions` root sessions are live; whenever one
ends (its last request and all its subagents complete) the next session of a seeded random order is
admitted. The order is the same for every policy, so policies see the same sessions; timing within a
session is closed-loop (request.py: a request arrives its think/tool gap after the previous one
completes), so a slower policy stretches its own replay, as a real server would.

Which sessions (`admission_order`): a seeded shuffle of the roots, cut at `max_sessions`. With
`session_sampling="all"` the shuffle covers every root of the source, including those the
max-context rule emptied (`Workload.root_ids`): an empty one takes its slot and ends at once, as
when the paper's replayer "randomly selects another session from the dataset" (§4.1) and the
server rejects its over-long first request. `"non-empty"` shuffles only the kept sessions. "all"
also keeps draws paired across context clips: a seed draws the same roots whatever the clip.

Start-up (`stagger_s`): the first wave of `max_live_sessions` sessions is released one every
`stagger_s` seconds (session k of the order at k x stagger_s) instead of all at t = 0. In steady
state sessions are admitted one at a time as others end, so their cold first prefills do not
queue behind each other; releasing 24 at once puts first-wave requests behind up to 23 cold
prefills, a start-up artefact that filled half of the top 1% of TTFTs for every cached policy
(`DEFAULT_STAGGER_S`). Later admissions are unchanged.

Per request: it arrives and waits until the policy's engine admits it into GPU memory
(admission.py: SGLang's reserve rule or vLLM's block allocation with preemption); admission matches
and pins the cache (`cache.begin_request`), promises the request's memory and starts the restore of
KV per tier + one checkpoint; the engine charges the recompute of L - c tokens; when the last token
is out the cache takes prompt and output pages with the states that engine keeps
(`cache.finish_request`), and the bytes the cache wrote to CPU / SSD are charged to the links as
background transfers. TTFT = first token - arrival.
"""
from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from ..core import (DEFAULT_INTERVALS_PAGES, DEFAULT_TAU_S, CacheConfig, HybridPrefixCache, MissHistory, MissRecorder,
                    ObserverGroup, Tier, default_staging_slots, make_policy, with_host_write_policy)
from .admission import CacheGate, engine_profile
from .costs import (HardwareSpec, RooflineStepCost, attention_pair_tokens, get_hardware, get_model,
                    restore_cost_tokens, vllm_hybrid_blocks)
from .engine import Engine, EngineConfig, EngineRequest, EventKind
from .metrics import PolicyRun, RequestRecord
from .request import Workload

GiB = 2**30
SESSION_SAMPLINGS = ("all", "non-empty")
DEFAULT_STAGGER_S = 20.0
"""First-wave spacing. Measured on the paper preset (docs/results.md, workload presets): released
together, the first wave's cold first requests are 51% of the top 1% of TTFTs for every cached
policy; at 10 s spacing still 14%; from 20 s on 9%, which is their share of all first requests (24
of ~97 sessions), so the start-up no longer shows in the tail. 20 s is the smallest such spacing
tried (0/10/20/30/60 s): the 24-session ramp takes 8 minutes of a ~3 h replay."""


@dataclass(frozen=True)
class ReplayConfig:
    """The paper preset by default (§4.1): Qwen3.5-9B on one H100, 45 GiB GPU pool, 96 GiB CPU,
    150 GiB SSD, 24 live sessions."""

    model: str = "qwen3.5-9b"
    hardware: str = "h100"
    gpu_cache_bytes: int = 45 * GiB
    cpu_cache_bytes: int = 96 * GiB
    ssd_cache_bytes: int = 150 * GiB
    max_live_sessions: int = 24
    max_sessions: Optional[int] = None  # root sessions admitted in total (None: all)
    session_sampling: str = "all"       # draw from "all" roots (empty ones take a slot) or "non-empty"
    stagger_s: float = DEFAULT_STAGGER_S  # first-wave session k is released at k x stagger_s
    seed: int = 0
    tau_s: float = DEFAULT_TAU_S
    intervals_pages: tuple = DEFAULT_INTERVALS_PAGES
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_cost: Optional[RooflineStepCost] = None  # a CalibratedStepCost replaces the roofline
    hardware_spec: Optional[HardwareSpec] = None  # overrides the `hardware` preset (other link speeds)
    engine_name: Optional[str] = None  # serve every policy with this engine's scheduler (what-if); None: its own
    tool_wait: bool = False  # tool-wait residency for the policies that read it (CacheConfig.tool_wait)

    def __post_init__(self) -> None:
        if self.session_sampling not in SESSION_SAMPLINGS:
            raise ValueError(f"session_sampling must be one of {SESSION_SAMPLINGS}, got {self.session_sampling!r}")
        if not (math.isfinite(self.stagger_s) and self.stagger_s >= 0):
            raise ValueError(f"stagger_s must be a finite number >= 0, got {self.stagger_s}")
        if self.max_live_sessions < 1:
            raise ValueError(f"max_live_sessions must be >= 1, got {self.max_live_sessions}")
        if self.max_sessions is not None and self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1 or None, got {self.max_sessions}")

    def resolved_hardware(self) -> HardwareSpec:
        return self.hardware_spec if self.hardware_spec is not None else get_hardware(self.hardware)

    def staging_bytes(self, policy=None) -> int:
        """Host DRAM a policy keeps for state staging instead of cache: HiState's host tier holds KV,
        and its `default_staging_slots` state slots (sized for `max_live_sessions` running requests,
        `--histate-host-state-slots`) only stage checkpoints on their way to SSD and back. Never more
        than the budget (the plugin refuses such a host; tiny test budgets keep no host KV then)."""
        tiers = getattr(policy, "checkpoint_tiers", None)
        if tiers is None or Tier.CPU in tiers or Tier.CPU not in policy.tiers:
            return 0
        slots = default_staging_slots(self.max_live_sessions)
        return min(self.cpu_cache_bytes, slots * get_model(self.model).checkpoint_size_bytes)

    def rules(self, policy: str, has_l3: bool = False):
        """The `histate.core.Policy` named `policy` as the server runs it on this machine's tiers: the
        plugin picks write_back by itself on a short host (`with_host_write_policy`, core/write_policy.py),
        from the same pools it would build (the host's KV pool: its budget less the state staging slots)."""
        rules = make_policy(policy)
        return with_host_write_policy(rules, self.gpu_cache_bytes, self.cpu_cache_bytes - self.staging_bytes(rules),
                                      has_ssd=self.ssd_cache_bytes > 0, has_l3=has_l3)

    def cache_config(self, page_num_tokens: int, policy=None) -> CacheConfig:
        """The cache of `policy` (a `histate.core.Policy`): block-granular policies (vLLM) get the
        model's hybrid block as their granularity and a state of whole blocks (costs.vllm_hybrid_blocks)."""
        model = get_model(self.model)
        state_bytes, block_pages = model.checkpoint_size_bytes, 1
        if policy is not None and policy.int8_checkpoints:
            state_bytes = model.int8_checkpoint_size_bytes
        if policy is not None and policy.block_granular:
            blocks = vllm_hybrid_blocks(model)
            state_bytes, block_pages = blocks.state_size_bytes, max(1, blocks.block_num_tokens // page_num_tokens)
        hw = self.resolved_hardware()
        step_cost = self.step_cost or RooflineStepCost(model, hw)
        restore = {Tier(t): c for t, c in restore_cost_tokens(model, hw, step_cost).items()}
        return CacheConfig(
            page_num_tokens=page_num_tokens, kv_bytes_per_token=model.kv_bytes_per_token,
            checkpoint_size_bytes=state_bytes, block_pages=block_pages,
            attention_pair_tokens=attention_pair_tokens(model),
            capacity_bytes={Tier.GPU: self.gpu_cache_bytes, Tier.CPU: self.cpu_cache_bytes - self.staging_bytes(policy),
                            Tier.SSD: self.ssd_cache_bytes},
            tau_s=self.tau_s, supported_intervals_pages=self.intervals_pages, restore_cost_tokens=restore,
            tool_wait=self.tool_wait)


@dataclass(slots=True)
class _SessionRun:
    session: object
    root_id: str
    next_index: int = 0
    is_waiting: bool = False  # next request waits for child sessions (`after_sessions`)
    is_done: bool = False


class SessionDriver:
    """Closed-loop agent sessions (admission, subagents, gaps) shared by the single-server replay and the
    cluster replay (cluster.py). The host class provides `queue` (roots, popped from the end),
    `num_live`, `pending_roots`, `runs`, `children`, `seq`, `arrivals`, `max_live_sessions` and
    `_close_session(session_id, t)` (where a finished session's references are released)."""

    def _admit(self, t: float) -> None:
        while self.num_live < self.max_live_sessions and self.queue:
            self._admit_next(t)

    def _admit_next(self, t: float) -> None:
        root = self.queue.pop()
        self.num_live += 1
        self.pending_roots[root.session_id] = sum(1 for _ in root.iter_sessions())
        self._release(root, root.session_id, t)

    def _release(self, session, root_id: str, t: float) -> None:
        run = _SessionRun(session, root_id)
        self.runs[session.session_id] = run
        for child in session.subagents:
            self.children.setdefault((session.session_id, child.spawn_after_index), []).append(child)
        for child in self.children.pop((session.session_id, -1), []):
            self._release(child, root_id, t)
        self._schedule_next(run, t)

    def _schedule_next(self, run: _SessionRun, t: float) -> None:
        requests = run.session.requests
        if run.next_index >= len(requests):
            self._session_done(run, t)
            return
        req = requests[run.next_index]
        if any(not (c in self.runs and self.runs[c].is_done) for c in req.after_sessions):
            run.is_waiting = True
            return
        run.is_waiting = False
        self.seq += 1
        heapq.heappush(self.arrivals, (max(t + req.gap_before_s, self._earliest_arrival_s(req.uid)), self.seq, run, req))

    def _earliest_arrival_s(self, uid) -> float:
        """A floor on a request's arrival (closed loop otherwise): none here; the cluster twin of a
        live run uses the live arrivals (cluster.py `ClusterConfig.earliest_arrival_s`)."""
        return 0.0

    def _advance(self, run: _SessionRun, t: float) -> None:
        """A request of `run` finished: release the subagents spawned after it, schedule the next one."""
        index = run.next_index
        run.next_index += 1
        for child in self.children.pop((run.session.session_id, index), []):
            self._release(child, run.root_id, t)
        self._schedule_next(run, t)

    def _session_done(self, run: _SessionRun, t: float) -> None:
        run.is_done = True
        self._close_session(run.session.session_id, t)
        parent_id = run.session.parent_session_id
        if parent_id is not None and parent_id in self.runs and self.runs[parent_id].is_waiting:
            self._schedule_next(self.runs[parent_id], t)
        self.pending_roots[run.root_id] -= 1
        if self.pending_roots[run.root_id] == 0:
            self.num_live -= 1
            self._admit(t)


class _Replay(SessionDriver):
    """One policy's replay; `run()` returns its PolicyRun. Not reusable."""

    def __init__(self, workload: Workload, policy: str, config: ReplayConfig, on_request_done: Callable,
                 observer=None):
        self.workload, self.config = workload, config
        self.page_num_tokens = workload.page_num_tokens
        rules = config.rules(policy)
        model = get_model(config.model)
        self.cache = HybridPrefixCache(config.cache_config(workload.page_num_tokens, rules), rules)
        self.profile = engine_profile(rules, model, config.engine, workload.page_num_tokens, config.engine_name)
        misses = MissHistory(max_keys=None)  # the whole replay: no departure is forgotten
        recorder = MissRecorder(misses)
        self.cache.observer = recorder if observer is None else ObserverGroup(recorder, observer)
        self.observer = observer  # an explain.EvictionLog: the gate tells it which request each cache call serves
        self.gate = CacheGate(self.cache, self.profile, self._charge_writes, observer, misses=misses)
        self.engine = Engine(model, config.resolved_hardware(), self.profile.engine, config.step_cost, self.gate)
        self.policy = policy
        self.on_request_done = on_request_done
        self.arrivals: list = []  # heap of (time_s, seq, _SessionRun, Request)
        self.seq = 0
        self.runs: dict = {}
        self.children: dict = {}  # (session_id, spawn index) -> [child Session]
        self.pending_roots: dict = {}  # root id -> sessions of its tree not yet done
        self.in_flight: dict = {}  # uid -> (record, session run)
        self.records: list = []
        self.written = {Tier.CPU: 0, Tier.SSD: 0}
        self.queue = admission_order(workload, config)[::-1]  # pop() from the end = next in order
        self.num_live = 0

    def run(self) -> PolicyRun:
        t0 = time.perf_counter()
        for k in range(min(self.config.max_live_sessions, len(self.queue))):  # the staggered first wave
            self._admit_next(k * self.config.stagger_s)
        engine = self.engine
        while self.arrivals or engine.has_work():
            t_next = self.arrivals[0][0] if self.arrivals else math.inf
            events = engine.advance_until(t_next)
            if events:
                for ev in events:
                    if ev.kind is EventKind.FIRST_TOKEN:
                        self._on_first_token(ev.request_id, ev.time_s)
                    else:
                        self._on_finished(ev.request_id, ev.timing, ev.time_s)
                continue
            if not self.arrivals:
                break
            t, _, run, req = heapq.heappop(self.arrivals)
            self._on_arrival(run, req, t)
        stats = {"ssd": self.engine.ssd.stats, "h2d": self.engine.h2d.stats, "engine": self.engine.stats,
                 "admission": self.gate.stats, "scheduler": self.profile.name}
        if self.cache.state.tool_wait is not None:
            stats["tool_wait"] = self.cache.state.tool_wait.counts()
        return PolicyRun(self.policy, self.records, self.cache.stats, stats, time.perf_counter() - t0)

    # --- sessions (SessionDriver's hooks) ------------------------------------------------------

    @property
    def max_live_sessions(self) -> int:
        return self.config.max_live_sessions

    def _close_session(self, session_id: str, t: float) -> None:
        self.gate.close_session(session_id, t)  # session-referencing policies only (sessions.py)

    # --- requests ------------------------------------------------------------------------------

    def _on_arrival(self, run: _SessionRun, req, t: float) -> None:
        self.gate.register(req)
        self.in_flight[req.uid] = (RequestRecord(req.uid, req.session_id, int(req.flags), t, req.input_num_tokens,
                                                 0, 0, session_index=req.index), run)
        L = req.input_num_tokens
        self.engine.submit(EngineRequest(req.uid, L, L, req.output_num_tokens), t)

    def _on_first_token(self, uid, t: float) -> None:
        self.in_flight[uid][0].first_token_s = t

    def _on_finished(self, uid, timing, t: float) -> None:
        record, run = self.in_flight.pop(uid)
        match = self.gate.first_match(uid)  # what the request reused at its first admission
        record.matched_s = self.gate.first_match_s(uid)
        record.miss_tokens = dict(self.gate.first_misses(uid).tokens_by_reason)
        self.gate.finish(uid, timing.step_end_tokens, t)
        P = self.page_num_tokens
        record.kv_hit_tokens = match.num_kv_pages * P
        record.kv_held_tokens = match.held_kv_pages * P
        record.reused_tokens = min(match.num_reused_pages * P, record.input_tokens)
        record.restore_s = timing.restore_transfer_s
        record.completion_s = t
        self.records.append(record)
        self.on_request_done()
        self._advance(run, t)

    def _charge_writes(self, t: float) -> None:
        """Bytes the cache placed in CPU / SSD since the last call become background transfers
        (offload over D2H; SSD writes on the SSD channel). Promotions to GPU are charged as restores."""
        charge_cache_writes(self.cache, self.written, self.engine, t)


def charge_cache_writes(cache, written: dict, engine, t: float) -> None:
    """The CPU / SSD bytes `cache` wrote since `written` (per tier, updated) become background
    transfers on `engine`: offload over D2H, SSD writes on the SSD channel. Shared by the single-server
    and cluster replays, whose servers charge their own cache's writes."""
    by_tier = cache.stats.bytes_written_by_tier
    for tier, src in ((Tier.CPU, Tier.GPU), (Tier.SSD, Tier.CPU)):
        delta = by_tier.get(tier, 0) - written[tier]
        if delta:
            written[tier] += delta
            engine.submit_transfer(delta, int(src), int(tier), t)


def replay(workload: Workload, policy: str, config: ReplayConfig = ReplayConfig(),
           on_request_done: Callable = lambda: None, observer=None) -> PolicyRun:
    """One policy's replay. `observer`: an explain.EvictionLog recording why reuse was lost."""
    return _Replay(workload, policy, config, on_request_done, observer).run()


def replay_policies(workload: Workload, policies: Sequence[str], config: ReplayConfig = ReplayConfig(),
                    progress: bool = True, observers: Optional[dict] = None) -> dict:
    """Every policy on the same workload and admission order; a progress bar per policy.
    `observers`: policy name -> explain.EvictionLog for the policies being explained."""
    runs = {}
    observers = observers or {}
    num_requests = _num_admitted_requests(workload, config)
    for name in policies:
        bar = _progress_bar(num_requests, name) if progress else None
        runs[name] = replay(workload, name, config, bar.update if bar else (lambda: None), observers.get(name))
        if bar:
            bar.close()
    return runs


def admission_order(workload: Workload, config: ReplayConfig) -> list:
    """The root sessions a replay admits, in order: a seeded shuffle cut at `max_sessions`, the same
    for every policy (module docstring: sampling). Roots left empty by the clip are drawn but not
    returned: they would end the moment they are admitted."""
    return [root for root in sampled_roots(workload, config) if root is not None]


def sampled_roots(workload: Workload, config: ReplayConfig) -> list:
    """The drawn roots in admission order, None for a root the max-context rule emptied."""
    if config.session_sampling == "all" and workload.root_ids:
        kept = iter(workload.sessions)  # `sessions` follow `root_ids` order, minus the empty roots
        roots, pending = [], next(kept, None)
        for root_id in workload.root_ids:
            if pending is not None and pending.session_id == root_id:
                roots.append(pending)
                pending = next(kept, None)
            else:
                roots.append(None)
    else:
        roots = list(workload.sessions)
    random.Random(config.seed).shuffle(roots)
    return roots if config.max_sessions is None else roots[: config.max_sessions]


def _num_admitted_requests(workload: Workload, config: ReplayConfig) -> int:
    return sum(len(s.requests) for root in admission_order(workload, config) for s in root.iter_sessions())


def _progress_bar(total: int, name: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"{name:>16}", unit="req", leave=False, mininterval=0.5)
