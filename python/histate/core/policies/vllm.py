"""vLLM baselines (paper §4.1).

vllm-marconi  vLLM align mode with Marconi's turn-boundary admission (request end + branch-off
              point), one shared GPU page pool for KV and states, block LRU.
vllm-cpu      the same plus write-through offload to CPU DRAM, LRU in every tier.
vllm-disk     the same plus write-through offload to CPU DRAM and disk.
"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, terminal_and_branch
from ..types import Tier


@register_policy
class VllmMarconi(Policy):
    name = "vllm-marconi"
    tiers = (Tier.GPU,)

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return terminal_and_branch(ctx)


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
