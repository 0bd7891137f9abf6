"""Per-cache policy state: the statistics a policy learns online and the rules that use them.

One `PolicyState` per cache, whoever owns the tree: `HybridPrefixCache` (the simulator and the
reference executor) and the SGLang plugin's adapter both hold one, so refresh-on-hit, the terminal-hit
EMA, the residence-time samples behind eq. 4, checkpoint admission and eq. 7 scoring are written once.
Nodes are read and stamped through the core node shape (docs/core-api.md: `kv_access_s`,
`ckpt_access_s`, `ckpt_mask`, `depth_pages`, `kv_created_s`, `ckpt_created_s`, ...); time is whatever
monotone clock the executor passes in (simulated time, or a logical clock agreed by every rank).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .config import DEPTH_PRIOR_ALPHA, DEPTH_PRIOR_BIN_PAGES, NEAR_END_WINDOW_PAGES, CacheConfig
from .depth_prior import DepthPrior
from .interval import Ema, IntervalController, TierFlow
from .policies import AdmissionContext, Policy
from .scoring import ScoringContext
from .tool_wait import ToolWait
from .types import ALL_TIERS, ConfigError, Tier, UnitKind
from .units import end_offset_pages, expected_cost_tokens, last_access_s, reclaim_tokens


class PolicyState:
    """`node_unit_tokens`: tokens per unit of the scored nodes' `keys` / `depth_pages`. Default: the
    config's page (the core's page tree). An executor whose tree is token-granular (SGLang's) passes 1:
    it scores its nodes in tokens while admission (`plan`) and the near-end prior stay in config pages
    (the checkpoint grid), so one PolicyState serves both."""

    def __init__(self, policy: Policy, config: CacheConfig, demotion_tier: Optional[dict] = None,
                 checkpoint_demotion_tier: Optional[dict] = None, node_unit_tokens: Optional[int] = None,
                 checkpoint_write_through: Optional[bool] = None):
        """`demotion_tier`: tier -> the tier a KV unit evicted from it moves to (None: dropped);
        `checkpoint_demotion_tier` the same for a checkpoint (default: `demotion_tier`). With the
        config's restore costs they let eq. 7 charge a demotion its transfer (policies opt in).
        `checkpoint_write_through`: whether a new checkpoint is written down to its home tier at
        creation (default: the policy's `checkpoint_write_through`; the SGLang plugin passes what
        `--hicache-write-policy` makes true)."""
        self.policy = policy
        self.config = config
        unit = config.page_num_tokens if node_unit_tokens is None else node_unit_tokens
        if unit <= 0 or config.page_num_tokens % unit:
            raise ConfigError(f"PolicyState.node_unit_tokens: {unit} does not divide the page "
                              f"({config.page_num_tokens} tokens)")
        self.node_unit_tokens = unit
        self.near_end_stride = config.page_num_tokens // unit  # node units per page
        home = policy.historical_tier if policy.historical_tier in config.capacity_bytes else Tier.GPU
        if checkpoint_write_through is None:
            checkpoint_write_through = policy.checkpoint_write_through
        # Eq. 4's T_state is how long a checkpoint keeps its place in the tier it is placed in. Written
        # through, that is its home tier (the SSD), and it is sampled when the last copy goes. Under
        # write_back a checkpoint stays on the device until the device evicts it (placement.
        # checkpoint_home), so it is priced by that stay, as KV is: sampled when it leaves the device,
        # with Little's law on the device. Priced by the SSD instead, a large SSD made checkpoints look
        # free, eq. 5 planned one every grid step, and the device could not hold them.
        self.states_priced_on_device = not checkpoint_write_through and home is not Tier.GPU
        if self.states_priced_on_device:
            home = Tier.GPU
        self.kv_tier, self.state_home_tier = Tier.GPU, home
        self.controller = IntervalController(
            config.checkpoint_token_equiv / config.page_num_tokens, config.supported_intervals_pages,
            config.ema_alpha, *((TierFlow(config.capacity_bytes[Tier.GPU]), TierFlow(config.capacity_bytes[home]))
                                if policy.estimates_residence_by_flow else (None, None)))
        self.terminal_hits = Ema(config.ema_alpha, config.initial_terminal_hit_prob)
        # The learned reuse-position prior: P(an interior hit lands k pages before its trajectory's end)
        # for k = 1..window, from observed hits; policies that keep the paper's uniform prior ignore it.
        self.learns_near_end = getattr(policy, "learns_reuse_positions", False)
        self.near_end_hits = [Ema(config.ema_alpha, 0.0) for _ in range(NEAR_END_WINDOW_PAGES)]
        # ... and by absolute depth for the interior hits far from any end (depth_prior.py)
        self.depth_prior = (DepthPrior(DEPTH_PRIOR_BIN_PAGES, DEPTH_PRIOR_ALPHA)
                            if self.learns_near_end and getattr(policy, "learns_depth_positions", False) else None)
        self._restore_cost, self._demotion_tier, self._checkpoint_demotion_tier = (), (), ()
        if getattr(policy, "charges_demotions", False) and config.restore_cost_tokens and demotion_tier:
            self._restore_cost = tuple(float(config.restore_cost_tokens.get(t, 0.0)) for t in ALL_TIERS)
            self._demotion_tier = _tier_indices(demotion_tier)
            self._checkpoint_demotion_tier = _tier_indices(checkpoint_demotion_tier or demotion_tier)
        self._ctx = self._context()
        # Tool-wait residency: who gets it is decided here once, so both executors stamp alike.
        self.tool_wait = ToolWait() if config.tool_wait and policy.keeps_tool_wait else None

    # --- scoring (eq. 7) ---------------------------------------------------------------------------

    @property
    def terminal_prob(self) -> float:
        return self.terminal_hits.value

    @property
    def scoring(self) -> ScoringContext:
        """The context scores are computed with; changes only when the terminal-hit EMA moves."""
        return self._ctx

    def score(self, node, unit: UnitKind, bit: int) -> float:
        return self.policy.score(self._ctx, node, unit, bit)

    def score_terms(self, node, unit: UnitKind, bit: int) -> tuple:
        """(t_last_s, C_tokens, M_tokens, score) of eq. 7 for a unit, C and M as HiState defines them
        whatever the policy (diagnosis: what the unit was worth when it was chosen)."""
        ctx = self._ctx
        cost = expected_cost_tokens(node, unit, bit, ctx)
        reclaim = reclaim_tokens(node, unit, bit, ctx.page_num_tokens, ctx.checkpoint_token_equiv)
        return last_access_s(node, unit, bit), cost, reclaim, self.score(node, unit, bit)

    @staticmethod
    def bound(node, unit: UnitKind, bit: int) -> float:
        """A lower bound of every policy's score (victims.py pushes entries with it)."""
        return last_access_s(node, unit, bit)

    # --- what a hit teaches ------------------------------------------------------------------------

    @property
    def near_end_reach_units(self) -> int:
        """How far above a trajectory's end (node units) its near-end positions can lie, once any
        near-end mass is learned; 0 before (the paper's rule has no such positions)."""
        probs = self._ctx.near_end_probs
        return (len(probs) + 1) * self.near_end_stride if sum(probs) > 1e-9 else 0

    @property
    def near_end_probs(self) -> tuple:
        """p'_k for k = 1..window (empty for policies with the paper's uniform interior prior)."""
        return self._ctx.near_end_probs

    def _context(self) -> ScoringContext:
        probs = tuple(e.value for e in self.near_end_hits) if self.learns_near_end else ()
        return ScoringContext.of(self.config, self.terminal_hits.value, probs, self._restore_cost,
                                 self._demotion_tier, self.node_unit_tokens, self._checkpoint_demotion_tier)

    def end_offset(self, node, match_units: int) -> Optional[int]:
        """Where a request left the cached tree, in pages before the end of the most recently used
        trajectory below `node` (the evidence `observe_match` learns from); `match_units` is the matched
        length in node units and `node` the node it ends in. None beyond the near-end window."""
        stride = self.near_end_stride
        window = NEAR_END_WINDOW_PAGES
        offset = end_offset_pages(node, match_units, (window + 1) * stride - 1 if stride > 1 else window)
        if offset is None:
            return None
        pages = (match_units + offset) // stride - match_units // stride
        return pages if pages <= window else None

    def observe_match(self, kv_match_units: int, end_offset_pages) -> None:
        """A request matched `kv_match_units` (node units) of KV: update q (the share of hits that land
        at a trajectory's end, judged by where the request leaves the cached tree), the near-end share
        of the interior hits and, for an interior hit beyond the near-end window, its depth."""
        if kv_match_units <= 0:
            return
        terminal = end_offset_pages == 0
        self.terminal_hits.observe(1.0 if terminal else 0.0)
        if not terminal and self.learns_near_end:
            for k, ema in enumerate(self.near_end_hits, start=1):
                ema.observe(1.0 if end_offset_pages == k else 0.0)
            if self.depth_prior is not None:  # a far hit at its depth in pages; a near-end one only decays
                far = end_offset_pages is None
                self.depth_prior.observe(kv_match_units // self.near_end_stride if far else None)
        self._ctx = self._context()

    def refresh(self, kv_path: Sequence, ckpt_path: Sequence, ckpt_node, now_s: float) -> None:
        """Refresh on a hit: KV along the matched path (`kv_path`), the used checkpoint, and for
        refresh-all policies every checkpoint above it on the path (`ckpt_path`, root first; paper
        §3.3: eq. 7's cost term still sparsifies them). Matched-only policies (Marconi) refresh the
        matched node alone (`radix_cache_hybrid.py` match_prefix: `nodes_accessed[-1]`)."""
        if self.policy.refresh_matched_only:
            if ckpt_node is not None:
                ckpt_node.kv_access_s = ckpt_node.ckpt_access_s = now_s
            return
        for node in kv_path:
            node.kv_access_s = now_s
        if ckpt_node is None:
            return
        ckpt_node.ckpt_access_s = now_s
        if self.policy.refresh_all:
            depth = ckpt_node.depth_pages
            for node in ckpt_path:
                if node.ckpt_mask and node.depth_pages < depth:
                    node.ckpt_access_s = now_s

    # --- tool-wait residency (tool_wait.py) ---------------------------------------------------------

    def on_resume(self, match_end, now_s: float, holds=None):
        """A request matched up to `match_end` (the deepest matched node, None for none): the chain of
        turns it continues (a `tool_wait.Chain`), to hand back to `on_turn_end`; None when off. Holds
        past their deadline are released from `holds` (a `SessionRefs`) first."""
        if self.tool_wait is None:
            return None
        self.release_expired_waits(now_s, holds)
        return self.tool_wait.on_resume(match_end, now_s)

    def on_turn_end(self, tail, chain, now_s: float, holds=None) -> None:
        """A request finished with its insert ending at `tail`: its chain holds the path root -> `tail` in
        `holds` (a `SessionRefs`, the executor's) until its deadline; expired holds are released."""
        if self.tool_wait is None or chain is None:
            return
        hold_key = self.tool_wait.on_turn_end(tail, chain, now_s)
        if hold_key is not None:
            holds.register(hold_key, tail)
        self.release_expired_waits(now_s, holds)

    def release_expired_waits(self, now_s: float, holds) -> None:
        """Close in `holds` every hold whose deadline passed (both executors call this, one rule)."""
        if self.tool_wait is not None:
            for hold_key in self.tool_wait.expired(now_s):
                holds.close(hold_key)

    # --- admission (eq. 3-6) -----------------------------------------------------------------------

    def plan(self, start_pages: int, kv_match_pages: int, end_pages: int, now_s: float,
             step_end_pages: tuple = (), output_end_pages: Optional[int] = None,
             hint_pages: Sequence[int] = ()) -> list[int]:
        """Checkpoint depths (pages) for a request's new segment (start, end] and, when the executor
        caches the output, its decode states up to `output_end_pages`.

        `hint_pages`: depths the request itself names (application-placed checkpoints, docs/hints.md).
        A policy that accepts them plans each one inside (start, end] on top of its own rule: the
        application knows where its stable prefix ends before any second request can show it, which
        is the one case the observed branch point and the depth prior cannot cover (the first
        session's pass). Hints outside the segment are already cached or not computed by this pass."""
        if self.policy.dense_checkpoints:
            return []
        depth_bins = self.depth_prior.bins_in(start_pages, end_pages) if self.depth_prior is not None else ()
        ctx = AdmissionContext(start_pages, kv_match_pages, end_pages, self.controller, self.config, now_s,
                               self._ctx.near_end_probs, depth_bins, step_end_pages, output_end_pages)
        pages = self.policy.admit(ctx)
        if hint_pages and self.policy.accepts_checkpoint_hints:
            named = {h for h in hint_pages if start_pages < h <= end_pages}
            if not named.issubset(pages):
                pages = sorted(named.union(pages))
        return pages

    # --- residence samples (T_KV, T_state of eq. 4) ------------------------------------------------

    def on_kv_left_gpu(self, node, now_s: float) -> None:
        """A bundle's KV left the GPU: one sample of T_KV (its stay there)."""
        self.controller.kv_residence_s.observe(max(0.0, now_s - node.kv_created_s))

    def on_state_gone(self, node, now_s: float) -> None:
        """A checkpoint lost its last copy: one sample of T_state (written through)."""
        if not self.states_priced_on_device:
            self.controller.state_residence_s.observe(max(0.0, now_s - node.ckpt_created_s))

    def on_state_left_device(self, node, now_s: float) -> None:
        """A checkpoint's device copy left (moved down or dropped): one sample of T_state under
        write_back, where the device is where a checkpoint is placed."""
        if self.states_priced_on_device:
            self.controller.state_residence_s.observe(max(0.0, now_s - node.ckpt_created_s))

    def on_state_residence(self, residence_s: float) -> None:
        """A T_state sample measured by a store (the SSD tier reports the age of what it evicts)."""
        self.controller.state_residence_s.observe(max(0.0, residence_s))

    def on_state_written(self, now_s: float) -> None:
        """A checkpoint reached its home tier (starts the censored T_state estimate)."""
        self.controller.note_state_written(now_s)

    def on_bytes_in(self, tier: Tier, size_bytes: int, now_s: float) -> None:
        """Bytes entered a tier (a put, a copy or a move): the insertion rates of Little's law."""
        controller = self.controller
        if controller.kv_flow is None:
            return
        if tier == self.kv_tier:
            controller.kv_flow.note(now_s, size_bytes)
        if tier == self.state_home_tier:
            controller.state_flow.note(now_s, size_bytes)

    def pressure_ratio(self, now_s: Optional[float] = None) -> float:
        return self.controller.pressure_ratio(now_s)


def _tier_indices(demotion: dict) -> tuple:
    """tier -> lower tier (or None) as a tuple over `ALL_TIERS` of tier indices (-1: dropped)."""
    return tuple(-1 if demotion.get(t) is None else int(demotion[t]) for t in ALL_TIERS)
