"""histate.core: the pure policy engine (no torch, sglang, I/O or wall clock). API: docs/core-api.md."""
from .cache import HybridPrefixCache, InsertResult, RequestLease, make_cache
from .config import CacheConfig
from .interval import IntervalController, choose_interval_pages, continuous_optimum_pages, recompute_cost_pages
from .policies import Policy, available_policies, make_policy, register_policy
from .stats import CacheStats
from .types import (ConfigError, HiStateError, InvariantViolation, ItemKind, MatchResult, Tier, TierOp,
                    UnitKind)

__all__ = [
    "CacheConfig", "CacheStats", "ConfigError", "HiStateError", "HybridPrefixCache", "InsertResult",
    "IntervalController", "InvariantViolation", "ItemKind", "MatchResult", "Policy", "RequestLease", "Tier",
    "TierOp", "UnitKind", "available_policies", "choose_interval_pages", "continuous_optimum_pages",
    "make_cache", "make_policy", "recompute_cost_pages", "register_policy",
]
