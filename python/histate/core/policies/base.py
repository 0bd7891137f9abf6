"""The policy interface: what differs between HiState, its ablations and the baselines.

A policy is a small class: a few flags (which tiers, inclusive or exclusive placement, where
historical checkpoints go, refresh rule, static split, hit granularity) and two decisions:
  admit(ctx)                   -> checkpoint depths (pages) for a request's new segment
  score(ctx, node, unit, bit)  -> eviction priority; the lowest is evicted first. `ctx` is a
                                  `ScoringContext` (never the cache); `node` anything with the core
                                  node's read-only shape (docs/core-api.md). Contract: a score is never
                                  below the unit's last access time (GreedyDual form t + non-negative
                                  term), which lets the victim heap rank lazily (victims.py).
A policy whose score needs the whole candidate set (Marconi's min-max normalisation) sets
`scan_victims` and implements `choose_victim` instead; the evictor then scans the pool.
Policies never mutate the tree; the cache applies their decisions (docs/policies.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..scoring import ScoringContext
from ..types import Tier, UnitKind
from ..units import last_access_s


@dataclass(frozen=True, slots=True)
class AdmissionContext:
    """What a checkpoint-admission rule may look at for one request."""

    start_pages: int  # c: recompute starts here
    kv_match_pages: int  # m: where the request leaves the cached tree (a branch point if inside it)
    end_pages: int  # the request's page-aligned input length (terminal position)
    controller: object  # IntervalController
    config: object  # CacheConfig
    now_s: float = 0.0
    near_end_probs: tuple = ()  # learned reuse-position prior near the segment's end (PolicyState)
    depth_bins: tuple = ()  # learned prior of far interior hits by depth, inside the segment (DepthPrior.bins_in)
    step_end_pages: tuple = ()  # where the executor's prefill forward passes ended (pages, ascending)
    output_end_pages: Optional[int] = None  # pages holding KV at finish (prompt + output); None: no output


class Policy:
    name = ""
    tiers: tuple = (Tier.GPU,)
    write_through = False  # True: every new item is copied down all tiers (inclusive, LRU offload)
    checkpoint_tiers: Optional[tuple] = None  # tiers a checkpoint may occupy (None: `tiers`)
    kv_write_through_tiers: Optional[tuple] = None  # write-through: tiers new KV is copied to (None: all below)
    checkpoint_write_through = True  # write-through: a new checkpoint is copied down at creation (else on eviction)
    host_reclaims_duplicates = False  # host pressure frees host copies of device-held KV first (SGLang write_back)
    historical_tier: Optional[Tier] = None  # tier for non-terminal checkpoints at creation
    refresh_all = False  # on a checkpoint hit, refresh every checkpoint above it on the path
    refresh_matched_only = False  # a hit (and an insert) refreshes only the matched node (Marconi)
    partitioned = False  # static KV/state split per tier (SGLang); else one shared pool per tier
    shared_pool_tiers: tuple = ()  # tiers a partitioned policy still pools (SGLang's L3 file store)
    dense_checkpoints = False  # `unlimited`: a state at every page boundary
    unbounded = False  # ignore configured capacities
    block_granular = False  # hits, states and inserted KV in whole `config.block_pages` blocks (vLLM)
    kv_ends_at_last_state = False  # inserted KV stops at the deepest new state (SGLang's insert)
    state_evicts_leaf = False  # a state evicted from a tier leaf takes that leaf's KV copy (SGLang)
    scan_victims = False  # choose victims by scanning the pool (`choose_victim`), not by heap order
    engine = "sglang"  # whose scheduler serves it in the simulator: "sglang" or "vllm" (sim/admission.py)
    learns_reuse_positions = False  # learn where interior hits land near a trajectory's end (PolicyState)
    learns_depth_positions = False  # ... and, far from the end, at which depths (with learns_reuse_positions)
    charges_demotions = False  # eq. 7's C of a demoted unit is its transfer, not its recompute (units.py)
    estimates_residence_by_flow = True  # Little's-law T_KV / T_state before residences are observed
    captures_in_pass = False  # plan at admission; a pass keeps every planned state on its chunk grid (capture.py)
    accepts_checkpoint_hints = False  # positions a request names join its plan (PolicyState.plan; docs/hints.md)
    keeps_tool_wait = False  # CacheConfig.tool_wait holds waiting turns' paths, ranked last by its score (core/tool_wait.py)
    # --- mechanisms of the "as a careful operator runs them" baselines (sglang_tuned.py, vllm_current.py) ---
    session_refs = False  # SGLang --enable-session-radix-cache: finished requests tag their path per session (sessions.py)
    kv_eviction_takes_state = False  # KV leaving a tier takes the node's state copy there (SGLang's FULL->MAMBA cascade)
    max_states_per_path = -1  # SGLang --mamba-max-states-per-path: device states kept per path after an insert (-1: all)
    tracks_node_stats = False  # keep `hit_count` and `history_pages` on nodes (SGLang's slru / lfu / tlru strategies)
    partial_block_hits = False  # block-granular sizing, but hits and inserts at page granularity (vLLM #46384)
    internal_prefill_checkpoints = False  # the prompt-end state is read out inside the last forward (vLLM #52789)
    int8_checkpoints = False  # cached states in SGLang's int8 checkpoint pool (the simulator sizes them, sim/costs.py)

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return terminal_only(ctx)

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        return last_access_s(node, unit, bit)

    def choose_victim(self, ctx: ScoringContext, candidates: Sequence[tuple], now_s: float) -> Optional[int]:
        """Index into `candidates` ((node, unit, tier index) of one pool, none pinned) of the unit to
        evict, or None if none may go. Only called when `scan_victims` is set."""
        raise NotImplementedError


# --- admission rules shared by several bundles -------------------------------------------------

def terminal_only(ctx: AdmissionContext) -> list[int]:
    """vLLM align mode: one state at the block-aligned end of each request."""
    return [ctx.end_pages] if ctx.end_pages > ctx.start_pages else []


def branch_point(ctx: AdmissionContext) -> list[int]:
    """The observed branch-off point, where the request leaves the cached path inside the segment
    (Marconi's insight; SGLang's `mamba_branching_seqlen`, unified_cache/components/mamba.py:175-194)."""
    return [ctx.kv_match_pages] if ctx.start_pages < ctx.kv_match_pages < ctx.end_pages else []


def terminal_and_branch(ctx: AdmissionContext) -> list[int]:
    """Marconi admission: the request end plus the branch-off point where it leaves the tree."""
    return branch_point(ctx) + terminal_only(ctx)


def fixed_grid(ctx: AdmissionContext, interval_pages: int) -> list[int]:
    """A state every `interval_pages` (absolute grid) plus the terminal one."""
    first = (ctx.start_pages // interval_pages + 1) * interval_pages
    return list(range(first, ctx.end_pages, interval_pages)) + terminal_only(ctx)


def step_ends(ctx: AdmissionContext) -> list[int]:
    """Where the prefill's forward passes ended, as the executor reported them; without a report,
    chunks of `config.chunk_pages` from the reused prefix (a lone request's chunked prefill)."""
    if ctx.step_end_pages:
        return [p for p in ctx.step_end_pages if ctx.start_pages < p <= ctx.end_pages]
    chunk = ctx.config.chunk_pages
    return list(range(ctx.start_pages + chunk, ctx.end_pages, chunk)) + terminal_only(ctx)


def align_mode(ctx: AdmissionContext) -> list[int]:
    """vLLM's `mamba_cache_mode="align"` with its dense retention (v0.24.0; the paper's v0.27.1 era), the one
    definition every "align" policy uses (the vllm-* baselines, histate-align's prompt half):
    * prefill: a state at the end of every scheduler step, and only there; the scheduler cuts each step
      on a block boundary and forces a step end at the prompt's last one (config/cache.py:133-141 "only
      cache the mamba state of the last token of each scheduler step ... at position i * block_size";
      v1/core/sched/scheduler.py:357-372 `num_new_tokens // block_size * block_size`, "force to cache
      the last chunk"); the tail past it is prefilled with no state;
    * decode: the state at every block boundary the output crosses, cached as the running state moves
      to its next block (v1/core/kv_cache_manager.py:452-456 caches blocks every step,
      v1/worker/mamba_utils.py:726-741 copies the state forward, single_type_kv_cache_manager.py:1084-1103
      frees the old block with its hash). (vLLM since #52216 defaults to retaining only the replay
      boundary and junctions: `vllm-current`.)
    Step ends come from the executor (`step_ends`); decode crossings on the policy's block grid."""
    return step_ends(ctx) + decode_crossings(ctx, ctx.config.block_pages)


def turn_boundaries(ctx: AdmissionContext) -> list[int]:
    """Marconi's turn-boundary admission (MLSys 2025) on vLLM's blocks: a state where each turn ends -- the
    prompt's last block boundary and the last block boundary its output reached, which the next turn
    resumes from -- and where the request branches off the cached path (vLLM's Marconi-style junction,
    v1/core/sched/scheduler.py:377-385 in v0.24.0), nothing at interior step ends or other decode
    crossings: the paper's "align mode with the turn-boundary checkpoint strategy of Marconi"."""
    return terminal_and_branch(ctx) + last_decode_state(ctx, ctx.config.block_pages)


def last_decode_state(ctx: AdmissionContext, grid_pages: int) -> list[int]:
    """The deepest decode position on an absolute `grid_pages` grid that the output crossed: the one
    state a finished request donates when decode tracks states on a grid (SGLang)."""
    if ctx.output_end_pages is None:
        return []
    deepest = ctx.output_end_pages // grid_pages * grid_pages
    return [deepest] if deepest > ctx.end_pages else []


def decode_crossings(ctx: AdmissionContext, grid_pages: int) -> list[int]:
    """Every grid position the output crossed (vLLM align mode caches the state at each block
    boundary decode crosses)."""
    if ctx.output_end_pages is None:
        return []
    first = ctx.end_pages // grid_pages * grid_pages + grid_pages
    return list(range(first, ctx.output_end_pages + 1, grid_pages))
