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
    near_end_stride: int = 1
    """Node units per page of the near-end prior: 1 when nodes count pages (the core's tree); the page
    in tokens when an executor's tree is token-granular (SGLang's), so p'_k still means k pages."""
    checkpoint_demotion_tier: tuple = ()
    """`demotion_tier` for a checkpoint unit, where checkpoints skip a tier (HiState: the host holds KV,
    a checkpoint leaving the device goes to SSD). Empty: the same as `demotion_tier`."""

    @classmethod
    def of(cls, config, terminal_prob: float, near_end_probs: tuple = (), restore_cost: tuple = (),
           demotion_tier: tuple = (), node_unit_tokens: "int | None" = None,
           checkpoint_demotion_tier: tuple = ()) -> "ScoringContext":
        """The context for nodes whose `keys` / `depth_pages` count `node_unit_tokens` tokens each
        (default: the config's page, the core's own tree)."""
        unit = config.page_num_tokens if node_unit_tokens is None else node_unit_tokens
        return cls(config.tau_s, unit, config.checkpoint_token_equiv, terminal_prob, near_end_probs,
                   restore_cost, demotion_tier, config.attention_pair_tokens, config.page_num_tokens // unit,
                   checkpoint_demotion_tier)
