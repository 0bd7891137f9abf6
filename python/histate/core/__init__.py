"""histate.core: the pure policy engine (no torch, sglang, I/O or wall clock). API: docs/core-api.md.

Executors (histate.sim, histate.reference, histate.sglang_plugin, the CLI) import only the names in
`__all__` (test/core/test_layering.py checks it), so everything they share is visible here.
"""
from .cache import HybridPrefixCache, InsertResult, RequestLease, make_cache
from .capture import PassCaptures, captured_positions, floor_cut, split_pass
from .l3_ledger import L3Deletes, L3Ledger, L3LedgerConfig, fleet_share_bytes
from .l3_policy import DEFAULT_PIN_TTL_S, L3Put, L3WriteConfig, plan_l3_writes, restorable_pages
from .config import (DECODE_TRACK_INTERVAL_TOKENS, DEFAULT_CHUNK_PAGES, DEFAULT_EMA_ALPHA, DEFAULT_FIXED_INTERVAL_PAGES, DEFAULT_INTERVALS_PAGES,
                     DEFAULT_INTERVALS_TOKENS, DEFAULT_RESTORE_COST_TOKENS, DEFAULT_TAU_S, DEFAULT_TERMINAL_HIT_PRIOR,
                     MIN_STAGING_SLOTS, SESSION_RANK_OFFSET_S, STATE_GRID_TOKENS, CacheConfig, default_staging_slots)
from .interval import Ema, IntervalController, choose_interval_pages, continuous_optimum_pages, recompute_cost_pages
from .misses import (DEFAULT_MAX_KEYS as MISS_HISTORY_MAX_KEYS, REASONS as MISS_REASONS, Departure, LatestDecision,
                     MissAttribution, MissHistory, MissRecorder, attribute_misses)
from .observer import CacheObserver, ObserverGroup
from .policies import AdmissionContext, Policy, available_policies, make_policy, register_policy, with_host_write_policy
from .tier_plan import TierPlan
from .prefill_order import DEFAULT_MAX_YIELDS, ShortPrefillFirst, prefill_work_tokens
from .policy_state import PolicyState
from .scoring import ScoringContext
from .sessions import SessionRefs
from .stats import CacheStats
from .types import (ALL_TIERS, CPU_BIT, GPU_BIT, SGLANG_TIER_NAMES, SSD_BIT, ConfigError, HiStateError,
                    InvariantViolation, ItemKind, MatchResult, Tier, TierOp, UnitKind, fastest_tier)
from .units import checkpoint_at_or_above, checkpoint_neighbours, checkpoints_above_removed_leaf, units_of
from .victims import DeferredReoffers, VictimHeap, reoffer
from .write_policy import WRITE_BACK, WRITE_BACK_MAX_HOST_TO_DEVICE, WRITE_THROUGH, auto_host_write_policy

__all__ = [
    "L3Deletes", "L3Ledger", "L3LedgerConfig", "fleet_share_bytes",
    "DEFAULT_PIN_TTL_S", "L3Put", "L3WriteConfig", "plan_l3_writes", "restorable_pages",
    "ALL_TIERS", "AdmissionContext", "CPU_BIT", "CacheConfig", "CacheObserver", "CacheStats", "ConfigError", "DECODE_TRACK_INTERVAL_TOKENS",
    "DEFAULT_CHUNK_PAGES", "DEFAULT_MAX_YIELDS",
    "DEFAULT_EMA_ALPHA", "DEFAULT_FIXED_INTERVAL_PAGES", "DEFAULT_INTERVALS_PAGES", "DEFAULT_INTERVALS_TOKENS",
    "DEFAULT_RESTORE_COST_TOKENS",
    "DEFAULT_TAU_S", "DEFAULT_TERMINAL_HIT_PRIOR", "Ema", "GPU_BIT", "HiStateError", "HybridPrefixCache",
    "InsertResult", "IntervalController", "InvariantViolation", "ItemKind", "MIN_STAGING_SLOTS", "MatchResult",
    "PassCaptures", "Policy", "PolicyState", "RequestLease", "SESSION_RANK_OFFSET_S", "ShortPrefillFirst", "SGLANG_TIER_NAMES", "SSD_BIT", "STATE_GRID_TOKENS",
    "DeferredReoffers", "Departure", "LatestDecision", "MISS_HISTORY_MAX_KEYS", "MISS_REASONS", "MissAttribution", "MissHistory",
    "MissRecorder", "ObserverGroup", "ScoringContext", "SessionRefs", "attribute_misses", "Tier", "TierOp", "TierPlan", "UnitKind", "VictimHeap", "available_policies", "captured_positions",
    "checkpoint_at_or_above", "checkpoint_neighbours", "checkpoints_above_removed_leaf", "choose_interval_pages",
    "continuous_optimum_pages", "default_staging_slots", "fastest_tier", "floor_cut", "make_cache", "make_policy", "with_host_write_policy", "prefill_work_tokens",
    "recompute_cost_pages", "register_policy", "reoffer", "split_pass", "units_of",
    "WRITE_BACK", "WRITE_BACK_MAX_HOST_TO_DEVICE", "WRITE_THROUGH", "auto_host_write_policy",
]
