"""How each serving engine admits requests into GPU memory and what it caches when they finish.

The engine model (engine.py) asks a `MemoryGate` for memory; `CacheGate` answers with a
`histate.core` cache: a running request holds its new KV and its working recurrent states in the GPU
pool next to the cache (`HybridPrefixCache.reserve`), and its matched prefix is pinned from
admission to finish. What differs between engines is `EngineProfile`:

sglang  (`sglang-hicache`; HiState runs on SGLang's scheduler, so `histate*` too)
        `PrefillAdder.add_one_req` (sglang/srt/managers/schedule_policy.py:1408-1433) admits a request
        only if its extend tokens plus its decode headroom fit in free + evictable KV after the
        headroom of running requests (`PrefillBudget.remaining_total`, mem_cache/prefill_budget.py:
        93-103); a request that does not fit waits (NO_TOKEN ends the pass). The whole request is
        promised here (extend + output: no retraction is modelled). A running request also holds
        three state slots: its working state plus the two ping-pong tracking buffers of extra_buffer
        mode with overlap scheduling (mem_cache/allocation_sizing.py:11-19, memory_pool.py:1393).
        Prefill steps run alone (`--enable-mixed-chunk` is off by default); a chunk is cut wherever
        the budget ends (`mamba_prefill_chunk_grid` is 1 without DCP, schedule_policy.py:586-601).
vllm    (`vllm-*`, `marconi`) `Scheduler.schedule` (vllm-project/vllm@00024d3) allocates blocks step
        by step (`KVCacheManager.allocate_slots`): a waiting request is admitted when its first
        step's blocks and its running-state block fit, else the waiting loop stops; a running request
        that cannot get its next blocks preempts the most recently admitted one (recompute). Align
        mode cuts prefill steps on block boundaries; one state (a block per mamba group) runs per
        request (`MambaManager.get_num_blocks_to_allocate`). Decode blocks are allocated when the
        request enters decode, for its whole output (vLLM allocates one per 576 tokens: outputs are
        short next to prompts).

At finish the request's pages up to the end of its output are offered to the cache with the states
the engine really keeps (the policy's `admit` reads where the forward passes ended and where the
output ends; docs/policies.md). A policy that captures in-pass (`Policy.captures_in_pass`: HiState,
as the SGLang plugin does) plans its prompt positions when the request is first admitted, and keeps
every planned position a prefill pass's chunk grid reaches (core/capture.py) plus the decode state of
its finish plan; the gate counts planned, captured and off-grid interior positions (`GateStats`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Hashable, Optional

from ..core import (HybridPrefixCache, ItemKind, MatchResult, MissAttribution, MissHistory, RequestLease, Tier,
                    attribute_misses, captured_positions)
from .costs import ModelSpec, vllm_hybrid_blocks
from .engine import EngineConfig, EngineRequest, MemoryGate
from .request import Request

SGLANG_WORKING_STATES = 3
"""Working state + two ping-pong tracking slots per running request (module docstring)."""


@dataclass(frozen=True)
class EngineProfile:
    """How one serving engine schedules and holds memory (module docstring)."""

    name: str
    engine: EngineConfig
    block_num_tokens: int        # allocation granularity of running requests' KV
    working_states: int          # recurrent states a running request holds outside the cache
    grows: bool                  # memory allocated step by step, with preemption (vLLM)


ENGINES = ("sglang", "vllm")


def engine_profile(policy, model: ModelSpec, base: EngineConfig, page_num_tokens: int,
                   engine: Optional[str] = None) -> EngineProfile:
    """The profile of the engine `policy` runs on (`Policy.engine`, or `engine` for a what-if), on
    top of `base`'s budget, batch limit and I/O unit."""
    name = engine or policy.engine
    if name == "vllm":
        block = vllm_hybrid_blocks(model).block_num_tokens if policy.block_granular else page_num_tokens
        # vLLM with internal prefill checkpoints (#52789) reads the last boundary's state out of the
        # final forward instead of forcing a step end there (`Policy.internal_prefill_checkpoints`).
        # short_prefill_first is SGLang's chunk cap (core.prefill_order): vLLM's scheduler has no such cap.
        rule = "vllm-internal" if policy.internal_prefill_checkpoints else "vllm"
        return EngineProfile("vllm", replace(base, mixed_batches=True, chunk_rule=rule, block_num_tokens=block,
                                             short_prefill_first=None),
                             block, 1, grows=True)
    if name == "sglang":
        # HiState floors every chunked-prefill cut to the state grid (sglang_plugin/chunking.py); stock
        # SGLang cuts wherever the budget ends (`mamba_prefill_chunk_grid` is 1 without DCP).
        rule = "grid" if policy.captures_in_pass else "none"
        # long_prefill_token_threshold is vLLM's per-request step cap; SGLang has none. Decodes share a
        # prefill step only with --enable-mixed-chunk (scheduler.py:1376-1378, 4376-4395), whose running
        # decodes take their tokens off the step's chunk budget (schedule_policy.py:638-655,
        # rem_chunk_tokens -= num_mixed_decode_tokens; the engine's `mixed_batches` budget rule).
        # HiCache's load-back overlaps the forward layer by layer (cache_controller.py:1028-1069,
        # memory_pool.py:1675-1725; the engine's `layerwise_load`).
        return EngineProfile("sglang", replace(base, mixed_batches=base.sglang_mixed_chunk, chunk_rule=rule,
                                               long_prefill_token_threshold=0, layerwise_load=True,
                                               block_num_tokens=page_num_tokens),
                             1, SGLANG_WORKING_STATES, grows=False)
    raise ValueError(f"policy {policy.name!r}: unknown engine {name!r}; known: {', '.join(ENGINES)}")


class _Held:
    """One request as the gate sees it."""

    __slots__ = ("request", "lease", "kv_bytes", "state_bytes", "first_match", "first_match_s", "plan_pages", "misses")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.lease: Optional[RequestLease] = None
        self.kv_bytes = 0            # promised in the GPU KV pool
        self.state_bytes = 0         # promised in the GPU state pool (the same pool unless split)
        self.first_match: Optional[MatchResult] = None
        self.first_match_s: Optional[float] = None  # when that match happened (explain attributes there)
        self.plan_pages: Optional[list] = None  # prompt positions planned at first admission (in-pass capture)
        self.misses: Optional[MissAttribution] = None  # why its uncached tokens missed, at first admission


@dataclass(slots=True)
class GateStats:
    admissions: int = 0
    refusals: int = 0            # admission attempts that had to wait for memory
    overcommits: int = 0         # grants with no room even on an idle GPU (a request larger than the pool)
    growth_refusals: int = 0     # vLLM: a running request could not get its next blocks
    preemptions: int = 0
    planned_interior: int = 0    # in-pass capture: planned prompt positions before the deepest one
    captured_interior: int = 0   # ... of them captured by the pass that computed them
    off_grid: int = 0            # planned positions no kernel chunk boundary of their pass hit


class CacheGate(MemoryGate):
    """The engine's memory, backed by a `histate.core` cache (module docstring)."""

    def __init__(self, cache: HybridPrefixCache, profile: EngineProfile,
                 on_cache_change: Callable[[float], None] = lambda now_s: None, observer=None,
                 on_finish_insert: Optional[Callable] = None, misses: Optional[MissHistory] = None) -> None:
        """`observer`: an explain.EvictionLog, told which request each cache call serves.
        `on_finish_insert(request, page_keys, state_pages, now_s)`: called when a finished request's
        pages and states enter the cache (cluster mode writes L3 at that moment, sim/cluster.py).
        `misses`: the departures the cache's `MissRecorder` keeps; with it, each request's uncached
        tokens get their reasons at its first admission (`first_misses`, core/misses.py)."""
        self.on_finish_insert = on_finish_insert
        self.misses = misses
        self.cache = cache
        self.observer = observer
        self.profile = profile
        self.page_num_tokens = cache.config.page_num_tokens
        self.kv_bytes_per_token = cache.config.kv_bytes_per_token
        self.state_bytes = cache.config.checkpoint_size_bytes
        self.on_cache_change = on_cache_change
        self.held: dict = {}
        self.stats = GateStats()

    # --- driver side --------------------------------------------------------------------------------
    def register(self, request: Request) -> None:
        """A request arrived; the engine will ask to admit it."""
        self.held[request.uid] = _Held(request)

    def first_match(self, uid: Hashable) -> Optional[MatchResult]:
        """The cache match of the request's first admission (what it reused; hit accounting)."""
        return self.held[uid].first_match

    def first_match_s(self, uid: Hashable) -> Optional[float]:
        """When the request's first admission matched: a request waiting in the queue loses what the
        cache evicts before then, after its arrival (sim/explain.py)."""
        return self.held[uid].first_match_s

    def first_misses(self, uid: Hashable) -> Optional[MissAttribution]:
        """Why the request's uncached tokens missed, judged when its first admission matched (None
        without a miss history)."""
        return self.held[uid].misses

    def finish(self, uid: Hashable, step_end_tokens: list, now_s: float) -> None:
        """The request's last token is out: its memory goes back and the cache keeps what the engine
        keeps (prompt and output pages, states where the policy's engine has them)."""
        self._serving(uid)
        held = self.held.pop(uid)
        request = held.request
        if self.misses is not None:  # later requests sharing its context had a shared prefix (core/misses.py)
            # (without caches_outputs the engine's output is not the trace's: `histate serve`, EngineConfig)
            context = request.input_num_tokens + (request.output_num_tokens if self.profile.engine.caches_outputs else 0)
            self.misses.saw_context(request.keys_through(context // self.page_num_tokens))
        kv_tokens = request.input_num_tokens + max(0, request.output_num_tokens - 1)  # the last token has no KV
        inserted = self._insert(held, request.input_num_tokens, kv_tokens, step_end_tokens, now_s, request.session_id)
        if inserted is not None and self.on_finish_insert is not None:
            self.on_finish_insert(request, *inserted, now_s)

    def close_session(self, session_id: Hashable, now_s: float) -> None:
        """The client session ended (its last request completed): SGLang's `close_session`, which
        drops the session's references under `--enable-session-radix-cache` (core/sessions.py)."""
        self.cache.close_session(session_id, now_s)

    def match_pages(self, context_num_tokens: int) -> int:
        """Pages of a context the cache may match and keep: all of its full pages, or those of its first
        L-1 tokens on an engine that always prefills the last one (EngineConfig.matches_last_prompt_token)."""
        if not self.profile.engine.matches_last_prompt_token:
            context_num_tokens -= 1
        return max(0, context_num_tokens) // self.page_num_tokens

    # --- MemoryGate ----------------------------------------------------------------------------------
    def admit(self, req: EngineRequest, context_num_tokens: int, now_s: float, idle: bool) -> Optional[EngineRequest]:
        self._serving(req.request_id)
        held = self.held[req.request_id]
        request, cache = held.request, self.cache
        keys = request.keys_through(self.match_pages(context_num_tokens))
        state_bytes = self.profile.working_states * self.state_bytes
        if not idle and not self._fits(self._need_bytes(request, context_num_tokens, None), state_bytes):
            # the bound (whatever the request reuses) fails; vLLM's exact need depends on the match
            exact = self._need_bytes(request, context_num_tokens, cache.match(keys)) if self.profile.grows else None
            if exact is None or not self._fits(exact, state_bytes):
                self.stats.refusals += 1
                return None
        lease = cache.begin_request(keys, now_s, _hint_pages(request, self.page_num_tokens))
        m = lease.match
        reused = min(m.num_reused_pages * self.page_num_tokens, context_num_tokens)
        kv_bytes = self._need_bytes(request, context_num_tokens, m) - reused * self.kv_bytes_per_token
        if not self._promise(held, kv_bytes, state_bytes, now_s, idle):
            cache.abort_request(lease)
            self.stats.refusals += 1
            return None
        held.lease = lease
        if held.first_match is None:
            held.first_match, held.first_match_s = m, now_s
            if self.misses is not None:
                held.misses = attribute_misses(keys, context_num_tokens, self.page_num_tokens, m.num_kv_pages,
                                               m.num_reused_pages, self.misses, m.held_kv_pages)
            if cache.policy.captures_in_pass:  # planned as the first pass is built (sglang_plugin/capture.py)
                held.plan_pages = cache.plan_checkpoints(lease, self.match_pages(request.input_num_tokens))
        self.stats.admissions += 1
        self.on_cache_change(now_s)
        return EngineRequest(req.request_id, context_num_tokens - reused, context_num_tokens, req.output_num_tokens,
                             m.kv_bytes_by_tier, m.checkpoint_size_bytes, m.checkpoint_tier)

    def grow(self, request_id: Hashable, num_tokens: int, now_s: float, force: bool) -> bool:
        if not self.profile.grows:
            return True  # SGLang promised the whole request at admission
        self._serving(request_id)
        held = self.held[request_id]
        reused = held.lease.match.num_reused_pages * self.page_num_tokens
        need = (self._blocks(num_tokens) - reused) * self.kv_bytes_per_token - held.kv_bytes
        if need <= 0:
            return True
        if self.cache.reserve(need, now_s, Tier.GPU, ItemKind.KV):
            held.kv_bytes += need
            self.on_cache_change(now_s)
            return True
        self.stats.growth_refusals += 1
        if force:
            self.stats.overcommits += 1
            return True
        return False

    def preempt(self, request_id: Hashable, num_computed_tokens: int, step_end_tokens: list, now_s: float) -> None:
        """vLLM frees the request's blocks; the full ones it computed stay in the prefix cache
        (`_preempt_request` -> `KVCacheManager.free`), so what it computed is offered to the cache."""
        self._serving(request_id)
        held = self.held[request_id]
        self.stats.preemptions += 1
        self._insert(held, held.request.input_num_tokens, num_computed_tokens, step_end_tokens, now_s)

    # --- internals -----------------------------------------------------------------------------------
    def _serving(self, uid: Hashable) -> None:
        if self.observer is not None:
            self.observer.set_request(uid)

    def _blocks(self, num_tokens: int) -> int:
        """`num_tokens` rounded up to whole allocation blocks."""
        block = self.profile.block_num_tokens
        return -(-num_tokens // block) * block

    def _need_bytes(self, request: Request, context_num_tokens: int, match: Optional[MatchResult]) -> int:
        """GPU KV bytes an admission takes: the reused prefix (pinned, or loaded back from CPU/SSD)
        plus what the engine allocates for the rest. SGLang allocates the whole extend and output,
        so the sum does not depend on the match; vLLM the first step's blocks (`match` None: an
        upper bound, every block through `context_num_tokens`)."""
        P = self.page_num_tokens
        if not self.profile.grows:
            remaining_output = max(0, request.input_num_tokens + request.output_num_tokens - context_num_tokens)
            return (context_num_tokens + remaining_output) * self.kv_bytes_per_token
        if match is None:
            return self._blocks(context_num_tokens) * self.kv_bytes_per_token
        reused = min(match.num_reused_pages * P, context_num_tokens)
        first_step = min(context_num_tokens - reused, self.profile.engine.token_budget_per_step)
        return self._blocks(reused + first_step) * self.kv_bytes_per_token

    def _fits(self, kv_need: int, state_bytes: int) -> bool:
        """Free + evictable GPU memory covers `kv_need` (which counts the prefix the request will pin
        or load back: it stops being evictable) and the working states."""
        cache = self.cache
        kv_room = cache.free_bytes(Tier.GPU, ItemKind.KV) + cache.evictable_bytes(Tier.GPU, ItemKind.KV)
        if cache.ledger.pool_of(Tier.GPU, ItemKind.KV) == cache.ledger.pool_of(Tier.GPU, ItemKind.CHECKPOINT):
            return kv_need + state_bytes <= kv_room
        state_room = (cache.free_bytes(Tier.GPU, ItemKind.CHECKPOINT)
                      + cache.evictable_bytes(Tier.GPU, ItemKind.CHECKPOINT))
        return kv_need <= kv_room and state_bytes <= state_room

    def _promise(self, held: _Held, kv_bytes: int, state_bytes: int, now_s: float, idle: bool) -> bool:
        """Reserve the request's KV and states. On an idle GPU a request larger than the pool runs
        anyway (an over-commit, counted) instead of waiting forever."""
        cache = self.cache
        if cache.reserve(kv_bytes, now_s, Tier.GPU, ItemKind.KV):
            if cache.reserve(state_bytes, now_s, Tier.GPU, ItemKind.CHECKPOINT):
                held.kv_bytes, held.state_bytes = kv_bytes, state_bytes
                return True
            cache.release(kv_bytes, Tier.GPU, ItemKind.KV)
        if not idle:
            return False
        self.stats.overcommits += 1
        held.kv_bytes = held.state_bytes = 0
        return True

    def _insert(self, held: _Held, prompt_tokens: int, kv_tokens: int, step_end_tokens: list, now_s: float,
                session_id: Optional[Hashable] = None) -> Optional[tuple]:
        """Give back the request's memory, then offer the cache its first `kv_tokens` tokens of
        prompt + output with the states the engine keeps; the lease closes. Returns the page keys and
        state positions (pages) offered, None when the request held no lease."""
        cache, P = self.cache, self.page_num_tokens
        if not self.profile.engine.caches_outputs:  # `histate serve`: nothing past the prompt is cached
            kv_tokens = min(kv_tokens, prompt_tokens)
        if held.kv_bytes:
            cache.release(held.kv_bytes, Tier.GPU, ItemKind.KV)
        if held.state_bytes:
            cache.release(held.state_bytes, Tier.GPU, ItemKind.CHECKPOINT)
        held.kv_bytes = held.state_bytes = 0
        lease = held.lease
        held.lease = None
        if lease is None:
            return None
        prompt_pages = min(self.match_pages(prompt_tokens), kv_tokens // P)
        output_end = kv_tokens // P if kv_tokens > prompt_tokens else None
        if held.plan_pages is not None:
            positions = self._captured(held, lease, prompt_pages, step_end_tokens, output_end)
        else:
            positions = cache.plan_checkpoints(lease, prompt_pages, _state_pages(lease, step_end_tokens, P),
                                               output_end)
        keys = held.request.keys_through(max(prompt_pages, kv_tokens // P))
        cache.finish_request(lease, keys, now_s, positions, session_id)
        self.on_cache_change(now_s)
        return keys, positions

    def _captured(self, held: _Held, lease: RequestLease, prompt_pages: int, step_end_tokens: list,
                  output_end: Optional[int]) -> list:
        """In-pass capture: the admission plan's prompt positions that a pass's chunk grid reached, plus
        the decode state of the finish plan (the positions past the prompt)."""
        P = self.page_num_tokens
        plan = [p for p in held.plan_pages if p <= prompt_pages]
        start = lease.match.num_reused_pages * P
        captured, off_grid = captured_positions([p * P for p in plan], start, step_end_tokens, P)
        interior = plan[:-1]
        stats = self.stats
        stats.planned_interior += len(interior)
        stats.captured_interior += len(set(interior) & {c // P for c in captured})
        stats.off_grid += len(off_grid)
        decode = [p for p in self.cache.plan_checkpoints(lease, prompt_pages, (), output_end) if p > prompt_pages]
        return sorted({c // P for c in captured} | set(decode))


def _hint_pages(request, page_num_tokens: int) -> tuple:
    """The request's named checkpoint positions as page depths: a position inside a page keeps the
    state at that page's start, the deepest whole page it covers (what the server's grid does)."""
    return tuple(t // page_num_tokens for t in request.checkpoint_hint_tokens)


def _state_pages(lease: RequestLease, step_end_tokens: list, page_num_tokens: int) -> tuple:
    """Where each prefill forward pass left its state, in pages: the last 64-token grid position of
    the pass's extend, measured from where the pass started (SGLang: prefix + floor(extend / grid) *
    grid, managers/schedule_batch.py:3177-3183; vLLM's align-mode passes end on block boundaries)."""
    P = page_num_tokens
    pages, start = [], lease.match.num_reused_pages * P
    for end in step_end_tokens:
        if end - start >= P:
            pages.append((start + (end - start) // P * P) // P)
        start = end
    return tuple(pages)
