"""Per-cache HiState state on SGLang's side: clock, core policy, EMAs, ranker, interval plans.

`HiStateRuntime` is what the tree cache and its components consult. It owns no tree: SGLang's
`UnifiedTreeCore` is the tree, and the decisions come from `histate.core` (the policy's eviction
score and refresh rule, the interval controller of eq. 3-6, the terminal-hit EMA), applied to
SGLang nodes through `NodeView`. Time is wall-clock seconds from an injectable `clock`
(`time.monotonic` in the server, a logical clock in tests and the fidelity replay).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional

from histate.core import AdmissionContext, CacheConfig, Ema, IntervalController, Tier, UnitKind, make_policy

from .config import HiStateConfig
from .eviction import UnifiedEvictionRanker
from .metrics import HiStateMetrics
from .node_view import ScoringContext, depth_tokens, has_device_state, has_host_state

DEFAULT_EMA_ALPHA = 0.1
DEFAULT_TERMINAL_HIT_PRIOR = 0.9


class HiStateRuntime:
    def __init__(self, config: HiStateConfig, *, grid_tokens: int, kv_bytes_per_token: int,
                 checkpoint_bytes: int, policy: Any = None, clock: Callable[[], float] = time.monotonic,
                 metrics: Optional[HiStateMetrics] = None):
        self.config = config
        self.grid_tokens = grid_tokens
        self.policy = policy if policy is not None else make_policy("histate")
        self.clock = clock
        self.metrics = metrics if metrics is not None else HiStateMetrics()
        # Scores are in tokens (page_num_tokens=1): SGLang edges are not checkpoint-grid aligned.
        self.scoring_config = CacheConfig(
            page_num_tokens=1, kv_bytes_per_token=kv_bytes_per_token, checkpoint_size_bytes=checkpoint_bytes,
            capacity_bytes={Tier.GPU: 1}, tau_s=config.tau_s, ema_alpha=DEFAULT_EMA_ALPHA,
            initial_terminal_hit_prob=DEFAULT_TERMINAL_HIT_PRIOR)
        # Admission works in checkpoint-grid pages (positions must sit on the state grid).
        self.admission_config = CacheConfig(
            page_num_tokens=grid_tokens, kv_bytes_per_token=kv_bytes_per_token,
            checkpoint_size_bytes=checkpoint_bytes, capacity_bytes={Tier.GPU: 1},
            supported_intervals_pages=config.intervals_pages(grid_tokens), ema_alpha=DEFAULT_EMA_ALPHA)
        self.controller = IntervalController(self.admission_config.checkpoint_token_equiv / grid_tokens,
                                             self.admission_config.supported_intervals_pages, DEFAULT_EMA_ALPHA)
        self.terminal_hits = Ema(DEFAULT_EMA_ALPHA, DEFAULT_TERMINAL_HIT_PRIOR)
        self.ssd: Any = None  # HiStateStorageBackend once the SSD tier is attached
        self.ranker = UnifiedEvictionRanker(self.policy, self._scoring_context)

    # --- clocks and scoring ---------------------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def _scoring_context(self) -> ScoringContext:
        return ScoringContext(self.scoring_config, self.terminal_hits.value, self.state_on_ssd)

    def state_on_ssd(self, node: Any) -> bool:
        """Whether `node`'s checkpoint has a usable SSD copy (keyed by its last page hash)."""
        if self.ssd is None or getattr(node, "_hs_ssd_bad", False):
            return False
        hashes = node.hash_value
        return bool(hashes) and self.ssd.has_state(hashes[-1])

    def checkpoint_tier(self, node: Any) -> Optional[str]:
        """Fastest tier holding `node`'s checkpoint ('device' | 'host' | 'storage'), None if none."""
        if node.parent is None:
            return None
        if has_device_state(node):
            return "device"
        if has_host_state(node):
            return "host"
        if self.state_on_ssd(node):
            return "storage"
        return None

    # --- stamps ----------------------------------------------------------------------------------

    def stamp_kv(self, node: Any, now_s: float) -> None:
        node._hs_kv_access_s = now_s
        if not hasattr(node, "_hs_kv_created_s"):
            node._hs_kv_created_s = now_s

    def stamp_new_checkpoint(self, node: Any, now_s: float, is_new_leaf: bool) -> None:
        if is_new_leaf:
            self.stamp_kv(node, now_s)
        node._hs_ckpt_access_s = now_s
        node._hs_ckpt_created_s = now_s
        node._hs_ssd_bad = False  # a new state; its SSD copy (when written) is a new object
        self.ranker.touch_checkpoint_neighbourhood(node)

    def refresh_on_match(self, best: Any, last_visited: Any, now_s: float) -> None:
        """Core `begin_request` refresh: KV along the whole matched path, the used checkpoint,
        and (refresh-all policies) every checkpoint above it on the path."""
        node = last_visited
        while node is not None and node.parent is not None:
            node._hs_kv_access_s = now_s
            node = node.parent
        if best is None or best.parent is None:
            return
        best._hs_ckpt_access_s = now_s
        if self.policy.refresh_all:
            node = best.parent
            while node is not None and node.parent is not None:
                if self.checkpoint_tier(node) is not None:
                    node._hs_ckpt_access_s = now_s
                node = node.parent

    def observe_request_match(self, req: Any, best: Any, kv_hit_tokens: int, input_tokens: int) -> None:
        """Once per request: terminal-hit EMA (core semantics) and the hit metrics."""
        if req is None or getattr(req, "_hs_observed", False):
            return
        try:
            req._hs_observed = True  # SGLang's Req takes attributes; a retried admission is not re-counted
        except AttributeError:
            return
        reused = depth_tokens(best) if best is not None and best.parent is not None else 0
        if kv_hit_tokens > 0:
            terminal = best is not None and best.parent is not None and not best.children
            self.terminal_hits.observe(1.0 if terminal else 0.0)
        self.metrics.record_match(input_tokens=input_tokens, reused_tokens=reused,
                                  tier=self.checkpoint_tier(best) if reused else None)

    # --- eviction bookkeeping -----------------------------------------------------------------------

    def on_evicted(self, node: Any, unit: UnitKind, now_s: float) -> None:
        """Residence-time samples, with the core's definitions (histate.core.placement):
        T_KV when a bundle's KV leaves the device, T_state when a checkpoint loses its last copy."""
        self.metrics.record_eviction(unit.value)
        if unit is UnitKind.BUNDLE and hasattr(node, "_hs_kv_created_s"):
            self.controller.kv_residence_s.observe(max(0.0, now_s - node._hs_kv_created_s))
        if (has_device_state(node) and not has_host_state(node) and not self.state_on_ssd(node)
                and hasattr(node, "_hs_ckpt_created_s")):
            self.controller.state_residence_s.observe(max(0.0, now_s - node._hs_ckpt_created_s))

    def on_ssd_state_written(self) -> None:
        self.controller.note_state_written(self.now())

    def on_ssd_state_evicted(self, residence_s: float) -> None:
        self.controller.state_residence_s.observe(max(0.0, residence_s))

    # --- adaptive interval control --------------------------------------------------------------------

    def plan_checkpoints(self, reused_tokens: int, input_tokens: int,
                         kv_match_tokens: Optional[int] = None) -> list[int]:
        """Token positions in (reused, input] where the forward pass should leave a state: the
        policy's admission rule (for `histate`: eq. 5 intervals for this segment, the observed
        branch point at the KV match end, and the last grid position)."""
        grid = self.grid_tokens
        start_pages = math.ceil(reused_tokens / grid)
        match_pages = (kv_match_tokens if kv_match_tokens is not None else reused_tokens) // grid
        ctx = AdmissionContext(start_pages, match_pages, input_tokens // grid, self.controller,
                               self.admission_config, self.now())
        return [p * grid for p in self.policy.admit(ctx)]
