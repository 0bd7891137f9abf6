"""Cache configuration and every default HiState's controllers use, in one home.

The CLI (`histate replay`), the simulator's `ReplayConfig`, the reference executor and the SGLang
plugin read their defaults from here, so a default is written once. One frozen dataclass; every field
carries its unit. Validation names the offending field.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .types import ALL_TIERS, ConfigError, Tier

STATE_GRID_TOKENS = 64
"""Gated-DeltaNet / FLA chunk: recurrent states exist only every 64 tokens (SGLang:
`runtime_context.mamba_cache_chunk_size()`), so checkpoints sit on this grid."""

DEFAULT_INTERVALS_PAGES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Eq. 5 candidate set of checkpoint intervals, in 64-token pages (128 ... 32,768 tokens)."""

DEFAULT_INTERVALS_TOKENS = tuple(p * STATE_GRID_TOKENS for p in DEFAULT_INTERVALS_PAGES)

DEFAULT_TAU_S = 60.0
"""Eq. 7 time scale: seconds of recency one unit of recompute-per-byte is worth. The paper gives no
value; 60 s was best or tied in a sweep (15/60/120/600/3600 s) on three workload settings, and ties
600 s on the whole issue-11 robustness table (geometric-mean p95 ratio 0.99, p99 1.02; docs/results.md,
"τ on the whole table") since eq. 7 charges a demotion its transfer; it matches agent turn gaps."""

DEFAULT_EMA_ALPHA = 0.1
"""Weight of a new observation in the residence-time and terminal-hit EMAs."""

DEFAULT_TERMINAL_HIT_PRIOR = 0.9
"""Prior of the EMA of hits that land on a terminal checkpoint (appends dominate agent traffic)."""

NEAR_END_WINDOW_PAGES = 8
"""Offsets before a trajectory's end (pages) whose hit probability is learned separately (policy_state.py:
the reuse-position prior). On the Weka traces 4.4% of reused pages come from requests that leave the
previous request's context exactly one page before its end and 0.8% two to four pages before it
(docs/results.md), so a window of 8 pages covers what was seen with room to spare."""

DEPTH_PRIOR_BIN_PAGES = 8
"""Width of the depth prior's bins (depth_prior.py), in pages: 512 tokens. A hit lands at most a bin
past the checkpoint that serves it, against up to one eq. 5 interval (thousands of tokens) without it."""

DEPTH_PRIOR_ALPHA = 0.02
"""Weight of one interior hit in the depth prior's EMA. Smaller than DEFAULT_EMA_ALPHA: the depth prior
spreads its mass over many bins, so each needs more hits to be estimated (about the last 50 interior
hits carry it, against 10 for the eight near-end offsets)."""

SESSION_RANK_OFFSET_S = float(2**40)
"""Added to the eq. 7 score of a session-referenced unit (`histate-sessions`; the SGLang plugin's
sglang_plugin/eviction.py ranks with it too). Unreferenced scores stay far below it: t_last is a clock
reading in seconds (~35,000 years of headroom) and tau * C / M is at most tau times the tokens of a
context; at 2^40 a float still resolves 0.25 ms, so eq. 7 keeps ordering the referenced units among
themselves."""

DEFAULT_CHUNK_PAGES = 128
"""Chunked-prefill size in 64-token pages: SGLang's 8192-token default on 80 GB GPUs
(sglang/srt/arg_groups/memory_hook.py), where SGLang keeps a state per chunk."""

DEFAULT_FIXED_INTERVAL_PAGES = 288
"""Interval of the `histate-fixed32` ablation: the paper's 32 vLLM blocks of 576 tokens = 288 pages."""

DEFAULT_STATE_FRACTION = 0.47
"""Share of each tier SGLang 0.5.23's static split gives recurrent states (`--mamba-full-memory-ratio`
0.9 on Qwen3.5-9B, mirrored on the host by `--hicache-ratio`; docs/policies.md): what a partitioned
ledger uses for a tier its config does not name."""

DECODE_TRACK_INTERVAL_TOKENS = 256
"""SGLang's `--mamba-track-interval` (sglang/srt/arg_groups/fields/exec_.py:530-533): during decode
the recurrent state is tracked where the sequence length is a multiple of 256 tokens, and a finished
request donates the last one (managers/schedule_batch.py:3815-3816)."""


DEFAULT_RESTORE_COST_TOKENS = {Tier.CPU: 0.0134, Tier.SSD: 0.186}
"""Recompute-tokens it costs to restore one token of KV from each tier (eq. 2 restore time over the
prefill time of one token): what the simulator's cost model gives for Qwen3.5-9B on one H100 (host link
64 GB/s, SSD 5 GB/s, an 8,192-token chunk on a 32K context; `sim.costs.restore_cost_tokens`, pinned by a
test). The SGLang plugin's default for eq. 7's demotion charge (`--histate-restore-cost`)."""

MIN_STAGING_SLOTS = 16
"""Fewest host state slots HiState keeps (`--histate-host-state-slots` auto): the host tier holds KV;
checkpoints only pass through these slots on their way to SSD and back (asymmetric tiering)."""


def default_staging_slots(max_running_requests: int) -> int:
    """Host state slots HiState keeps by default: two per running request (one on its way to SSD,
    one being restored), at least MIN_STAGING_SLOTS."""
    return max(MIN_STAGING_SLOTS, 2 * max_running_requests)


@dataclass(frozen=True)
class CacheConfig:
    page_num_tokens: int = STATE_GRID_TOKENS
    """Tokens per page; Weka hash_ids cover 64 tokens and GDN chunks are 64 tokens."""
    kv_bytes_per_token: int = 32 * 1024
    """K+V of all full-attention layers (Qwen3.5-9B BF16: 8 layers x 2 x 4 heads x 256 dims x 2 B)."""
    checkpoint_size_bytes: int = 49 * 2**20
    """One recurrent checkpoint: conv + SSM state of every linear layer (Qwen3.5-9B FP32 ~ 49 MiB)."""
    capacity_bytes: Mapping[Tier, int] = field(
        default_factory=lambda: {Tier.GPU: 45 * 2**30, Tier.CPU: 96 * 2**30, Tier.SSD: 150 * 2**30}
    )
    """Per-tier budget shared by KV and checkpoints; a tier absent here does not exist."""
    state_fraction: Mapping[Tier, float] = field(default_factory=dict)
    """Static-partition baselines only: fraction of each tier reserved for checkpoints."""
    tau_s: float = DEFAULT_TAU_S
    """Eq. 7 time scale (see DEFAULT_TAU_S)."""
    supported_intervals_pages: tuple = DEFAULT_INTERVALS_PAGES
    """Eq. 5 candidate set of checkpoint intervals, in pages."""
    fixed_interval_pages: int = DEFAULT_FIXED_INTERVAL_PAGES
    """Interval of the `histate-fixed32` ablation."""
    chunk_pages: int = DEFAULT_CHUNK_PAGES
    """Chunked-prefill size in pages: where SGLang keeps states when the executor does not report
    where its forward passes ended (`AdmissionContext.step_end_pages`)."""
    block_pages: int = 1
    """Allocation block in pages for block-granular policies (`Policy.block_granular`): vLLM's hybrid
    allocator pads the attention block until one page holds a layer's recurrent state, 576 tokens =
    9 pages for Qwen3.5-9B. Hits, states and inserted KV come in whole blocks."""
    decode_track_pages: int = DECODE_TRACK_INTERVAL_TOKENS // STATE_GRID_TOKENS
    """SGLang's decode state grid in pages (see DECODE_TRACK_INTERVAL_TOKENS)."""
    attention_pair_tokens: float = 0.0
    """FLOPs of one (query, key) pair of attention over all attention layers, in units of one token's
    per-token FLOPs (matmuls + recurrence). Marconi's FLOP efficiency weighs the quadratic attention
    a cached prefix saves with it; 0 counts only linear work."""
    ema_alpha: float = DEFAULT_EMA_ALPHA
    """Weight of a new observation in the residence-time and terminal-hit EMAs."""
    initial_terminal_hit_prob: float = DEFAULT_TERMINAL_HIT_PRIOR
    """Prior for the EMA of hits that land on a terminal checkpoint."""
    restore_cost_tokens: Mapping[Tier, float] = field(default_factory=dict)
    """Recompute-tokens it costs to restore one token of KV from each tier (restore time / recompute
    time per token; 0 for the GPU). Eq. 7 charges a demoted unit this transfer instead of its recompute
    (units.expected_cost_tokens); the simulator derives it from the hardware and model specs (eq. 2 and
    the prefill roofline). Empty: every eviction is charged its recompute (the paper)."""
    tool_wait: bool = False
    """Tool-wait residency (core/tool_wait.py): a finished turn holds its path, ranked after everything
    unheld, until its next turn is unlikely to come, for policies that read it (`Policy.keeps_tool_wait`).
    `histate replay --tool-wait-prefetch`, the server's `--histate-tool-wait-prefetch`."""
    record_ops: bool = False
    """Keep a log of TierOps for executors (off in the simulator: it only needs byte counts)."""

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, why: str) -> None:
            if not cond:
                raise ConfigError(f"CacheConfig.{name}: {why}")

        need(self.page_num_tokens > 0, "page_num_tokens", "must be > 0")
        need(self.kv_bytes_per_token > 0, "kv_bytes_per_token", "must be > 0")
        need(self.checkpoint_size_bytes > 0, "checkpoint_size_bytes", "must be > 0")
        need(Tier.GPU in self.capacity_bytes, "capacity_bytes", "needs a GPU budget")
        for tier, size in self.capacity_bytes.items():
            need(tier in ALL_TIERS, "capacity_bytes", f"unknown tier {tier!r}")
            need(size >= 0, "capacity_bytes", f"{Tier(tier).name} budget {size} < 0")
        for tier, frac in self.state_fraction.items():
            need(0.0 <= frac <= 1.0, "state_fraction", f"{Tier(tier).name} fraction {frac} not in [0, 1]")
        need(self.tau_s >= 0, "tau_s", "must be >= 0")
        need(
            len(self.supported_intervals_pages) > 0 and all(i > 0 for i in self.supported_intervals_pages),
            "supported_intervals_pages",
            "must be a non-empty set of positive page counts",
        )
        need(self.fixed_interval_pages > 0, "fixed_interval_pages", "must be > 0")
        need(self.chunk_pages > 0, "chunk_pages", "must be > 0")
        need(self.block_pages > 0, "block_pages", "must be > 0")
        need(self.decode_track_pages > 0, "decode_track_pages", "must be > 0")
        need(self.attention_pair_tokens >= 0, "attention_pair_tokens", "must be >= 0")
        need(0.0 < self.ema_alpha <= 1.0, "ema_alpha", "must be in (0, 1]")
        need(0.0 <= self.initial_terminal_hit_prob <= 1.0, "initial_terminal_hit_prob", "must be in [0, 1]")
        for tier, cost in self.restore_cost_tokens.items():
            need(tier in ALL_TIERS and cost >= 0, "restore_cost_tokens", f"{tier!r}: {cost} must be >= 0")

    @property
    def kv_bytes_per_page(self) -> int:
        return self.kv_bytes_per_token * self.page_num_tokens

    @property
    def checkpoint_token_equiv(self) -> float:
        """N_s of eq. 4: one checkpoint expressed in tokens of KV."""
        return self.checkpoint_size_bytes / self.kv_bytes_per_token
