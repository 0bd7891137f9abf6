"""HiState (paper §3) and the ablations of Figure 10.

histate            adaptive intervals (eq. 5) + unified eviction (eq. 7) + asymmetric tiering, with eq. 3's
                   p_t learned online near each trajectory's end and, farther from it, by absolute depth
                   (departure from the paper's uniform p_t: docs/policies.md "Reuse-position prior")
histate-no-depth   histate without the depth half of the prior (ablation of core/depth_prior.py)
histate-paper      the paper's rules exactly: uniform interior prior, C = recompute for every eviction, the
                   neutral T_KV/T_state ratio until residences are observed (ablation of the departures)
histate-align      admission replaced by vLLM's align rule (`base.align_mode`: a state at every prefill pass end)
histate-fixed32    admission replaced by a fixed 32-page interval (+ terminal)
histate-lru-disk   unified eviction replaced by vLLM-Disk's LRU (no cost term, no refresh-all)
histate-sessions   the server under SGLang's --enable-session-radix-cache: units on a live session's path last,
                   on every tier (as sglang_plugin/eviction.py ranks them)
histate-writeback  the plugin under --hicache-write-policy write_back: KV reaches the host when the device evicts it,
                   each checkpoint goes to the SSD at creation (sglang_plugin/state_writes.py)
histate-writeback-via-host  write_back without those state writes: states reach the host with their node's KV when
                   the device evicts it, then the SSD (SGLang 0.5.23's own path; the plugin before 2026-12-07)
histate-exclusive  simulator only: exclusive tiers (KV demoted GPU -> CPU -> SSD on eviction, one copy at a
                   time), the tiering the SGLang plugin does not have (docs/policies.md "Tiering")

`histate` is what the SGLang plugin does (`--enable-histate`), on SGLang's scheduler (where the host KV pool
is at most 1.8x the device's, with an SSD tier and no L3, the plugin runs write_back by itself and `histate`
has `histate-writeback`'s rules: `with_host_write_policy`, core/write_policy.py; what follows is write_through):
* capture: the positions are planned when the request is first admitted and every planned position a
  prefill pass computes is kept, inside that pass (core/capture.py; sglang_plugin/capture.py); chunked-
  prefill cuts are floored to the state grid; a finished request donates the last state decode tracked
  on the 64-token grid, and the insert stops at the deepest state (sglang_hicache.py);
* tiers: SGLang's HiCache write-through for KV from device to host (the host keeps a copy of what the
  device holds); KV reaches the SSD when the host evicts it (HiState writes it there first), so the SSD
  holds what the faster tiers do not; a checkpoint is written through to the SSD, keeps its device copy
  while it is a trajectory's terminal state and lives on the SSD alone once it is historical (asymmetric
  tiering, paper §3.1). Host DRAM holds KV; its state slots only stage transfers, so checkpoints never
  occupy the CPU tier. Measured against exclusive and fully inclusive tiers in docs/results.md.
"""
from __future__ import annotations

from . import register_policy
from .base import AdmissionContext, Policy, align_mode, branch_point, fixed_grid, last_decode_state
from ..scoring import ScoringContext
from ..config import SESSION_RANK_OFFSET_S
from ..types import Tier, UnitKind
from ..write_policy import WRITE_BACK, auto_host_write_policy
from ..units import expected_cost_tokens, last_access_s, reclaim_tokens


@register_policy
class HiState(Policy):
    name = "histate"
    tiers = (Tier.GPU, Tier.CPU, Tier.SSD)
    write_through = True  # SGLang HiCache's write-through: KV device -> host, checkpoints -> SSD
    kv_write_through_tiers = (Tier.CPU,)  # the SSD is the host's victim tier for KV (docs/policies.md "Tiering")
    checkpoint_tiers = (Tier.GPU, Tier.SSD)  # the host's state slots stage transfers only
    historical_tier = Tier.SSD  # asymmetric tiering: a hit reads one checkpoint but all its KV
    captures_in_pass = True  # every planned position, inside the pass that computes it (core/capture.py)
    accepts_checkpoint_hints = True  # the application's named positions (docs/hints.md); baselines have no such API
    keeps_tool_wait = True  # CacheConfig.tool_wait: a waiting turn's path ranks last until its deadline (tool_wait.py)
    refresh_all = True
    kv_ends_at_last_state = True
    learns_reuse_positions = True
    learns_depth_positions = True
    charges_demotions = True
    decode_track_pages = 1  # --enable-histate sets SGLang's --mamba-track-interval to the 64-token state grid

    def admit(self, ctx: AdmissionContext) -> list[int]:
        return sorted(set(self.prompt_states(ctx)) | set(last_decode_state(ctx, self.decode_track_pages)))

    def prompt_states(self, ctx: AdmissionContext) -> list[int]:
        """Eq. 5 intervals over the new segment, the terminal, and the observed branch point."""
        return (ctx.controller.plan(ctx.start_pages, ctx.end_pages, ctx.now_s, ctx.near_end_probs, ctx.depth_bins)
                + branch_point(ctx))

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        """Eq. 7; a unit held by a live session (`histate-sessions`) or a waiting turn (tool-wait
        residency, core/tool_wait.py) ranks after every unheld one (both 0 on every node otherwise)."""
        cost = expected_cost_tokens(node, unit, bit, ctx)
        reclaim = reclaim_tokens(node, unit, bit, ctx.page_num_tokens, ctx.checkpoint_token_equiv)
        score = last_access_s(node, unit, bit) + ctx.tau_s * cost / reclaim
        return score + SESSION_RANK_OFFSET_S if node.session_ref > 0 or node.state_session_ref > 0 else score


@register_policy
class HiStateNoDepth(HiState):
    name = "histate-no-depth"
    learns_depth_positions = False


@register_policy
class HiStateNoDetector(HiState):
    """Ablation of the stable-prefix detector (docs/hints.md): without the observed branch point and
    the depth prior, nothing places a checkpoint where many prompts stop sharing unless eq. 5's grid
    happens to; application hints still apply."""
    name = "histate-no-detector"
    learns_depth_positions = False

    def prompt_states(self, ctx: AdmissionContext) -> list[int]:
        return ctx.controller.plan(ctx.start_pages, ctx.end_pages, ctx.now_s, ctx.near_end_probs, ctx.depth_bins)


@register_policy
class HiStatePaper(HiState):
    name = "histate-paper"
    learns_reuse_positions = False
    charges_demotions = False
    estimates_residence_by_flow = False


@register_policy
class HiStateAlign(HiState):
    name = "histate-align"

    def prompt_states(self, ctx: AdmissionContext) -> list[int]:
        """vLLM's align rule for the prompt (`base.align_mode`, the definition the vllm-* baselines use):
        a state at every prefill pass end, the prompt's last grid position included; decode states stay
        the engine's, as for every histate variant."""
        return [p for p in align_mode(ctx) if p <= ctx.end_pages]


@register_policy
class HiStateFixed32(HiState):
    name = "histate-fixed32"

    def prompt_states(self, ctx: AdmissionContext) -> list[int]:
        return fixed_grid(ctx, ctx.config.fixed_interval_pages)


@register_policy
class HiStateLruDisk(HiState):
    name = "histate-lru-disk"
    refresh_all = False

    def score(self, ctx: ScoringContext, node, unit: UnitKind, bit: int) -> float:
        return last_access_s(node, unit, bit)


@register_policy
class HiStateExclusive(HiState):
    """Exclusive tiers: one copy per item, KV and checkpoints demoted a tier at a time on eviction. What
    the simulator's `histate` did before the server-parity tiering; SGLang's HiCache cannot run it (its
    host tier is a write-through copy), so it exists here only to measure what exclusivity would buy."""

    name = "histate-exclusive"
    write_through = False
    checkpoint_tiers = None


@register_policy
class HiStateWriteBack(HiState):
    """What the plugin does under `--enable-histate --hicache-write-policy write_back` with an SSD tier:
    device KV reaches the host only when the device evicts it (SGLang's write_back), the SSD is the host's
    victim tier, and each checkpoint is written to the SSD at creation through a host staging slot freed
    at the write's agreed ack (sglang_plugin/state_writes.py), so it never takes a host slot and a
    historical one lives on the SSD alone, as in `histate`. A host hit is copied back and the host copy
    stays until the host runs short, when SGLang frees such copies before any other
    (`Evictor.reclaim_host_duplicates`). The same decisions as the plugin on the same stream:
    test/sglang/test_differential.py."""

    name = "histate-writeback"
    kv_write_through_tiers = ()
    host_reclaims_duplicates = True  # `Evictor.reclaim_host_duplicates`: SGLang's write_back host pressure path


class HiStateOnShortHost(HiStateWriteBack):
    """`histate` where the plugin takes write_back by itself: a host KV pool at most 1.8x the device's, an
    SSD tier, no L3, and no `--hicache-write-policy` given (core/write_policy.py). The same rules as
    `histate-writeback` under the name `histate`; not registered (`with_host_write_policy` picks it)."""

    name = "histate"


def with_host_write_policy(rules: Policy, device_bytes: int, host_kv_bytes: int, *, has_ssd: bool,
                           has_l3: bool) -> Policy:
    """`rules` as the server runs it on these tiers. Only `histate` itself changes, to the rules of the
    write policy the plugin picks (core/write_policy.py); its ablations and every other policy keep the
    write policy their name says, so they stay comparable across rows."""
    if type(rules) is HiState and auto_host_write_policy(device_bytes, host_kv_bytes, has_ssd=has_ssd,
                                                        has_l3=has_l3) == WRITE_BACK:
        return HiStateOnShortHost()
    return rules


@register_policy
class HiStateWriteBackViaHost(HiStateWriteBack):
    """The plugin under write_back without its state-only SSD writes (before 2026-12-07, and what SGLang
    0.5.23's own path allows: it writes a state to storage only with its node's host backup,
    unified_tree_core.py:2528-2553): SGLang copies nothing to the host at insert; a node reaches the host
    when the device evicts it, its KV and states together (`evict_device_leaf` / `backup_node_for_write_back`,
    unified_tree_core.py:1788-1825, unified_radix_cache.py:1647-1663), and a state reaches the SSD through
    the storage write-through after that backup's ack (:1805-1818). HiState's MAMBA walk asks for that backup
    for every device state with no host copy (sglang_plugin/eviction.py `write_back_moves_state`), so a
    checkpoint evicted from the device moves (device -> host slot -> SSD) instead of being dropped. So a
    checkpoint is not on the SSD at creation, and a historical one keeps its device slot until the device
    evicts it, which is also where eq. 4 prices it (PolicyState.states_priced_on_device). Against
    `histate-writeback` it measures what the state-only writes add."""

    name = "histate-writeback-via-host"
    checkpoint_write_through = False


@register_policy
class HiStateSessions(HiState):
    """What the SGLang plugin does under `--enable-histate --enable-session-radix-cache`
    (sglang_plugin/eviction.py, `session_referenced` and `_rank`): on every tier, a unit on a live
    session's path (SGLang's FULL coverage: the KV of each node from the root to the session's leaf) or
    holding its frontier state (MAMBA's reference) ranks after every unreferenced one, eq. 7 ordering each
    class; core/sessions.py keeps SGLang's counts. A checkpoint inside a live session's context is thus
    referenced like its KV. Sessions are the replay's (a subagent is its own session), closed when their
    last request completes: the signal is as good as the client's session bookkeeping. Not modelled: the
    plugin keeps a referenced frontier state off the SSD-only home while referenced (such a state is a
    terminal one here, which stays on the device anyway). A user flag's what-if, measured in
    docs/results.md ("Session references with HiState"); `histate` is the server without the flag."""

    name = "histate-sessions"
    session_refs = True
