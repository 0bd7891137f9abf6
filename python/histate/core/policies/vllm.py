"""vLLM baselines (paper §4.1), vLLM v1 in `mamba_cache_mode="align"` (vllm-project/vllm:
v1/core/sched/scheduler.py@00024d3, v1/core/single_type_kv_cache_manager.py@129ab7c).

Granularity: the hybrid allocator pads the attention block until one page holds a layer's recurrent
state (`HybridAttentionMambaModelConfig.verify_and_update_config`: 576 tokens for Qwen3.5-9B) and
hashes, caches and hits whole blocks (`FullAttentionManager.find_longest_cache_hit`: max_length //
block_size); a state takes one block in each mamba group (3 blocks for Qwen3.5-9B). Block size and
state size come from the model (`histate.sim.costs.vllm_hybrid_blocks`).

Which states exist: `base.align_mode` (file:line there, vLLM v0.24.0): align mode ends every prefill step on a
block boundary and forces a step end at the last block boundary of the prompt; the state at each step
end stays cached after the request moves on (freed to the block pool, where it remains hashed until
reused); decode caches the state at every block boundary it crosses. Plus Marconi's branch-off point
(the paper's turn-boundary admission; vLLM's shared-prefix junction). Full KV blocks of prompt and output
are cached. Eviction: block LRU.

vllm-marconi  one shared GPU block pool for KV and states.
vllm-cpu      the same plus write-through offload to CPU DRAM, LRU in every tier.
vllm-disk     the same plus write-through offload to CPU DRAM and disk.
vllm-disk-turns  vllm-disk with Marconi's turn-boundary admission only (`base.turn_boundaries`): the state
              where each turn's prompt and output end and at the branch-off point, no step-end or other
              decode states (issue 28: the paper's vLLM-Disk* beside align mode's).
"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, align_mode, branch_point, turn_boundaries
from ..types import Tier


@register_policy
class VllmMarconi(Policy):
    name = "vllm-marconi"
    tiers = (Tier.GPU,)
    block_granular = True
    engine = "vllm"

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return align_mode(ctx) + branch_point(ctx)


@register_policy
class VllmCpu(VllmMarconi):
    name = "vllm-cpu"
    tiers = (Tier.GPU, Tier.CPU)
    write_through = True


@register_policy
class VllmDisk(VllmMarconi):
    name = "vllm-disk"
    tiers = (Tier.GPU, Tier.CPU, Tier.SSD)
    write_through = True


@register_policy
class VllmDiskTurns(VllmDisk):
    """vllm-disk with Marconi's turn-boundary admission instead of align mode's step ends and decode
    crossings (`turn_boundaries`): what the paper's vLLM-Disk* keeps, read as turn boundaries only."""

    name = "vllm-disk-turns"

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return turn_boundaries(ctx)
