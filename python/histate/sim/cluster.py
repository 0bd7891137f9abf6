"""Cluster mode of the replay (`histate replay --servers N`): N simulated servers, a router in front,
a shared L3 object store below every server's private SSD.

Each server is one engine exactly as the single-server replay builds it (replay.py): its own cache
of the same policy with the same GPU / CPU / SSD budgets, its own admission gate and GPU model. The
router (router.py) picks a server per request; the routing key is the request's root session id.
Load per server is constant: `max_live_sessions` root sessions per server are live, so the cluster
admits N x that many (the first wave is released N per `stagger_s`).

L3 (l3.py, link: l3_link.py). Only policies a real server can run against Mooncake get it:
  * `histate`: HiState's L3 layer; after a request it writes the terminal bundle that
    `histate.core.l3_policy.plan_l3_writes` plans (the same function the reference worker runs, and
    the rule the plugin applies to what HiState backs up);
  * `sglang-hicache`: stock HiCache with the Mooncake backend writes every node through to storage
    once its host backup is acknowledged (sglang/srt/mem_cache/unified_radix_cache.py:1803-1818
    `_finish_write_through_ack` -> `write_backup_storage`, :1990-2020, KV and the node's state
    sidecars together); here: every KV page of the request's inserted path and the state at every
    position the cache kept, minus objects the store already holds (HiCache asks storage which
    pages exist before writing).
What leaves L3 (`ClusterConfig.l3_ranking`): with "eq7" each `histate` server keeps a
ledger of its bundles (core/l3_ledger.py) and deletes, with its puts, the lowest eq. 7 ones beyond its
share of `l3_budget_ratio` x capacity; "lru" and stock leave it to the master's LRU (l3.py).
Every other policy runs without L3 in cluster mode. A server's puts are one background operation per
finished request on its L3 link; the objects become visible when that transfer ends. On admission,
after the local cache match, the server asks L3 for the longest restorable prefix (read rule,
`core.l3_policy.restorable_pages`); if it is longer than the local reuse, the pages beyond it and
the state at its end are read over the L3 link and H2D instead of being recomputed (engine.py).

Failure (`fail_server=(K, T)`, or `fail_after_requests=(K, N)`: at the completion of the N-th
request cluster-wide, as `histate cluster` SIGKILLs its worker from the bench's on_record callback
once that many records are in, python/histate/cluster/run.py): at simulated time T server K disappears with its private tiers; its
requests in flight are lost and retried at T on the server the router now picks (TTFT still counts
from the original arrival); its L3 puts still in transfer are lost; its sessions move with their
routing keys. The root sessions that were mapped to K are "moved"; the first request of each after T
is reported (`ClusterRun.first_after_move_uids`).

Simulated time across engines: the driver only lets an engine run up to the earliest time another
engine or an arrival could next produce an event (`next_event_time` is a lower bound), so events
come out in global time order; N = 1 reduces to exactly replay.py's loop (same calls, same order),
which the tests check request by request.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional

from ..core import (HybridPrefixCache, L3Ledger, L3LedgerConfig, L3WriteConfig, MissHistory, MissRecorder, Tier,
                    attribute_misses, fleet_share_bytes, plan_l3_writes)
from .admission import CacheGate, engine_profile
from .costs import get_model
from .engine import Engine, EngineRequest, EventKind
from .l3 import KV, STATE, L3Store, L3StoreConfig
from .l3_link import FLEET_L3_LINK, L3LinkSpec
from .metrics import RequestRecord
from .replay import ReplayConfig, SessionDriver, _SessionRun, admission_order, charge_cache_writes
from .request import Workload
from .router import make_router

L3_WRITE_RULES = {"histate": "terminal-bundle", "sglang-hicache": "write-through"}
"""Policies that get the shared L3 in cluster mode, and how each writes it (module docstring)."""
L3_RANKINGS = ("eq7", "lru")
"""What leaves L3 for a terminal-bundle writer: "eq7", its own ledger's deletes within its share of
`l3_budget_ratio` x capacity (core/l3_ledger.py), with the master's LRU as the backstop; "lru", the
master's LRU alone. Stock write-through always gets the master's LRU alone (stock SGLang deletes nothing)."""
DEFAULT_L3_BUDGET_RATIO = 0.85
"""The fleet's L3 budget as a share of the store's capacity: below the master's high watermark (0.90),
so the servers' own deletes keep it from firing; the margin absorbs puts still in transfer and the
objects of servers that died."""


@dataclass(frozen=True)
class ClusterConfig:
    num_servers: int = 1
    router: str = "manual"
    l3_store: L3StoreConfig = field(default_factory=lambda: L3StoreConfig(0))
    l3_link: L3LinkSpec = FLEET_L3_LINK
    l3_write: L3WriteConfig = field(default_factory=L3WriteConfig)
    l3_ranking: str = "lru"
    """L3_RANKINGS. "lru" by default: what `histate serve` and the plugin run unless given a ledger (and
    what the loopback twin, cluster/sim_twin.py, must reproduce); benchmark/scaleout.py runs both."""
    l3_budget_ratio: float = DEFAULT_L3_BUDGET_RATIO
    fail_server: Optional[tuple] = None   # (server index, simulated time s)
    fail_after_requests: Optional[tuple] = None   # (server index, completed requests cluster-wide)
    placement: Optional[Mapping] = None   # router "fixed": routing key -> server(s) (router.py)
    request_placement: Optional[Mapping] = None  # router "fixed": request uid -> server (router.py)
    earliest_arrival_s: Optional[Mapping] = None  # request uid -> no arrival before this (a live run's
    #   send times: a request the live client resent after a kill arrives then, not when its session's
    #   previous request finished; cluster/sim_twin.py)
    max_live_sessions_total: Optional[int] = None
    """Live root sessions of the whole fleet; None: `max_live_sessions` per server. `histate cluster`
    admits through one bench client, so its limit is the fleet's (bench/sessions.py `_admit_all`)."""

    def __post_init__(self) -> None:
        if self.l3_ranking not in L3_RANKINGS:
            raise ValueError(f"l3_ranking must be one of {L3_RANKINGS}, got {self.l3_ranking!r}")
        if not 0 < self.l3_budget_ratio <= 1:
            raise ValueError(f"l3_budget_ratio must be in (0, 1], got {self.l3_budget_ratio}")
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.fail_server is not None and self.fail_after_requests is not None:
            raise ValueError("fail_server and fail_after_requests: one failure at most")
        if self.fail_after_requests is not None:
            k, n = self.fail_after_requests
            if not 0 <= k < self.num_servers or n < 1:
                raise ValueError(f"fail_after_requests ({k}, {n}): need 0 <= K < {self.num_servers} and N >= 1")
            if self.num_servers < 2:
                raise ValueError("fail_after_requests needs at least 2 servers (the sessions must move somewhere)")
        if self.max_live_sessions_total is not None and self.max_live_sessions_total < 1:
            raise ValueError(f"max_live_sessions_total must be >= 1, got {self.max_live_sessions_total}")
        if self.fail_server is not None:
            k, t = self.fail_server
            if not 0 <= k < self.num_servers or not (t >= 0 and math.isfinite(t)):
                raise ValueError(f"fail_server {k}@{t}: need 0 <= K < {self.num_servers} and a finite T >= 0")
            if self.num_servers < 2:
                raise ValueError("fail_server needs at least 2 servers (the sessions must move somewhere)")

    @property
    def has_l3(self) -> bool:
        return self.l3_store.capacity_bytes > 0


@dataclass
class ServerStats:
    index: int
    requests: int = 0
    input_tokens: int = 0
    reused_tokens: int = 0
    l3_hit_tokens: int = 0
    failed_at_s: Optional[float] = None
    engine: object = None
    l3_link: object = None


@dataclass
class ClusterRun:
    """A cluster replay: the per-request records (cluster-wide) plus what only a cluster has."""

    policy: str
    records: list
    servers: list                   # ServerStats per server
    server_of_uid: dict             # uid -> server that served it (last one, after a retry)
    l3_hit_tokens_by_uid: dict      # uid -> tokens restored from L3 (beyond the local match)
    retried_uids: list              # lost with a failed server, served again elsewhere
    moved_roots: list               # root sessions mapped to the failed server at the failure
    first_after_move_uids: list     # the first request of each moved root after the failure
    l3_stats: object = None         # l3.L3Stats, None without L3
    has_l3: bool = False
    wall_s: float = 0.0


class _L3Gate(CacheGate):
    """A server's gate with the L3 read path: after the local match, restore a longer prefix from L3."""

    def __init__(self, *args, l3_lookup: Optional[Callable] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.l3_lookup = l3_lookup     # (keys, local pages, now_s) -> (pages, bytes) or None
        self.l3_pages: dict = {}       # uid -> pages restored from L3 at first admission

    def admit(self, req: EngineRequest, context_num_tokens: int, now_s: float, idle: bool):
        admitted = super().admit(req, context_num_tokens, now_s, idle)
        if admitted is None or self.l3_lookup is None:
            return admitted
        held = self.held[req.request_id]
        P = self.page_num_tokens
        local_pages = held.lease.match.num_reused_pages
        keys = held.request.keys_through(self.match_pages(context_num_tokens))
        found = self.l3_lookup(keys, local_pages, now_s)
        if found is None:
            self.l3_pages.setdefault(req.request_id, 0)
            return admitted
        pages, size_bytes = found
        if req.request_id not in self.l3_pages and held.misses is not None:
            # first admission: the L3 pages are reused too; the reasons cover what is left (core/misses.py)
            match = held.lease.match
            kv_pages = max(match.num_kv_pages, pages)
            held_kv = max(match.held_kv_pages, kv_pages)
            held.misses = attribute_misses(keys, context_num_tokens, P, kv_pages, pages, self.misses, held_kv)
        self.l3_pages.setdefault(req.request_id, pages - local_pages)
        return replace(admitted, num_compute_tokens=context_num_tokens - pages * P, l3_restore_bytes=size_bytes)


class _Server:
    """One simulated engine: cache, gate and GPU model exactly as replay._Replay builds them."""

    def __init__(self, index: int, workload: Workload, policy: str, config: ReplayConfig, cluster: "_ClusterReplay",
                 l3_rule: Optional[str]) -> None:
        self.index = index
        rules = config.rules(policy, has_l3=l3_rule is not None)
        model = get_model(config.model)
        self.cache = HybridPrefixCache(config.cache_config(workload.page_num_tokens, rules), rules)
        misses = MissHistory(max_keys=None)  # why requests missed (core/misses.py), as replay._Replay
        self.cache.observer = MissRecorder(misses)
        self.profile = engine_profile(rules, model, config.engine, workload.page_num_tokens, config.engine_name)
        self.l3_rule = l3_rule
        self.cluster = cluster
        self.gate = _L3Gate(self.cache, self.profile, self._charge_writes, None,
                            on_finish_insert=self._write_l3 if l3_rule else None,
                            l3_lookup=self._read_l3 if l3_rule else None, misses=misses)
        self.engine = Engine(model, config.resolved_hardware(), self.profile.engine, config.step_cost, self.gate,
                             l3_link=cluster.cluster.l3_link if l3_rule else None)
        self.written = {Tier.CPU: 0, Tier.SSD: 0}
        self.in_flight: dict = {}    # uid -> (record, session run)
        self.is_alive = True
        self.l3_written_kv: set = set()     # page keys this server put (a hint, core/l3_policy.py)
        self.l3_written_state: set = set()
        self.l3_visible_s: dict = {}        # (KV|STATE, page key) -> when this server's put of it lands
        self.kv_page_bytes = workload.page_num_tokens * self.cache.config.kv_bytes_per_token
        self.state_bytes = self.cache.config.checkpoint_size_bytes
        self.stats = ServerStats(index)
        cc = cluster.cluster
        self.ledger = (L3Ledger(L3LedgerConfig(
            fleet_share_bytes(int(cc.l3_budget_ratio * cc.l3_store.capacity_bytes), cc.num_servers),
            workload.page_num_tokens, self.kv_page_bytes, self.state_bytes, self.cache.config.tau_s))
            if l3_rule == "terminal-bundle" and cc.l3_ranking == "eq7" else None)

    def _charge_writes(self, t: float) -> None:
        """CPU / SSD bytes this server's cache wrote become background transfers (replay.py)."""
        charge_cache_writes(self.cache, self.written, self.engine, t)

    # --- L3 -----------------------------------------------------------------------------------------
    def _read_l3(self, keys: tuple, local_pages: int, now_s: float) -> Optional[tuple]:
        store = self.cluster.l3_at(now_s)
        pages = store.restorable_pages(keys, held_pages=local_pages)
        kv_whole = True
        for k in keys[pages:]:            # forget puts the master evicted (core/l3_policy.py: a hint)
            if (KV, k) not in store.objects:
                self.l3_written_kv.discard(k)
                kv_whole = False
            if (STATE, k) not in store.objects:
                self.l3_written_state.discard(k)
            if self.ledger is not None and k in self.ledger and (not kv_whole or (STATE, k) not in store.objects):
                self.ledger.forget(k)     # no longer whole: the master evicted part of it
        if pages <= local_pages:
            return None
        if self.ledger is not None:      # the bundle read is this server's now (an agreed event)
            self.ledger.record(keys[:pages], now_s)
        return pages, store.get(keys, pages, now_s, first_page=local_pages)

    def _confirmed(self, kind: str, key, now_s: float) -> bool:
        """This server put `(kind, key)` and the store still lists it (or the put is still in transfer)."""
        written = self.l3_written_kv if kind == KV else self.l3_written_state
        if key not in written:
            return False
        if self.l3_visible_s.get((kind, key), -math.inf) > now_s or self.cluster.store.contains((kind, key)):
            return True
        written.discard(key)
        return False

    def _write_l3(self, request, keys: tuple, state_pages, now_s: float) -> None:
        """The finished request's pages entered the cache: submit its L3 puts (module docstring)."""
        store = self.cluster.l3_at(now_s)
        num_pages = len(keys)
        objects = []   # (key, size_bytes, group, soft_pin, replicas)
        if self.l3_rule == "terminal-bundle":
            # the hints are confirmed against what the master lists (reference/l3_tier.py
            # `_confirm_written`): a bundle's leading pages, written once and never read back by this
            # server (it holds them), are the first the master's LRU drops, and a stale hint would
            # never re-put them, breaking every later bundle of the session
            puts = plan_l3_writes(num_pages, state_pages, lambda i: self._confirmed(KV, keys[i], now_s), 0,
                                  self.cluster.cluster.l3_write, lambda i: self._confirmed(STATE, keys[i], now_s))
            for put in puts:
                group = keys[put.group_id_page]
                objects.append(((KV, keys[put.page_index]), self.kv_page_bytes, group, put.soft_pin, put.replicas))
                if put.with_state:
                    objects.append(((STATE, keys[put.page_index]), self.state_bytes, group, put.soft_pin,
                                    put.replicas))
        else:  # write-through: every page not in the store, and every kept state
            for i in range(num_pages):
                if not store.contains((KV, keys[i])):
                    objects.append(((KV, keys[i]), self.kv_page_bytes, keys[i], False, 1))
            for d in sorted(set(state_pages)):
                if 0 < d <= num_pages and not store.contains((STATE, keys[d - 1])):
                    objects.append(((STATE, keys[d - 1]), self.state_bytes, keys[d - 1], False, 1))
        deletes = []
        depths = [d for d in state_pages if 0 < d <= num_pages]
        if self.ledger is not None and depths:
            terminal = max(depths)     # the bundle plan_l3_writes wrote, or found already in L3
            self.ledger.record(keys[:terminal], now_s)
            planned = self.ledger.plan_deletes(protect=keys[terminal - 1])
            deletes = [(KV, k) for k in planned.kv_keys] + [(STATE, k) for k in planned.state_keys]
            for kind, k in deletes:
                (self.l3_written_kv if kind == KV else self.l3_written_state).discard(k)
        if not objects and not deletes:
            return
        size_bytes = sum(size * replicas for _, size, _, _, replicas in objects)
        visible_s = self.engine.submit_l3_put(size_bytes, 1, now_s)
        for (kind, k), *_ in objects:
            (self.l3_written_kv if kind == KV else self.l3_written_state).add(k)
            self.l3_visible_s[kind, k] = visible_s
        self.cluster.schedule_l3_puts(visible_s, self.index, objects, deletes)


@dataclass
class _Retry:
    """A request lost with a failed server, resubmitted elsewhere."""

    run: _SessionRun
    request: object


class _ClusterReplay(SessionDriver):
    """One policy's cluster replay; `run()` returns a ClusterRun. Not reusable."""

    def __init__(self, workload: Workload, policy: str, config: ReplayConfig, cluster: ClusterConfig,
                 on_request_done: Callable = lambda: None) -> None:
        self.workload, self.config, self.cluster, self.policy = workload, config, cluster, policy
        self.page_num_tokens = workload.page_num_tokens
        self.on_request_done = on_request_done
        l3_rule = L3_WRITE_RULES.get(policy) if cluster.has_l3 else None
        self.store = L3Store(cluster.l3_store) if l3_rule else None
        self.pending_puts: list = []  # heap of (visible_s, seq, server index, objects)
        self.servers = [_Server(i, workload, policy, config, self, l3_rule) for i in range(cluster.num_servers)]
        self.router = make_router(cluster.router, cluster.num_servers, config.seed, cluster.placement,
                                  cluster.request_placement)
        self.max_live = cluster.max_live_sessions_total or config.max_live_sessions * cluster.num_servers
        self.arrivals: list = []   # heap of (time_s, seq, _SessionRun, Request)
        self.seq = 0
        self.runs: dict = {}
        self.children: dict = {}
        self.pending_roots: dict = {}
        self.records: list = []
        self.server_of_uid: dict = {}
        self.last_server_of_root: dict = {}
        self.retried: list = []
        self.moved_roots: list = []
        self.awaiting_first_after_move: set = set()
        self.first_after_move: list = []
        self._l3_hits: dict = {}
        self.failure = cluster.fail_server
        self.fail_after_requests = cluster.fail_after_requests
        self.num_completed = 0
        self.queue = admission_order(workload, config)[::-1]
        self.num_live = 0

    # --- L3 ------------------------------------------------------------------------------------------
    def l3_at(self, now_s: float) -> L3Store:
        """The store with every put visible by `now_s` applied (in visibility order)."""
        pending = self.pending_puts
        while pending and pending[0][0] <= now_s:
            visible_s, _, _, objects, deletes = heapq.heappop(pending)
            for key in deletes:   # the writer's own deletes first: they make the room its puts take
                self.store.remove(key, visible_s)
            for key, size, group, pin, replicas in objects:
                self.store.put(key, size, visible_s, group=group, soft_pin=pin, replicas=replicas)
        return self.store

    def schedule_l3_puts(self, visible_s: float, server: int, objects: list, deletes=()) -> None:
        """`objects` become visible at `visible_s`, after `deletes` (the writer's ledger, core/l3_ledger.py)
        are removed."""
        self.seq += 1
        heapq.heappush(self.pending_puts, (visible_s, self.seq, server, objects, tuple(deletes)))

    # --- the event loop ------------------------------------------------------------------------------
    def run(self) -> ClusterRun:
        t0 = time.perf_counter()
        per_wave = self.cluster.num_servers
        for k in range(min(self.max_live, len(self.queue))):  # the staggered first wave, N per step
            self._admit_next((k // per_wave) * self.config.stagger_s)
        while True:
            t_ext = self.arrivals[0][0] if self.arrivals else math.inf
            if self.failure is not None:
                t_ext = min(t_ext, self.failure[1])
            live = [s for s in self.servers if s.is_alive]
            # (lower bound on the engine's next event, its events come strictly later, index)
            bounds = [(s.engine.next_event_time(), not s.engine.has_pending_events, s.index) for s in live]
            lb, strict, index = min(bounds) if bounds else (math.inf, True, -1)
            if lb == math.inf and t_ext == math.inf:
                break
            if lb > t_ext or (lb == t_ext and strict):
                self._external(t_ext)
                continue
            horizon = min([t_ext] + [b[0] for b in bounds if b[2] != index])
            if horizon <= lb and strict:
                horizon = math.nextafter(lb, math.inf)  # strict ties: start the steps at lb (no event at lb)
            server = self.servers[index]
            for ev in server.engine.advance_until(horizon):
                if ev.kind is EventKind.FIRST_TOKEN:
                    server.in_flight[ev.request_id][0].first_token_s = ev.time_s
                else:
                    self._on_finished(server, ev.request_id, ev.timing, ev.time_s)
        return self._result(time.perf_counter() - t0)

    def _external(self, t: float) -> None:
        """The next arrival or the failure, whichever is first (the failure first on a tie)."""
        if self.failure is not None and self.failure[1] <= (self.arrivals[0][0] if self.arrivals else math.inf):
            self._fail(self.failure[0], t)
            self.failure = None
            return
        t, _, run, req = heapq.heappop(self.arrivals)
        record = RequestRecord(req.uid, req.session_id, int(req.flags), t, req.input_num_tokens, 0, 0,
                               session_index=req.index)
        self._submit(run, req, record, t)

    def _submit(self, run: _SessionRun, req, record: RequestRecord, t: float) -> None:
        loads = [len(s.in_flight) if s.is_alive else 0 for s in self.servers]
        index = self.router.route(run.root_id, req.page_keys, loads, uid=req.uid)
        server = self.servers[index]
        self.server_of_uid[req.uid] = index
        self.last_server_of_root[run.root_id] = index
        if run.root_id in self.awaiting_first_after_move:
            self.awaiting_first_after_move.discard(run.root_id)
            self.first_after_move.append(req.uid)
        server.gate.register(req)
        server.in_flight[req.uid] = (record, run)
        L = req.input_num_tokens
        server.engine.advance_until(t)  # nothing happens before t (the loop guarantees it): aligns the clock
        server.engine.submit(EngineRequest(req.uid, L, L, req.output_num_tokens), t)

    def _fail(self, index: int, t: float) -> None:
        server = self.servers[index]
        server.is_alive = False
        server.stats.failed_at_s = t
        owned = [r for r, s in self.last_server_of_root.items() if s == index and r in self.pending_roots
                 and self.pending_roots[r] > 0]
        self.moved_roots = sorted(owned)
        self.awaiting_first_after_move = set(owned)
        self.router.remove(index)
        if self.store is not None:
            self.l3_at(t)   # puts visible by t survive the server (applied lazily otherwise)
        self.pending_puts = [p for p in self.pending_puts if p[2] != index]   # lost with the server
        heapq.heapify(self.pending_puts)
        lost = sorted(server.in_flight.items())
        server.in_flight = {}
        for uid, (record, run) in lost:
            record.first_token_s = math.nan   # the stream broke: the client waits for a new first token
            self.retried.append(uid)
            self._submit(run, run.session.requests[run.next_index], record, t)

    # --- sessions (SessionDriver's hooks) ------------------------------------------------------------
    @property
    def max_live_sessions(self) -> int:
        return self.max_live

    def _earliest_arrival_s(self, uid) -> float:
        floors = self.cluster.earliest_arrival_s
        return floors.get(uid, 0.0) if floors else 0.0

    def _close_session(self, session_id: str, t: float) -> None:
        for server in self.servers:   # the session's references, wherever its requests ran
            if server.is_alive:
                server.gate.close_session(session_id, t)

    def _on_finished(self, server: _Server, uid, timing, t: float) -> None:
        record, run = server.in_flight.pop(uid)
        match = server.gate.first_match(uid)
        record.matched_s = server.gate.first_match_s(uid)
        misses = server.gate.first_misses(uid)
        record.miss_tokens = None if misses is None else dict(misses.tokens_by_reason)
        server.gate.finish(uid, timing.step_end_tokens, t)
        P = self.page_num_tokens
        l3_pages = server.gate.l3_pages.pop(uid, 0)
        local_pages = match.num_reused_pages
        record.kv_hit_tokens = max(match.num_kv_pages, local_pages + l3_pages) * P
        record.reused_tokens = min((local_pages + l3_pages) * P, record.input_tokens)
        record.restore_s = timing.restore_transfer_s
        record.completion_s = t
        self.records.append(record)
        self._l3_hits[uid] = min(l3_pages * P, record.input_tokens)
        stats = server.stats
        stats.requests += 1
        stats.input_tokens += record.input_tokens
        stats.reused_tokens += record.reused_tokens
        stats.l3_hit_tokens += self._l3_hits[uid]
        self.on_request_done()
        self.num_completed += 1
        if self.fail_after_requests is not None and self.num_completed == self.fail_after_requests[1]:
            # the failure at this completion's time; the loop runs it before anything later, and
            # before this session's next arrival even at gap 0 (the kill precedes the next send live)
            self.failure, self.fail_after_requests = (self.fail_after_requests[0], t), None
        self._advance(run, t)

    def _result(self, wall_s: float) -> ClusterRun:
        for s in self.servers:
            s.stats.engine = s.engine.stats
            s.stats.l3_link = s.engine.l3.stats if s.engine.l3 is not None else None
        return ClusterRun(self.policy, self.records, [s.stats for s in self.servers], self.server_of_uid,
                          self._l3_hits, self.retried, self.moved_roots, self.first_after_move,
                          self.store.stats if self.store is not None else None, self.store is not None, wall_s)


def replay_cluster(workload: Workload, policy: str, config: ReplayConfig = ReplayConfig(),
                   cluster: ClusterConfig = ClusterConfig(), on_request_done: Callable = lambda: None) -> ClusterRun:
    """One policy's cluster replay (module docstring)."""
    return _ClusterReplay(workload, policy, config, cluster, on_request_done).run()
