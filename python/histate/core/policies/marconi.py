"""Marconi (Pan et al., MLSys 2025), aligned with its reference code (ruipeterpan/marconi@0801661,
radix_cache_hybrid.py; paper-faithful where the code and the paper agree).

Admission (`RadixCache.insert`): input and output are inserted, with the state after the last
decoded token and a state at the branch-off node a split creates.
Refresh (`match_prefix`, policy versions 2/3): only the last matched node's timestamp; inserts do not
refresh the path.
Eviction (`evict_v2`): candidates are the nodes with at most one child
(`_collect_leaf_and_single_child_nodes`); a leaf goes whole (state + KV), a single-child node gives up
its state only and folds into its child (`_evict_intermediate_node`). Utility =
alpha * minmax(FLOP efficiency) + minmax(1 / (now - last access)); the lowest utility is evicted.
FLOP efficiency = FLOPs the node saves relative to its parent (linear work on its own segment plus the
quadratic attention between the parent's and its own depth) / memory of the whole prefix (one state +
KV of every token up to the node). Marconi re-tunes alpha by replaying the recent window with 21
values in [0, 2] (`config_tuner.py`); the tuner is not modelled: alpha is fixed at `FLOP_WEIGHT`.
"""
from __future__ import annotations

from typing import Optional, Sequence

from . import register_policy
from .base import AdmissionContext, Policy, branch_point
from ..scoring import ScoringContext
from ..types import Tier, UnitKind
from ..units import last_access_s

FLOP_WEIGHT = 2.0
"""alpha: the top of Marconi's tuning grid, and the best value at 30% capacity on the synthetic agent
trace of research/sim-fidelity.md experiment M1 (53.9% vs 46.5% for LRU)."""

_MIN_AGE_S = 1e-3  # Marconi's logical clock never repeats a timestamp; simulated time can


@register_policy
class Marconi(Policy):
    name = "marconi"
    tiers = (Tier.GPU,)
    refresh_matched_only = True
    scan_victims = True
    engine = "vllm"

    def admit(self, ctx: AdmissionContext) -> list[int]:
        last = ctx.end_pages if ctx.output_end_pages is None else ctx.output_end_pages
        return branch_point(ctx) + ([last] if last > ctx.start_pages else [])

    def choose_victim(self, ctx: ScoringContext, candidates: Sequence[tuple], now_s: float) -> Optional[int]:
        eligible, efficiency, recency = [], [], []
        for i, (node, unit, t) in enumerate(candidates):
            num_children = len(node.children)
            if num_children > 1 or (unit is UnitKind.BUNDLE) != (num_children == 0):
                continue
            total = node.depth_pages * ctx.page_num_tokens
            parent = total - len(node.keys) * ctx.page_num_tokens
            saved = total - parent + ctx.attention_pair_tokens * (total * total - parent * parent) / 2
            efficiency.append(saved / (ctx.checkpoint_token_equiv + total))
            recency.append(1.0 / max(now_s - last_access_s(node, unit, 1 << t), _MIN_AGE_S))
            eligible.append(i)
        if not eligible:
            return None
        utility = [FLOP_WEIGHT * e + r for e, r in zip(_min_max(efficiency), _min_max(recency))]
        return eligible[utility.index(min(utility))]


def _min_max(values: list) -> list:
    """Marconi's `utils._normalize`: scale to [0, 1]; all ones when the values do not vary."""
    lo, hi = min(values), max(values)
    if len(values) < 2 or lo == hi:
        return [1.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]
