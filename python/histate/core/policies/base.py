"""The policy interface: what differs between HiState, its ablations and the baselines.

A policy is a small class: a few flags (which tiers, inclusive or exclusive placement, where
historical checkpoints go, refresh rule, static split) and two decisions:
  admit(ctx)                   -> checkpoint depths (pages) for a request's new segment
  score(ctx, node, unit, bit)  -> eviction priority; the lowest is evicted first. `ctx` is a
                                  `ScoringContext` (never the cache); `node` anything with the core
                                  node's read-only shape (docs/core-api.md). Contract: a score is never
                                  below the unit's last access time (GreedyDual form t + non-negative
                                  term), which lets the victim heap rank lazily (victims.py).
Policies never mutate the tree; the cache applies their decisions (docs/policies.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


class Policy:
    name = ""
    tiers: tuple = (Tier.GPU,)
    write_through = False  # True: every new item is copied down all tiers (inclusive, LRU offload)
    historical_tier: Optional[Tier] = None  # tier for non-terminal checkpoints at creation
    refresh_all = False  # on a checkpoint hit, refresh every checkpoint above it on the path
    partitioned = False  # static KV/state split per tier (SGLang); else one shared pool per tier
    dense_checkpoints = False  # `unlimited`: a state at every page boundary
    unbounded = False  # ignore configured capacities
    learns_reuse_positions = False  # learn where interior hits land near a trajectory's end (PolicyState)
    charges_demotions = False  # eq. 7's C of a demoted unit is its transfer, not its recompute (units.py)
    estimates_residence_by_flow = True  # Little's-law T_KV / T_state before residences are observed

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return terminal_only(ctx)

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        return last_access_s(node, unit, bit)


# --- admission rules shared by several bundles -------------------------------------------------

def terminal_only(ctx: AdmissionContext) -> list[int]:
    """vLLM align mode: one state at the block-aligned end of each request."""
    return [ctx.end_pages] if ctx.end_pages > ctx.start_pages else []


def terminal_and_branch(ctx: AdmissionContext) -> list[int]:
    """Marconi admission: the request end plus the branch-off point where it leaves the tree."""
    positions = terminal_only(ctx)
    if ctx.start_pages < ctx.kv_match_pages < ctx.end_pages:
        positions.insert(0, ctx.kv_match_pages)
    return positions


def fixed_grid(ctx: AdmissionContext, interval_pages: int) -> list[int]:
    """A state every `interval_pages` (absolute grid) plus the terminal one."""
    first = (ctx.start_pages // interval_pages + 1) * interval_pages
    return list(range(first, ctx.end_pages, interval_pages)) + terminal_only(ctx)
