"""Discrete-event model of one GPU serving requests: restores, continuous batching, chunked prefill.

Owns simulated time on the device side. The replay driver submits requests at their arrival and
background data movements (offload, checkpoint writes) when the cache decides them; the engine
advances step by step and reports, per request, the time of its first output token (TTFT =
restore + queueing + recompute, including head-of-line blocking behind other prefills) and of its
last one.

Driver contract (times in seconds, monotone):

    engine.submit(EngineRequest(...), now_s)          # cache.begin_request(...) just before
    events = engine.advance_until(t_s)
    # -> the events of the earliest time tau <= t_s at which any occur (engine.now_s = tau),
    #    or [] with engine.now_s = t_s when none occur before t_s.
    for ev in events:
        if ev.kind is EventKind.FIRST_TOKEN: cache.finish_request(...)     # prefill complete
        if ev.kind is EventKind.FINISHED:    schedule the session's next request

A loop `t = next arrival; events = advance_until(t); handle events or, when empty, submit the
arrival` therefore interleaves cache operations with device time in the right order. A step that
starts before t_s may end after it; its events come out of a later call, and requests submitted
meanwhile wait for the next step (they cannot join a step already running).

Model:
* Restore. The request's KV and checkpoint bytes on CPU cross the H2D link; bytes on SSD are read
  by the SSD and then cross H2D too (paper eq. 2 per item). Links are FIFO servers; the CPU part of
  a restore overlaps the SSD read of its other part. Background transfers (`submit_transfer`) use
  the same links at lower priority, in `io_unit_bytes` units that a restore cannot preempt: a
  restore waits for at most the unit in flight, so checkpoint and KV writes to SSD slow restores
  down without starving them. `layerwise_load` (SGLang): the host-to-device part overlaps the
  forward layer by layer instead of preceding it. SGLang's HiCache issues a batch's load-back when the
  batch launches and each layer of the forward waits for that layer's copy only
  (managers/cache_controller.py:1028-1069 `start_loading`, per-layer `on_layer_done` events;
  mem_cache/memory_pool.py:1675-1725 `layer_transfer_counter.wait_until(layer_id)` for KV and mamba
  layers). So the request joins the prefill queue once its bytes are in host memory (SSD reads done),
  and the first step it runs in ends no earlier than its load's last layer plus one layer of compute,
  nor earlier than its first layer's load plus the whole step (`_layerwise_end`): a load longer than
  the step's compute stretches that step for everyone in it, as the batch's forward waits. vLLM's
  connector loads before the request is scheduled (its KV arrives first), the default here.
* Compute. Continuous batching with a token budget per forward step (`token_budget_per_step`:
  SGLang's `--chunked-prefill-size`, 8192 on H100/H200, sglang/srt/arg_groups/memory_hook.py).
  `mixed_batches=True` (vLLM V1; SGLang `--enable-mixed-chunk`): every running decode contributes
  one token, the rest of the budget goes to waiting prefills in FIFO order (the last one chunked).
  `mixed_batches=False` (SGLang's default): prefill steps run alone and decode waits. The first
  output token is sampled at the end of the step that finishes the prefill. At least one token
  is always computed (a full hit still runs the last token to get logits).
* Sharing a step with a long prefill. `short_prefill_first` (SGLang-served policies; HiState's
  `--histate-short-prefill-first`, core/prefill_order.py) caps the chunk of the prefill in progress at
  the head of the queue so the short ones behind it run in the same step, with aging.
  `long_prefill_token_threshold` (vLLM's `--long-prefill-token-threshold`: `Scheduler.schedule` caps
  `num_new_tokens` of running and waiting requests alike, vllm/v1/core/sched/scheduler.py) gives every
  prefill at most that many tokens per step, so the rest of the budget reaches the requests behind it.
* Decode-only stretches are fast-forwarded in closed form (step time is linear in the step index
  while the batch is fixed), so a replay costs O(prefill steps + requests), not O(output tokens).
* Memory. A request waits in FIFO order until a `MemoryGate` admits it (at its arrival when nobody
  waits ahead of it, else at the next step start); admission is where the cache is matched and
  pinned and where the request's memory is promised, so a request that does not fit next to the
  running ones and the pinned cache waits (head-of-line, as SGLang's `PrefillAdder` returns NO_TOKEN
  and vLLM's waiting loop breaks). Its restore starts at admission. Running requests may ask for
  more memory as they compute (`MemoryGate.grow`, vLLM's per-step block allocation); when that fails
  the most recently admitted running request is preempted and recomputed later (vLLM's
  `Scheduler.schedule`: `self.running.pop()`, `_preempt_request`), the request itself last. The
  default gate admits everything at once (unbounded memory).
* Chunk rules (`EngineConfig.chunk_rule`): "vllm" ends every prefill step that is not the last on a
  block boundary and forces a step end at the last block boundary of the prompt (align mode,
  `Scheduler._mamba_block_aligned_split`); a step too small for one block skips the request.
  "vllm-internal" is the same without the forced split: the last boundary's state is read out inside
  the final forward (internal prefill checkpoints, vllm-project/vllm#52789). "grid"
  floors a cut chunk (not the last one) to the block grid unless that empties it (HiState in SGLang:
  `core.capture.floor_cut`, sglang_plugin/chunking.py), so every pass starts on the state grid. The
  engine reports every request's prefill step ends (`RequestTiming.step_end_tokens`): engines that
  keep one recurrent state per forward pass place their states there.
"""
from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional

from ..core import DEFAULT_CHUNK_PAGES, STATE_GRID_TOKENS, ShortPrefillFirst, floor_cut, prefill_work_tokens
from .costs import CPU_TIER, GPU_TIER, SSD_TIER, HardwareSpec, ModelSpec, PrefillChunk, RooflineStepCost


CHUNK_RULES = ("none", "vllm", "vllm-internal", "grid")


@dataclass(frozen=True)
class EngineConfig:
    token_budget_per_step: int = DEFAULT_CHUNK_PAGES * STATE_GRID_TOKENS  # chunked prefill size / max batched tokens per step (8192)
    mixed_batches: bool = True            # decode tokens and prefill chunks share a step
    max_running_requests: int = 256       # admitted requests (SGLang/vLLM max batch; rarely binding)
    io_unit_bytes: int = 64 * 2**20       # background transfer granularity (non-preemptible)
    chunk_rule: str = "none"              # "vllm": align-mode step ends; "grid": cuts floored (module docstring)
    block_num_tokens: int = 1             # the "vllm" rule's block; the "grid" rule's grid
    short_prefill_first: Optional[ShortPrefillFirst] = None  # cap a continuing chunk for short prefills (docstring)
    long_prefill_token_threshold: int = 0  # vLLM: at most this many tokens per request per step (0: off; docstring)
    sglang_mixed_chunk: bool = False      # SGLang --enable-mixed-chunk: its policies get mixed_batches (admission.py)
    page_tokens: int = 1                  # SGLang's --page-size (1 for Qwen3.5 off SM100): charges short_prefill_first
    layerwise_load: bool = False          # SGLang: host-to-device restores overlap the forward per layer (docstring)
    caches_outputs: bool = True           # a finished request's output KV/states enter the cache (every real
    #   engine); False models `histate serve`, whose greedy output never matches the next prompt (bench
    #   prompts come from the trace's hash ids), so nothing past the prompt can be reused there
    matches_last_prompt_token: bool = True  # False: a prompt of L tokens is matched and cached over its
    #   first L-1 tokens, (L-1) // page pages, not L // page: `histate serve` keys `page_keys(token_ids[:-1])`
    #   (reference/executor.py `serve`), so the last token is always prefilled for the logits that start
    #   the decode; a page-aligned prompt then leaves its last page uncached

    def __post_init__(self) -> None:
        if (self.token_budget_per_step < 1 or self.max_running_requests < 1 or self.io_unit_bytes < 1
                or self.block_num_tokens < 1 or self.long_prefill_token_threshold < 0 or self.page_tokens < 1):
            raise ValueError(f"EngineConfig values must be positive: {self}")
        if self.chunk_rule not in CHUNK_RULES:
            raise ValueError(f"EngineConfig.chunk_rule {self.chunk_rule!r} not in {CHUNK_RULES}")


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the driver knows about a request once the cache has matched it.

    `context_num_tokens` is the prompt length L; `num_compute_tokens` = L - c (c reused tokens).
    Restore sizes come from `MatchResult.kv_bytes_by_tier` / `checkpoint_tier` / `checkpoint_size_bytes`
    (tiers as ints or `histate.core.Tier`; GPU-resident bytes cost nothing).
    """

    request_id: Hashable
    num_compute_tokens: int
    context_num_tokens: int
    output_num_tokens: int
    kv_restore_bytes_by_tier: Mapping = field(default_factory=dict)
    checkpoint_restore_bytes: int = 0
    checkpoint_tier: Optional[int] = None
    l3_restore_bytes: int = 0  # cluster mode: KV pages + state read from the shared L3 store (sim/l3.py)


@dataclass(slots=True)
class RequestTiming:
    """Per-request timeline, filled in as the request progresses (seconds, simulated clock)."""

    request_id: Hashable
    arrival_s: float
    restore_done_s: float = math.nan   # set at admission (the last one, after a preemption)
    restore_transfer_s: float = 0.0    # eq. 2 time of its own bytes, without waiting for the links
    num_compute_tokens: int = 0        # of its first admission
    prefill_start_s: Optional[float] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    admitted_s: Optional[float] = None  # first admission (memory promised, restore started)
    step_end_tokens: list = field(default_factory=list)  # prefill step ends of its last admission
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def restore_s(self) -> float:
        """Arrival to data resident on GPU (transfer plus waiting for busy links)."""
        return self.restore_done_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        """Data resident to the first step that computes this request (negative when that step started
        while its layers were still arriving: `layerwise_load`)."""
        return self.prefill_start_s - self.restore_done_s

    @property
    def prefill_s(self) -> float:
        """First to last prefill step, including steps shared with (or waiting behind) others."""
        return self.first_token_s - self.prefill_start_s


class EventKind(enum.Enum):
    FIRST_TOKEN = "first_token"   # prefill complete: the cache can insert the prompt's pages
    FINISHED = "finished"         # last output token produced


@dataclass(frozen=True, slots=True)
class EngineEvent:
    kind: EventKind
    time_s: float
    request_id: Hashable
    timing: RequestTiming


@dataclass(slots=True)
class ChannelStats:
    foreground_bytes: float = 0.0
    foreground_busy_s: float = 0.0
    background_bytes: float = 0.0
    background_busy_s: float = 0.0
    foreground_wait_s: float = 0.0       # waiting for earlier work (foreground or a background unit)
    waited_on_background_s: float = 0.0  # part of that wait caused by background units in flight
    max_backlog_s: float = 0.0


class Channel:
    """A link (H2D, D2H) or device (SSD) serving foreground work FIFO and background work in the gaps.

    Background work runs whenever no foreground work is queued, in units of `unit_s` seconds that
    foreground work cannot preempt. Computed lazily in O(1) per call; no events are scheduled.
    """

    __slots__ = ("name", "unit_s", "_free_at", "_backlog_s", "stats")

    def __init__(self, name: str, unit_s: float) -> None:
        self.name, self.unit_s = name, unit_s
        self._free_at = 0.0      # end of committed work; background (if any) drains from here on
        self._backlog_s = 0.0
        self.stats = ChannelStats()

    def _drain(self, t: float) -> None:
        """Commit the background work done by `t`, including the unit in flight at `t`."""
        if self._backlog_s <= 0 or t <= self._free_at:
            return
        elapsed = t - self._free_at
        if elapsed >= self._backlog_s:
            self._free_at += self._backlog_s
            self._backlog_s = 0.0
            return
        committed = min(self._backlog_s, math.ceil(elapsed / self.unit_s) * self.unit_s)
        self._free_at += committed
        self._backlog_s -= committed

    def reserve(self, duration_s: float, size_bytes: float, t: float) -> float:
        """Foreground work arriving at `t`; returns its completion time."""
        if duration_s <= 0:
            return t
        before = self._free_at
        self._drain(t)
        start = max(t, self._free_at)
        self.stats.foreground_wait_s += start - t
        self.stats.waited_on_background_s += max(0.0, min(start, self._free_at) - max(t, before))
        self._free_at = start + duration_s
        self.stats.foreground_bytes += size_bytes
        self.stats.foreground_busy_s += duration_s
        return self._free_at

    def add_background(self, duration_s: float, size_bytes: float, t: float) -> None:
        if duration_s <= 0:
            return
        self._drain(t)
        if self._backlog_s <= 0 and self._free_at < t:
            self._free_at = t       # idle link: background starts now
        self._backlog_s += duration_s
        self.stats.background_bytes += size_bytes
        self.stats.background_busy_s += duration_s
        self.stats.max_backlog_s = max(self.stats.max_backlog_s, self._backlog_s)

    def background_done_s(self, t: float) -> float:
        """When the background work queued at `t` ends if no foreground work arrives meanwhile."""
        self._drain(t)
        return max(t, self._free_at) + self._backlog_s

    def backlog_s(self, t: float) -> float:
        """Background seconds still queued at `t` (committed units in flight excluded)."""
        self._drain(t)
        return self._backlog_s


class MemoryGate:
    """Where the engine asks for memory (module docstring). This default is unbounded memory: every
    request is admitted at once with the match it was submitted with and never grows."""

    def admit(self, req: "EngineRequest", context_num_tokens: int, now_s: float,
              idle: bool) -> Optional["EngineRequest"]:
        """Admit `req` to compute up to `context_num_tokens` (its prompt; after a preemption also its
        output so far): the request with its match (compute tokens, restore sizes), or None to keep
        it waiting. `idle`: nothing else holds memory, so the gate must admit (over-committing if the
        request can never fit)."""
        return req

    def grow(self, request_id: Hashable, num_tokens: int, now_s: float, force: bool) -> bool:
        """A running request needs memory for `num_tokens` tokens of KV in all (vLLM allocates per
        step); False if it cannot get it now. `force`: it runs alone, so it must get it."""
        return True

    def preempt(self, request_id: Hashable, num_computed_tokens: int, step_end_tokens: list,
                now_s: float) -> None:
        """The engine takes `request_id` off the GPU (it will be admitted again and recompute)."""


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0               # steps with at least one prefill chunk
    decode_only_steps: int = 0
    busy_s: float = 0.0                  # GPU time spent in steps
    load_wait_s: float = 0.0             # of it, steps stretched by a member's layer-wise load (layerwise_load)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0
    preemptions: int = 0
    admissions_deferred: int = 0         # admission attempts a gate refused (the request waited)


class _Active:
    """One request inside the engine."""

    __slots__ = ("req", "timing", "prompt_tokens", "remaining", "context", "target", "decode_left", "started",
                 "generated", "admission", "grown_to", "needs_decode_memory", "yields", "load_window")

    def __init__(self, req: EngineRequest, timing: RequestTiming) -> None:
        self.req, self.timing = req, timing
        self.prompt_tokens = req.context_num_tokens
        self.remaining = 0          # prefill tokens still to compute (this admission)
        self.context = 0            # tokens already in KV
        self.target = req.context_num_tokens  # context at the end of this admission's prefill
        self.decode_left = req.output_num_tokens  # output tokens still to produce
        self.started = False
        self.generated = 0          # output tokens produced so far
        self.admission = 0          # count; stale restore-heap entries carry an older one
        self.grown_to = 0           # tokens of KV the gate promised (vLLM growth)
        self.needs_decode_memory = False
        self.yields = 0             # passes in a row its chunk was capped for short prefills
        self.load_window = None     # layerwise_load: (start, end) of its host-to-device copy, until its first step


class Engine:
    """One GPU (module docstring). Not thread-safe; one driver owns it."""

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, config: EngineConfig = EngineConfig(),
                 step_cost: Optional[RooflineStepCost] = None, gate: Optional[MemoryGate] = None,
                 l3_link=None) -> None:
        """`l3_link`: a `sim.l3_link.L3LinkSpec` (cluster mode): this server's network link to the shared
        L3 store, a FIFO channel like the SSD; None (one server) leaves every code path unchanged."""
        self.model, self.hardware, self.config = model, hardware, config
        self.l3_spec = l3_link
        self.l3 = None if l3_link is None else Channel("l3", config.io_unit_bytes / l3_link.bandwidth_bytes_per_s)
        self.cost = step_cost if step_cost is not None else RooflineStepCost(model, hardware)
        self.gate = gate if gate is not None else MemoryGate()
        unit = config.io_unit_bytes
        self.h2d = Channel("h2d", unit / hardware.h2d_bandwidth_bytes_per_s)
        self.d2h = Channel("d2h", unit / hardware.d2h_bandwidth_bytes_per_s)
        self.ssd = Channel("ssd", unit / hardware.ssd_write_bandwidth_bytes_per_s)
        self.stats = EngineStats()
        self._now = 0.0
        self._gpu_free = 0.0           # end of the last committed step
        self._seq = 0
        layers = model.architecture.num_layers if model.architecture is not None else 1
        self._num_layers = max(1, layers)  # layerwise_load's pipeline depth (1: no overlap)
        self._waiting: deque = deque() # submitted or preempted, not admitted (FIFO; preempted first)
        self._running: dict = {}       # request id -> _Active, in admission order (preemption order)
        self._restoring: list = []     # heap of (ready_s, seq, admission, _Active)
        self._prefill: deque = deque() # restored requests, FIFO; the head may be partly prefilled
        self._decoding: list = []      # _Active in decode
        self._decode_context_sum = 0
        self._pending: list = []       # events of the last committed step, not yet returned
        self._pending_time = math.inf

    # ---------------------------------------------------------------------------- driver API
    @property
    def now_s(self) -> float:
        return self._now

    def submit(self, req: EngineRequest, now_s: float) -> RequestTiming:
        """A request arrives at `now_s`; it is admitted at once if nobody waits ahead of it and the
        gate lets it in (its restore starts then), else it waits for a later step start.

        Call `advance_until(now_s)` first (events before `now_s` would otherwise come out late)."""
        self._check_time(now_s)
        if req.num_compute_tokens < 0 or req.output_num_tokens < 0 or req.context_num_tokens < 0:
            raise ValueError(f"negative token count in {req}")
        if req.num_compute_tokens > req.context_num_tokens:
            raise ValueError(f"num_compute_tokens exceeds context_num_tokens in {req}")
        self._check_restore_sizes(req)
        active = _Active(req, RequestTiming(req.request_id, now_s))
        self._waiting.append(active)
        self.stats.requests_submitted += 1
        if len(self._waiting) == 1:
            self._admit_waiting(now_s)
        return active.timing

    @staticmethod
    def _check_restore_sizes(req: EngineRequest) -> None:
        for tier, size in req.kv_restore_bytes_by_tier.items():
            if size < 0:
                raise ValueError(f"negative restore size in {req}")
            if tier not in (GPU_TIER, CPU_TIER, SSD_TIER):
                raise ValueError(f"unknown tier {tier!r} in {req}")

    def _admit_waiting(self, now_s: float) -> None:
        """Admit waiting requests in FIFO order until the gate refuses one (head-of-line blocking).

        A request whose last step is committed but not yet over (its FINISHED event is pending) still
        holds its slot and its memory until that step ends: counting it as gone admitted a request
        arriving mid-step at its arrival, before the finished request's pages reached the cache (seen:
        the cluster twin, one request at a time, matching a worker's second request against an empty
        cache that live had filled)."""
        finishing = sum(ev.kind is EventKind.FINISHED for ev in self._pending) if self._pending else 0
        while self._waiting and len(self._running) + finishing < self.config.max_running_requests:
            active = self._waiting[0]
            idle = not self._running and not finishing
            admitted = self.gate.admit(active.req, active.target, now_s, idle=idle)
            if admitted is None:
                if idle:  # nothing would ever free memory: the replay could not end
                    raise RuntimeError(f"{type(self.gate).__name__} refused {active.req.request_id!r} on an idle GPU")
                self.stats.admissions_deferred += 1
                return
            self._waiting.popleft()
            self._start_restore(active, admitted, now_s)

    def _start_restore(self, active: _Active, req: EngineRequest, now_s: float) -> None:
        """Admitted: the request holds memory from now on; its data crosses the links (eq. 2)."""
        self._check_restore_sizes(req)
        n = max(1, req.num_compute_tokens)  # a full hit still computes one token (for its logits)
        cpu_bytes = ssd_bytes = 0
        for tier, size in req.kv_restore_bytes_by_tier.items():
            if tier == CPU_TIER:
                cpu_bytes += size
            elif tier == SSD_TIER:
                ssd_bytes += size
        if req.checkpoint_tier == CPU_TIER:
            cpu_bytes += req.checkpoint_restore_bytes
        elif req.checkpoint_tier == SSD_TIER:
            ssd_bytes += req.checkpoint_restore_bytes
        hw = self.hardware
        h2d_bw, ssd_bw = hw.h2d_bandwidth_bytes_per_s, hw.ssd_read_bandwidth_bytes_per_s
        ssd_end = self.ssd.reserve(ssd_bytes / ssd_bw, ssd_bytes, now_s)
        h2d_end = self.h2d.reserve((cpu_bytes + ssd_bytes) / h2d_bw, cpu_bytes + ssd_bytes, now_s)
        ready = max(h2d_end, ssd_end + ssd_bytes / h2d_bw) if (cpu_bytes or ssd_bytes) else now_s
        timing = active.timing
        timing.restore_done_s = ready
        timing.restore_transfer_s = max((cpu_bytes + ssd_bytes) / h2d_bw, ssd_bytes / ssd_bw + ssd_bytes / h2d_bw)
        staged = ssd_end if ssd_bytes else now_s  # every byte in host memory (layerwise_load)
        if req.l3_restore_bytes:
            l3_end = self._start_l3_restore(timing, req.l3_restore_bytes, now_s)
            ready = timing.restore_done_s
            staged = max(staged, l3_end)
        active.load_window = None
        if self.config.layerwise_load and ready > staged:
            load_s = (cpu_bytes + ssd_bytes + req.l3_restore_bytes) / h2d_bw
            active.load_window = (ready - load_s, ready)
            ready = staged  # it runs while its layers arrive (module docstring, Restore)
        if timing.admitted_s is None:
            timing.admitted_s = now_s
            timing.num_compute_tokens = n
        active.req = req
        active.target = max(active.target, n)  # an empty prompt still runs one token
        active.remaining = n
        active.context = active.target - n
        active.grown_to = active.target - n + min(n, self.config.token_budget_per_step)
        active.admission += 1
        timing.step_end_tokens = []
        self._running[req.request_id] = active
        self._seq += 1
        heapq.heappush(self._restoring, (ready, self._seq, active.admission, active))

    def _start_l3_restore(self, timing: RequestTiming, l3_bytes: int, now_s: float) -> float:
        """Cluster mode: `l3_bytes` cross the L3 link (one operation's latency + bytes / bandwidth,
        FIFO behind other restores and at most one background unit) and then H2D, like an SSD read
        (module docstring, Restore). Runs after the local restore was reserved, so it queues behind it.
        Returns when the bytes are in host memory."""
        if self.l3 is None:
            raise ValueError("an L3 restore on an engine without an L3 link")
        spec, h2d_bw = self.l3_spec, self.hardware.h2d_bandwidth_bytes_per_s
        link_s = spec.op_latency_s + l3_bytes / spec.bandwidth_bytes_per_s
        l3_end = self.l3.reserve(link_s, l3_bytes, now_s)
        h2d_end = self.h2d.reserve(l3_bytes / h2d_bw, l3_bytes, now_s)
        timing.restore_done_s = max(timing.restore_done_s, h2d_end, l3_end + l3_bytes / h2d_bw)
        timing.restore_transfer_s = max(timing.restore_transfer_s, link_s + l3_bytes / h2d_bw)
        return l3_end

    def submit_l3_put(self, size_bytes: float, num_ops: int, now_s: float) -> float:
        """Cluster mode: a background write of `size_bytes` in `num_ops` store operations (HiCache
        writes L3 from host memory after the L2 backup, so it crosses only the L3 link). Returns when
        it completes if no restore overtakes it (restores preempt background work between units, so
        this is a lower bound): the time its objects become visible in the store."""
        self._check_time(now_s)
        if self.l3 is None:
            raise ValueError("an L3 put on an engine without an L3 link")
        if size_bytes <= 0:
            return now_s
        spec = self.l3_spec
        self.l3.add_background(num_ops * spec.op_latency_s + size_bytes / spec.bandwidth_bytes_per_s, size_bytes,
                               now_s)
        return self.l3.background_done_s(now_s)

    def submit_transfer(self, size_bytes: float, src_tier: Optional[int], dst_tier: Optional[int],
                        now_s: float) -> None:
        """A background data movement decided by the cache (a `TierOp`): offload, write-through,
        checkpoint write to SSD, promotion. Not on any request's critical path, but it occupies the
        links it crosses (GPU->CPU: D2H; ->SSD: SSD write; SSD->: SSD read; ->GPU: H2D)."""
        self._check_time(now_s)
        if dst_tier is None or src_tier == dst_tier or size_bytes <= 0:
            return
        hw = self.hardware
        src = GPU_TIER if src_tier is None else src_tier   # a "put" is data just produced on the GPU
        if src == GPU_TIER:
            self.d2h.add_background(size_bytes / hw.d2h_bandwidth_bytes_per_s, size_bytes, now_s)
        if src == SSD_TIER:
            self.ssd.add_background(size_bytes / hw.ssd_read_bandwidth_bytes_per_s, size_bytes, now_s)
        if dst_tier == SSD_TIER:
            self.ssd.add_background(size_bytes / hw.ssd_write_bandwidth_bytes_per_s, size_bytes, now_s)
        if dst_tier == GPU_TIER:
            self.h2d.add_background(size_bytes / hw.h2d_bandwidth_bytes_per_s, size_bytes, now_s)

    def advance_until(self, t_s: float) -> list:
        """Simulate up to `t_s`; return the events of the earliest event time <= t_s (module docstring)."""
        self._check_time(t_s)
        while True:
            if self._pending:
                if self._pending_time <= t_s:
                    events, self._pending, self._now = self._pending, [], self._pending_time
                    self._pending_time = math.inf
                    return events
                self._now = t_s
                return []
            start = self._next_step_start()
            if start >= t_s:
                if t_s != math.inf:       # idle forever: keep the clock where it is
                    self._now = t_s
                return []
            if self._waiting:
                self._admit_waiting(start)
            self._admit_restored(start)
            if not self._allocate_decodes(start):
                continue                   # preemptions changed the batch: schedule again
            if self._prefill:
                self._run_step(start, t_s)
            elif self._decoding:
                self._fast_forward_decode(start, t_s)

    def next_event_time(self) -> float:
        """Earliest time the engine's state can change without new submissions (a lower bound on
        the next event); math.inf when idle. `advance_until` is what returns events."""
        if self._pending:
            return self._pending_time
        return self._next_step_start()

    @property
    def has_pending_events(self) -> bool:
        """Events of a committed step wait to be returned (`next_event_time` is then exact)."""
        return bool(self._pending)

    def has_work(self) -> bool:
        return bool(self._pending or self._running or self._waiting)

    @property
    def num_in_flight(self) -> int:
        return len(self._running) + len(self._waiting)

    # ---------------------------------------------------------------------------- internals
    def _check_time(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"time went backwards: {t} < engine time {self._now}")

    def _next_step_start(self) -> float:
        if self._decoding or self._prefill:
            return self._gpu_free
        if self._waiting and not self._running:
            return max(self._gpu_free, self._now)  # idle: the scheduler admits at once
        while self._restoring and self._restoring[0][2] != self._restoring[0][3].admission:
            heapq.heappop(self._restoring)     # preempted while restoring
        if self._restoring:
            return max(self._gpu_free, self._restoring[0][0])
        return math.inf

    def _admit_restored(self, start: float) -> None:
        restoring = self._restoring
        while restoring and restoring[0][0] <= start:
            _, _, admission, active = heapq.heappop(restoring)
            if admission == active.admission and active.req.request_id in self._running:
                self._prefill.append(active)

    # --- memory growth and preemption (module docstring) --------------------------------------------
    def _grow(self, active: _Active, num_tokens: int, start: float) -> bool:
        """Promise `active` memory for `num_tokens` of KV, preempting the most recently admitted
        running requests when the gate refuses (vLLM). False if `active` itself was preempted."""
        if num_tokens <= active.grown_to:
            return True
        rid = active.req.request_id
        while not self.gate.grow(rid, num_tokens, start, force=len(self._running) == 1):
            victim = self._running[next(reversed(self._running))]
            self._preempt(victim, start)
            if victim is active:
                return False
        active.grown_to = num_tokens
        return True

    def _allocate_decodes(self, start: float) -> bool:
        """Requests that entered decode get their output's memory before the next step (vLLM
        allocates a block whenever decode crosses one; the whole output at once here). False if a
        preemption happened."""
        preempted = False
        for active in [a for a in self._decoding if a.needs_decode_memory]:
            if active.req.request_id not in self._running:
                continue                      # preempted by an earlier one in this loop
            active.needs_decode_memory = False
            before = self.stats.preemptions
            self._grow(active, active.context + active.decode_left, start)
            preempted |= self.stats.preemptions != before
        return not preempted

    def _preempt(self, victim: _Active, now_s: float) -> None:
        """Take `victim` off the GPU: its memory goes back (the gate decides what stays cached) and
        it waits at the head of the queue to recompute prompt + output so far (vLLM recompute)."""
        rid = victim.req.request_id
        del self._running[rid]
        if victim in self._decoding:
            self._decoding.remove(victim)
            self._decode_context_sum -= victim.context
        elif victim in self._prefill:
            self._prefill.remove(victim)
        self.gate.preempt(rid, victim.context, list(victim.timing.step_end_tokens), now_s)
        victim.admission += 1                   # any restore in flight is void
        victim.target = victim.prompt_tokens + max(0, victim.generated - 1)  # the KV it had computed
        victim.needs_decode_memory = False
        victim.timing.num_preemptions += 1
        self.stats.preemptions += 1
        self._waiting.appendleft(victim)

    # --- steps ---------------------------------------------------------------------------------------
    def _chunk(self, active: _Active, budget: int) -> int:
        """Tokens of `active` this step may compute with `budget` left (the chunk rule)."""
        n = min(active.remaining, budget)
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        if self.config.chunk_rule in ("vllm", "vllm-internal"):
            block = self.config.block_num_tokens
            last_cache = active.target - active.target % block
            if active.context + n < last_cache:
                n = n // block * block          # may be 0: the request waits for a bigger budget
            elif active.context < last_cache < active.context + n and self.config.chunk_rule == "vllm":
                n = last_cache - active.context  # force a step end at the last block boundary
        elif self.config.chunk_rule == "grid" and n < active.remaining:
            n = floor_cut(active.context, active.context + n, self.config.block_num_tokens) - active.context
        return n

    def _short_first_limit(self, budget: int) -> Optional[int]:
        """The cap `core.prefill_order` puts on the continuing chunk at the head of the prefill queue
        (SGLang tracks one chunked request; the head is it once it has started), advancing its count
        of capped passes. None: no cap (the option off, no chunk in progress, or nothing short)."""
        rule = self.config.short_prefill_first
        if rule is None or not self._prefill:
            return None
        head = self._prefill[0]
        if not head.started:
            return None
        kv_bytes = self.model.kv_bytes_per_token
        works = [prefill_work_tokens(a.remaining, {t: b / kv_bytes for t, b in a.req.kv_restore_bytes_by_tier.items()})
                 for a in list(self._prefill)[1:]]
        grid = self.config.block_num_tokens if self.config.chunk_rule == "grid" else None
        limit = rule.chunk_limit(head.remaining, works, budget, self.config.page_tokens, head.yields, min_tokens=grid)
        head.yields = rule.next_yields(head.yields, limit is not None)
        return limit

    def _run_step(self, start: float, limit: float) -> None:
        """One forward step with the prefill chunks that fit (and decode tokens if mixed)."""
        cfg = self.config
        budget = cfg.token_budget_per_step
        if cfg.mixed_batches:
            budget -= len(self._decoding)
        members = []
        head_limit = self._short_first_limit(budget)
        capped = self._prefill[0] if head_limit is not None else None
        for active in list(self._prefill):
            if budget <= 0:
                break
            if active.req.request_id not in self._running:
                continue                           # preempted by an earlier chunk of this step
            n = self._chunk(active, min(budget, head_limit) if active is capped else budget)  # add_chunked_req's min
            if n <= 0:
                continue
            if not self._grow(active, active.context + n, start):
                break                              # preempted itself: nothing more this step
            members.append((active, n))
            budget -= n
        members = [(a, n) for a, n in members if a.req.request_id in self._running]
        decoding = self._decoding if cfg.mixed_batches else []
        chunks = []
        for active, n in members:
            if not active.started:
                active.started = True
                if active.timing.prefill_start_s is None:
                    active.timing.prefill_start_s = start
            chunks.append(PrefillChunk(n, active.context, n == active.remaining))
        if not chunks and not decoding:  # every prefill waits (chunk rule or preemption)
            if self._decoding:
                self._fast_forward_decode(start, limit)
            return
        # chunks may be empty when decodes take the whole budget: then this is one decode-only step.
        dt = self.cost.step_time_s(chunks, len(decoding), self._decode_context_sum if decoding else 0)
        end = self._layerwise_end(members, start, dt)
        self.stats.load_wait_s += end - start - dt
        self._commit_step_stats(end - start, prefill=bool(chunks))
        events = []
        for active, n in members:
            active.remaining -= n
            active.context += n
            active.timing.step_end_tokens.append(active.context)
            self.stats.prefill_tokens += n
        if decoding:
            events += self._advance_decodes(1, end)
        done = [a for a, _ in members if a.remaining == 0]
        for active in done:
            self._prefill.remove(active)
            self._prefill_done(active, end, events)
        self._gpu_free = end
        self._emit(events, end)

    def _layerwise_end(self, members: list, start: float, dt: float) -> float:
        """End of a step of `dt` seconds of compute whose members may still be loading (layerwise_load):
        layer l computes once its copy and layer l - 1 are done, so with L layers and a load of
        [a, b] the step ends at max(max(start, a + (b - a) / L) + dt, b + dt / L)."""
        end = start + dt
        per_layer = 1.0 / self._num_layers
        for active, _ in members:
            window = active.load_window
            if window is None:
                continue
            active.load_window = None  # later chunks find their prefix resident
            load_start, load_end = window
            end = max(end, max(start, load_start + (load_end - load_start) * per_layer) + dt,
                      load_end + dt * per_layer)
        return end

    def _prefill_done(self, active: _Active, t: float, events: list) -> None:
        """The prefill produced a token: the first one (TTFT), or the next one after a preemption."""
        if active.timing.first_token_s is None:
            active.timing.first_token_s = t
            events.append(EngineEvent(EventKind.FIRST_TOKEN, t, active.req.request_id, active.timing))
        if active.decode_left > 0:
            active.decode_left -= 1
            active.generated += 1
        if active.decode_left <= 0:
            self._finish(active, t, events)
        else:
            active.needs_decode_memory = True
            self._decoding.append(active)
            self._decode_context_sum += active.context

    def _finish(self, active: _Active, t: float, events: list) -> None:
        active.timing.finish_s = t
        del self._running[active.req.request_id]
        self.stats.requests_finished += 1
        events.append(EngineEvent(EventKind.FINISHED, t, active.req.request_id, active.timing))

    def _advance_decodes(self, num_steps: int, end: float) -> list:
        """Every decoding request produced `num_steps` tokens; finish those that are done at `end`."""
        events, still = [], []
        for active in self._decoding:
            active.decode_left -= num_steps
            active.generated += num_steps
            active.context += num_steps
            if active.decode_left == 0:
                self._decode_context_sum -= active.context - num_steps
                self._finish(active, end, events)
            else:
                still.append(active)
        self._decode_context_sum += num_steps * len(still)
        self.stats.decode_tokens += num_steps * len(self._decoding)
        self._decoding = still
        return events

    def _fast_forward_decode(self, start: float, limit: float) -> None:
        """Run the decode-only steps that start before `limit` (the caller's target time or the next
        restore completion), stopping at the first completion. Step j takes o + max(a + b j, c + d j),
        so the start of step k is start + S(k) with S in closed form (`_cumulative`)."""
        if self._restoring:
            limit = min(limit, self._restoring[0][0])   # > start: earlier ones were admitted
        k_done = min(a.decode_left for a in self._decoding)
        o, a, b, c, d = self.cost.decode_coefficients(len(self._decoding), self._decode_context_sum)
        budget = limit - start                          # > 0, so step 0 always runs
        if _cumulative(o, a, b, c, d, k_done - 1) < budget:
            k = k_done
        else:
            lo, hi = 0, k_done - 1       # S(lo) < budget <= S(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _cumulative(o, a, b, c, d, mid) < budget:
                    lo = mid
                else:
                    hi = mid
            k = hi                        # steps 0 .. hi - 1 start before limit
        duration = _cumulative(o, a, b, c, d, k)
        end = start + duration
        self.stats.steps += k
        self.stats.decode_only_steps += k
        self.stats.busy_s += duration
        events = self._advance_decodes(k, end)
        self._gpu_free = end
        self._emit(events, end)

    def _commit_step_stats(self, dt: float, prefill: bool) -> None:
        self.stats.steps += 1
        self.stats.busy_s += dt
        if prefill:
            self.stats.prefill_steps += 1
        else:
            self.stats.decode_only_steps += 1

    def _emit(self, events: list, t: float) -> None:
        if events:
            self._pending = events
            self._pending_time = t


def _cumulative(o: float, a: float, b: float, c: float, d: float, k: int) -> float:
    """sum_{j=0}^{k-1} (o + max(a + b j, c + d j)): two lines cross at most once."""
    if k <= 0:
        return 0.0
    hi_first, lo_first = ((a, b), (c, d)) if a >= c else ((c, d), (a, b))
    # hi_first dominates from j = 0 until the crossing point (if its slope is smaller).
    if hi_first[1] >= lo_first[1]:
        m = k
    else:
        cross = (hi_first[0] - lo_first[0]) / (lo_first[1] - hi_first[1])
        m = min(k, max(0, math.ceil(cross)))
    return o * k + _line_sum(*hi_first, 0, m) + _line_sum(*lo_first, m, k)


def _line_sum(a: float, b: float, p: int, q: int) -> float:
    """sum_{j=p}^{q-1} (a + b j)."""
    if q <= p:
        return 0.0
    return (q - p) * a + b * (q * (q - 1) - p * (p - 1)) / 2
