"""SGLang 0.5.23 Unified Radix Cache + HiCache, as shipped (research/sglang-0.5.23.md §2-3,
research/sim-fidelity.md §1). Paths below are relative to the installed `sglang/srt/`.

Placement: a static split of the device and host tiers between states and KV
(`--mamba-full-memory-ratio` 0.9 gives ~47% states, arg_groups/fields/schedule.py:220-227; host pools
mirror the split, mem_cache/hybrid_cache/hybrid_pool_assembler.py:239-254); the L3 file store is one
pool with one LRU for KV pages and mamba objects (mem_cache/storage/file/lru_file_evictor.py:1-25);
write-through to host and storage (mem_cache/unified_radix_cache.py:558-560).

Which states exist: one tracked state per forward pass, at the pass's end on the 64-token grid from
the request's prefix, or at the branch point when it falls inside that pass (it replaces the pass's
state: managers/schedule_batch.py:3177-3232); a finished request donates the last state decode tracked
on the 256-token grid (`--mamba-track-interval`, managers/schedule_batch.py:3815-3816,
scheduler_components/batch_result_processor.py:1401-1406, unified_cache/components/mamba.py:582-602).
Every insert stops at the state it donates (`effective_cache_len`, unified_radix_cache.py:1186-1199):
KV past the last state is not cached.

Eviction: KV leaf LRU refreshed along the matched path (unified_cache/components/full.py:209-246); a
separate state LRU refreshed at the matched node only (mamba.py:127-149); when the state LRU reaches a
device (or host) leaf it evicts the leaf whole, KV included (mamba.py:415-421, 1012-1069).
"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, last_decode_state, step_ends
from ..config import DEFAULT_STATE_FRACTION  # noqa: F401  (re-exported: where readers of this policy look)
from ..types import Tier


@register_policy
class SglangHiCache(Policy):
    name = "sglang-hicache"
    tiers = (Tier.GPU, Tier.CPU, Tier.SSD)
    write_through = True
    partitioned = True
    shared_pool_tiers = (Tier.SSD,)
    kv_ends_at_last_state = True
    state_evicts_leaf = True

    def admit(self, ctx: AdmissionContext) -> list[int]:
        positions, prev = [], ctx.start_pages
        for end in step_ends(ctx):
            if end > prev:  # a pass shorter than the 64-token grid tracks nothing
                positions.append(ctx.kv_match_pages if prev < ctx.kv_match_pages < end else end)
                prev = end
        return positions + last_decode_state(ctx, ctx.config.decode_track_pages)
