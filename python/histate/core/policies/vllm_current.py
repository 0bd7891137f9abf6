"""vLLM main as of late 2026, as a careful operator runs it for a hybrid model (issue 17).

Sources (vllm-project/vllm; line numbers where the code index had them, else function names, PRs and
the commit read):
* `vllm/config/cache.py`@002f10e `CacheConfig`: `mamba_cache_mode="align"` caches "the mamba state of
  the last token of each scheduler step ... at position i * block_size"; `prefix_match_unit` is "the
  finest token boundary a prefix-cache hit can land on ... It controls matching granularity only, not
  how often states are stored" (= `hash_block_size`); `prefix_cache_retention_interval` (default 0,
  #52216) "``0`` retains only semantic checkpoints, including the latest replay boundary and
  shared-prefix junctions. Positive values additionally retain periodic checkpoints at the specified
  interval ... ``None`` retains checkpoints densely."
* `MambaManager.reachable_block_mask` (#45845 for Mamba, #47782 keeps the junctions under sparse
  retention): with interval 0 only the state blocks ending on a reachable boundary are hashed -- the
  replay boundary `num_prompt - 1` floored to the hash unit, and the shared-prefix junctions; with
  N > 0 also the block ending on every multiple of N; `None` hashes every block.
* Marconi-style admission (#37898, `Scheduler` reading `num_uncached_common_prefix_tokens`): when the
  full-attention KV hit runs at least a block past the state hit, the prefill is split to cache the
  state "at the last block-aligned position" of the shared prefix (the second request sharing it).
* Partial-block hits (#45939 [1/N], #46384 [2/N], RFC #45702): hashes every `prefix_match_unit`
  tokens, a partially filled block is reachable through an alias key for the prompt's final
  boundary, so a hit and the retained replay boundary land on the unit, not the 576-token block;
  interior shared boundaries inside a block are not retained (user report on #46384). Memory is still
  allocated in whole blocks and a state is still one block per mamba group (costs.vllm_hybrid_blocks).
* Internal prefill checkpoints (#52789 Kimi-K3/FlashKDA; #53614 with partial hits,
  `get_mamba_prefill_checkpoint_position` = `(num_tokens - 1) // hash_block_size * hash_block_size`):
  the replay-boundary state is read out inside the last forward instead of splitting the prefill at
  the last block boundary, which saves that extra forward pass (engine chunk rule "vllm-internal",
  sim/engine.py). One internal checkpoint per forward: it adds no interior positions (#54076 review).
  For GDN (Qwen3.5) the port is open (RFC #52959, Mamba2 #57329, GLM #56960); the most favourable
  version for vLLM is assumed: Qwen3.5 has it.
* Decode states: align mode keeps the state at block crossings only densely; with interval 0 they are
  not reachable boundaries and are never hashed; retaining finalized decode checkpoints is #50551
  (open). So with interval 0 no state past the prompt is cached (its KV blocks are).
* Offload: the native `OffloadingConnector` "never yields a CPU-tier hit for a hybrid model once the
  prompt is longer than one full-attention chunk" (#57216, open); every Weka prompt is longer, so a
  CPU tier would only cost D2H traffic. `SimpleCPUOffloadConnector` (#37160) shipped without Mamba
  hybrids ("not yet hybrid models with Mamba"); its hybrid fixes #53917 / #54735 were closed, only
  the fine-grained loading #54736 merged. A careful operator therefore runs GPU-only;
  `vllm-current-cpu` is the what-if in which the CPU tier serves hybrid hits anyway.

Retention interval: the operator's choice, made on the robustness table like sglang-tuned's options
(docs/policies.md, "vllm-current"); kept: `RETENTION_INTERVAL_PAGES`.
Approximated, stated: KV is ledgered per 64-token page (the partial tail block is not charged whole);
the prompt-end state sits at the last full page (vLLM's `(L - 1) // unit` differs by one page when L is
a multiple of 64); an inserted output keeps its partial last block.
"""
from __future__ import annotations

from typing import Optional

from . import register_policy
from .base import AdmissionContext, Policy
from ..types import Tier

RETENTION_INTERVAL_PAGES: Optional[int] = 0
"""`--prefix-cache-retention-interval` in 64-token pages: 0 (the default, semantic checkpoints only),
None (dense) or a multiple of the 9-page block."""


@register_policy
class VllmCurrent(Policy):
    name = "vllm-current"
    tiers = (Tier.GPU,)
    block_granular = True            # 576-token allocation blocks, a state = one block per mamba group
    partial_block_hits = True        # --prefix-match-unit 64: hits and the replay boundary on the page
    internal_prefill_checkpoints = True
    engine = "vllm"
    retention_interval_pages: Optional[int] = RETENTION_INTERVAL_PAGES

    def admit(self, ctx: AdmissionContext) -> list[int]:
        block = ctx.config.block_pages
        positions = set()
        if ctx.end_pages > ctx.start_pages:
            positions.add(ctx.end_pages)  # the replay boundary (reachable_boundaries)
        junction = ctx.kv_match_pages // block * block  # Marconi-style, block-aligned (#37898)
        if ctx.start_pages < junction < ctx.end_pages:
            positions.add(junction)
        interval = self.retention_interval_pages
        if interval != 0:  # periodic (N) or dense (None) retention of the states the steps left
            grid = block if interval is None else interval
            ends = [p for p in ctx.step_end_pages if ctx.start_pages < p <= ctx.end_pages]
            if ctx.output_end_pages is not None:  # align mode caches the state at every block crossing
                first = ctx.end_pages // block * block + block
                ends += range(first, ctx.output_end_pages + 1, block)
            positions.update(p for p in ends if p % grid == 0)
        return sorted(positions)


@register_policy
class VllmCurrentCpu(VllmCurrent):
    """What-if: `vllm-current` plus a CPU tier that serves hybrid hits (write-through, LRU), as if
    `SimpleCPUOffloadConnector` handled Qwen3.5's Mamba groups (unverified upstream; module docstring)."""

    name = "vllm-current-cpu"
    tiers = (Tier.GPU, Tier.CPU)
    write_through = True
