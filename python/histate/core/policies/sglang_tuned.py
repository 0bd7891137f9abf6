"""SGLang 0.5.23 as a careful operator runs it for hybrid agent traffic (issue 17): HiCache on a unified
device pool, session-referenced KV, and the best of SGLang's eviction and state-cap options on the
whole robustness table (docs/policies.md, "sglang-tuned": the options compared and the numbers).
Paths are relative to the installed wheel's `sglang/srt/`; everything `sglang-hicache` models that
these options do not change is kept from it (placement of states, insert end, host split, L3).

`--enable-unified-memory` (arg_groups/fields/memory.py:78-85): one byte buffer holds full-attention KV
and Mamba states (mem_cache/unified_memory_pool.py:14-24; the Mamba stack `init_unified_mamba_pools`,
:1593-1840: `mamba_full_memory_ratio` "governs the total budget only, not the runtime split",
:1829-1834). So the device tier is one pool (`shared_pool_tiers` has the GPU) and admission sees the
whole budget for KV (PrefillAdder counts a state as `mamba_slot_full_token_cost` tokens,
mem_cache/allocator/unified_mamba.py:179-190). Under it, a KV allocation evicts FULL leaves only, and
a state allocation first evicts FULL KV as the byte donor, Mamba victims only when KV cannot fund it
(`evict_for_alloc`, mem_cache/unified_radix_cache.py:697-778): device states leave with their node's KV
(FULL's eviction cascades to MAMBA, unified_cache/unified_tree_core.py:2125-2210), so they rank after
all KV on the device (`score`) and a KV eviction takes the node's state (`kv_eviction_takes_state`).
HiCache still builds separate KV and Mamba host pools (the shared host arena is for SWA only,
mem_cache/hybrid_cache/hybrid_pool_assembler.py:343-360; host capacities from the boot token and slot
counts, unified_memory_pool.py:1586-1588, 1774-1776): the host keeps `sglang-hicache`'s 47% state
split (approximated: the exact boot counts depend on memory profiling; the Mamba host pool is sized
from the whole buffer's slot count, so if anything states get more of the host than modelled).

`--enable-session-radix-cache` (fields/memory.py:86-89): each finished request tags the path its insert
ended on with its session; FULL victims are ordered by (referenced, reference count, strategy) on the
device and the host (unified_cache/components/full.py:205-220, 250-266); the Mamba LRU walks
unreferenced states first (unified_tree_core.py:230-258, mamba.py:373-383, 1012-1056); a Mamba leaf
eviction spares KV a session still references (components/base.py:192-202). Sessions are the replay's
sessions (a subagent is its own session), closed when their last request completes; the mechanics are
core/sessions.py. The L3 file store's LRU knows no sessions (storage/file/lru_file_evictor.py).

`--radix-eviction-policy` (fields/memory.py:25-63; strategies mem_cache/evict_policy.py, factory
mem_cache/utils.py:60-84) orders FULL victims only; the Mamba LRU is not configurable (mamba.py:
127-149). `lru`: last access; `slru`: (hit_count >= protected_threshold, last access); `tlru`: a node
whose parent's cached depth already covers the branch's high-water depth + next_prompt_estimate -
threshold tokens is "TEL-safe" and goes first, then LRU (evict_policy.py: tlru 49-82, slru 84-100;
depths kept at insert and split, unified_tree_core.py:191-210, 1474-1485); `priority`: (request
priority, last access) is LRU here, the traces carry no priorities. `hit_count` counts the inserts
that walked a node (unified_tree_core.py:1104-1123, 1368-1374).

`--mamba-max-states-per-path N` (fields/exec_.py:497-503): after every insert the shallowest device
states of the path beyond N lose their device copy, KV and host copy kept; the tail, forks, device
leaves and locked nodes are spared (mamba.py:255-320; `HybridPrefixCache._cap_path_states`).

Chosen (benchmark/baseline_options.py, seed 0, all ten rows of benchmark/robustness.py; numbers in
docs/policies.md): `slru` with SGLang's default protected_threshold 2 and no state cap. Against `lru`
it has the lowest geometric-mean p95 (0.90x) and p99 (0.93x) and the highest mean hit rate of the
candidates run on all ten rows (lru, slru 2 / 3, tlru 8K, caps 1 / 2 / 4 / 8, slru 2 with caps 2 / 4 /
8, lru without session references; tlru 32K and int8 ran on the base row only); the gain comes mostly
from the SSD-bound row (ssd75: p95 10.2 -> 4.0 s, hit 89.6 -> 94.7%), elsewhere every candidate is
within seed noise of lru.

Left out, stated: `--enable-int8-mamba-checkpoint` is rejected together with HiCache
(arg_groups/mamba_hook.py:75-99: "the host-offload path is not int8-aware") and does nothing under
unified memory (the unified pool leaves `mamba_ckpt_pool` None: unified_memory_pool.py:1469), so it
cannot join this configuration; measured separately on a device-only static split, where it loses to
every HiCache variant (docs/policies.md).
"""
from __future__ import annotations

from . import register_policy
from .sglang_hicache import SglangHiCache
from ..scoring import ScoringContext
from ..types import GPU_BIT, SSD_BIT, Tier, UnitKind
from ..units import last_access_s

STRATEGY_S = 1e7
"""Score offset of a strategy's higher class (slru protected, tlru not TEL-safe): above any simulated
time, so the class decides before recency, as SGLang's tuple keys do."""
SESSION_S = 1e8
"""Score offset per session reference: above every strategy class (referenced KV goes last)."""
STATES_LAST_S = 1e13
"""Score offset of a device state: with a unified pool it leaves with its node's KV, or only when no
KV can fund an allocation. Offsets stay below 2^53 x 1 ms of simulated time (float64 resolution)."""

STRATEGIES = ("lru", "slru", "tlru", "priority")


@register_policy
class SglangTuned(SglangHiCache):
    """`--enable-hierarchical-cache --enable-unified-memory --enable-session-radix-cache
    --radix-eviction-policy slru` (protected_threshold 2, its default); defaults for the rest:
    `write_through`, the host sized to the budget, extra_buffer, `--mamba-track-interval 256`,
    `--mamba-max-states-per-path -1`. Chosen on the robustness table (module docstring)."""

    name = "sglang-tuned"
    shared_pool_tiers = (Tier.GPU, Tier.SSD)
    session_refs = True
    kv_eviction_takes_state = True
    eviction_strategy = "slru"
    slru_protected_threshold = 2  # evict_policy.py:85 default
    tlru_threshold_tokens = 0  # evict_policy.py:65 defaults (0, 0): then tlru equals lru
    tlru_next_prompt_tokens = 0

    def __init__(self) -> None:
        if self.eviction_strategy not in STRATEGIES:
            raise ValueError(f"{self.name}: unknown eviction strategy {self.eviction_strategy!r}")
        self.tracks_node_stats = self.eviction_strategy in ("slru", "tlru")

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        t = last_access_s(node, unit, bit)
        if bit == SSD_BIT:
            return t  # HiCacheFile: one LRU over files, no sessions
        if unit is UnitKind.CHECKPOINT:
            referenced = SESSION_S if node.state_session_ref > 0 else 0.0
            return t + referenced + (STATES_LAST_S if bit == GPU_BIT else 0.0)
        return t + SESSION_S * node.session_ref + self._strategy_class(ctx, node)

    def _strategy_class(self, ctx: ScoringContext, node) -> float:
        strategy = self.eviction_strategy
        if strategy == "slru":
            return STRATEGY_S if node.hit_count >= self.slru_protected_threshold else 0.0
        if strategy == "tlru":
            unit = ctx.page_num_tokens
            budget = max(node.history_pages * unit + self.tlru_next_prompt_tokens - self.tlru_threshold_tokens, 0)
            cached_without_node = (node.depth_pages - len(node.keys)) * unit
            return 0.0 if cached_without_node >= budget else STRATEGY_S
        return 0.0  # lru; priority without request priorities
