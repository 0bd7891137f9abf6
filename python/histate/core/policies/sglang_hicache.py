"""SGLang 0.5.23 Unified Radix Cache + HiCache, as shipped (research/sglang-0.5.23.md §2-3).

Static split of every tier between states and KV (`--mamba-full-memory-ratio` 0.9 gives ~47%
states on the device; host pools mirror the split through `--hicache-ratio`); states only at node
ends (chunked-prefill chunk ends, the prompt end, branch points); a separate state LRU that
refreshes only the matched node; KV leaf LRU; write-through to host and storage.
"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, terminal_and_branch
from ..types import Tier

DEFAULT_STATE_FRACTION = 0.47


@register_policy
class SglangHiCache(Policy):
    name = "sglang-hicache"
    tiers = (Tier.GPU, Tier.CPU, Tier.SSD)
    write_through = True
    partitioned = True

    def admit(self, ctx: AdmissionContext) -> list[int]:
        chunk_pages = ctx.config.chunk_pages  # chunked prefill starts at c and stores a state per chunk end
        chunk_ends = range(ctx.start_pages + chunk_pages, ctx.end_pages, chunk_pages)
        return sorted(set(chunk_ends) | set(terminal_and_branch(ctx)))
