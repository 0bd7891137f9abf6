"""Marconi (Pan et al., MLSys 2025): GPU only, request-end + branch-off admission, eviction by recency
plus FLOP efficiency: the recompute a node saves (its own segment back to the previous state, which
survives its eviction) per token-equivalent of memory freed. No access-probability weighting.

Marconi min-max normalises both terms over the candidates and weights them with a tuned alpha; a lazy
heap cannot normalise over the candidates, so the efficiency term is scaled by tau seconds instead.
(Counting the whole prefix as saved, instead of the segment, made deep leaves unevictable: 46% hit
rate on Weka, docs/results.md.)"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, terminal_and_branch
from ..scoring import ScoringContext
from ..types import Tier, UnitKind
from ..units import last_access_s, prev_checkpoint_depth, reclaim_tokens


@register_policy
class Marconi(Policy):
    name = "marconi"
    tiers = (Tier.GPU,)

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return terminal_and_branch(ctx)

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        saved = (node.depth_pages - prev_checkpoint_depth(node)) * ctx.page_num_tokens
        reclaim = reclaim_tokens(node, unit, bit, ctx.page_num_tokens, ctx.checkpoint_token_equiv)
        return last_access_s(node, unit, bit) + ctx.tau_s * saved / reclaim
