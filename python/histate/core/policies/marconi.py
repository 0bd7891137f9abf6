"""Marconi (Pan et al., MLSys 2025) as published: GPU only, request-end + branch-off admission,
eviction by recency plus FLOP efficiency (whole-prefix recompute saved per byte freed), no access
probability weighting and no checkpoint sparsification beyond that score."""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, terminal_and_branch
from ..types import Tier, UnitKind
from ..units import last_access_s, reclaim_tokens


@register_policy
class Marconi(Policy):
    name = "marconi"
    tiers = (Tier.GPU,)

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return terminal_and_branch(ctx)

    def score(self, cache, node, unit: UnitKind, bit: int) -> float:
        cfg = cache.config
        saved = node.depth_pages * cfg.page_num_tokens
        reclaim = reclaim_tokens(node, unit, bit, cfg.page_num_tokens, cfg.checkpoint_token_equiv)
        return last_access_s(node, unit, bit) + cfg.tau_s * saved / reclaim
