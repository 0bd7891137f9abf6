"""What an eviction score may read besides the node: `ScoringContext`.

Policy.score(ctx, node, unit, bit) sees this small frozen record and the node, never the cache, so
every executor (the core's own tree, the SGLang plugin's view of SGLang's tree) scores with the same
inputs and no policy can reach into an executor's state.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScoringContext:
    tau_s: float
    """Eq. 7 time scale (seconds of recency per unit of recompute-per-byte)."""
    page_num_tokens: int
    """Tokens per unit of `node.keys` / `node.depth_pages` (1 when an executor's tree is token-granular)."""
    checkpoint_token_equiv: float
    """N_s: one checkpoint in tokens of KV (M of a checkpoint unit)."""
    terminal_prob: float
    """q: EMA of hits that land at a trajectory's end; interior positions share 1 - q."""
    near_end_probs: tuple = ()
    """p'_k, k = 1..window: P(an interior hit lands k pages before its trajectory's end), learned; the
    rest of the interior mass, 1 - sum(p'), is spread uniformly (the paper's p_t). Empty: uniform."""
    restore_cost: tuple = ()
    """Per tier index: recompute-tokens it costs to restore one token of KV from that tier (0 for the
    GPU). Empty: every eviction is charged its recompute (the paper's C)."""
    demotion_tier: tuple = ()
    """Per tier index: the tier index a unit evicted from it moves to, or -1 when it is dropped."""
    attention_pair_tokens: float = 0.0
    """One attention (query, key) pair in per-token FLOPs (CacheConfig.attention_pair_tokens)."""

    @classmethod
    def of(cls, config, terminal_prob: float, near_end_probs: tuple = (), restore_cost: tuple = (),
           demotion_tier: tuple = ()) -> "ScoringContext":
        return cls(config.tau_s, config.page_num_tokens, config.checkpoint_token_equiv, terminal_prob,
                   near_end_probs, restore_cost, demotion_tier, config.attention_pair_tokens)
