"""The SGLang side of HiState's policy engine: one `histate.core.PolicyState` over SGLang's tree.

`HiStateRuntime` is to SGLang's tree what `histate.core.HybridPrefixCache` is to the core's own tree,
minus the tree: SGLang owns structure, memory and data movement, and HiState decides through the same
core objects every executor uses:
  * `PolicyState` (refresh on hit incl. refresh-all, the terminal-hit EMA and the learned near-end
    prior, residence samples, admission `plan`, eq. 7 `score`), built with `node_unit_tokens=1`
    because SGLang's edges count tokens while checkpoints sit on the state grid;
  * `TierVictims` (eviction.py): the core's `VictimHeap`s, one per tier, over `CoreNode`s.
Defaults (tau, EMA weight, terminal prior, intervals) come from `histate.core` through `CacheConfig`.

Time is the cache's clock: in the server an `AgreedClock` (clock.py) every TP/PP rank reads the same
value from; in tests a logical clock.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

from histate.core import (MISS_HISTORY_MAX_KEYS, SGLANG_TIER_NAMES, CacheConfig, ItemKind, PolicyState, SessionRefs,
                          Tier, TierPlan, UnitKind, fastest_tier, make_policy)

from .checkpoint_hints import hint_grid_steps
from .config import HiStateConfig
from .core_nodes import CoreNode, core_of
from .eviction import TierVictims, frees_state, leaf_state_needs_backup, write_back_moves_state
from .metrics import HiStateMetrics
from .miss_tracker import META_INFO_KEY, MISS_ATTR, MissTracker, as_meta_info


REUSE_ATTR = "_hs_reuse"
"""Underscore attribute on SGLang's `Req`: the `MatchedReuse` of its latest match (set by `on_match`)."""

TOOL_WAIT_EVENTS = ("held", "expired", "back_in_time", "back_late")
"""The `ToolWait.counts` exported as sglang:histate_tool_wait_turns_total{event}."""

CHAIN_ATTR = "_hs_chain"
"""Underscore attribute on SGLang's `Req`: the `tool_wait.Chain` of its latest match (tool-wait residency)."""

CLAIM_ATTR = "_hs_claim"
"""Underscore attribute on SGLang's `Req`: (tokens, `Tier`) of the checkpoint its latest match would resume
from (`on_match`); the hit is counted only once the first pass shows what it did resume from (`settle`)."""

SETTLED_ATTR = "_hs_settled"
"""Underscore attribute on SGLang's `Req`: its first pass was built, its hit and misses are final."""


@dataclasses.dataclass(frozen=True)
class MatchedReuse:
    """What a request's match reuses by HiState's hit accounting (the core's `MatchResult`): `reused_tokens`
    is the end of the deepest checkpoint on the matched path in any tier (an SSD-only one included: it is
    restored before admission); `kv_tokens_by_tier` splits [0, reused_tokens) by the fastest tier holding
    each node's KV (the core's `kv_bytes_by_tier`, in tokens). Read by the short-prefill-first rule
    (short_prefill.py) without matching again."""

    reused_tokens: int = 0
    kv_tokens_by_tier: Any = dataclasses.field(default_factory=dict)


def matched_reuse(path: list, ckpt_node: Optional[CoreNode]) -> MatchedReuse:
    if ckpt_node is None:
        return MatchedReuse()
    by_tier: dict = {}
    start = 0
    for node in path:
        tier = fastest_tier(node.kv_mask)
        if tier is not None:
            by_tier[tier] = by_tier.get(tier, 0) + node.depth_pages - start
        start = node.depth_pages
        if node is ckpt_node:
            break
    return MatchedReuse(ckpt_node.depth_pages, by_tier)


class HiStateRuntime:
    def __init__(self, config: HiStateConfig, *, grid_tokens: int, kv_bytes_per_token: int,
                 checkpoint_bytes: int, device_bytes: int, clock: Callable[[], float], policy: Any = None,
                 metrics: Optional[HiStateMetrics] = None):
        self.config = config
        self.grid_tokens = grid_tokens
        self.clock = clock
        self.metrics = metrics if metrics is not None else HiStateMetrics()
        self._policy = policy if policy is not None else make_policy("histate")
        host_cost, ssd_cost = config.restore_costs
        self.core_config = CacheConfig(
            page_num_tokens=grid_tokens, kv_bytes_per_token=kv_bytes_per_token,
            checkpoint_size_bytes=checkpoint_bytes, capacity_bytes={Tier.GPU: device_bytes}, tau_s=config.tau_s,
            supported_intervals_pages=config.intervals_pages(grid_tokens),
            restore_cost_tokens={Tier.CPU: host_cost, Tier.SSD: ssd_cost},
            tool_wait=config.tool_wait_prefetch == "on")
        self.tiers = {Tier.GPU}
        # --hicache-write-policy write_back: nothing is copied to the host at insert; a checkpoint goes to
        # the SSD at creation once an SSD tier exists (state_writes.py); set when HiCache attaches
        self.write_back = False
        self._back_up_state: Optional[Callable[[Any], None]] = None  # sg -> None: a synchronous D->H state backup
        self.state = self._policy_state()
        self.victims = TierVictims(self.state)
        self.ssd_tier: Any = None  # ssd_tier.SsdTier once an SSD backend is attached
        # --histate-miss-reasons: why uncached tokens missed (miss_tracker.py); None when off
        self.misses = MissTracker(grid_tokens, MISS_HISTORY_MAX_KEYS) if config.miss_reasons else None
        # --histate-tool-wait-prefetch on: the paths waiting turns hold (core/tool_wait.py), counted on
        # CoreNodes as the core's cache counts them; built over the tree's root by `attach_tree`
        self.holds: Optional[SessionRefs] = None
        self._tool_wait_counted: dict = {}

    def attach_tree(self, root_sg: Any) -> None:
        """SGLang built its tree (again, after a flush): holds start empty over its root."""
        if self.state.tool_wait is not None:
            self.holds = SessionRefs(core_of(root_sg), self.victims.touch)

    def _policy_state(self) -> PolicyState:
        """The policy state over the tiers that exist: eq. 7 charges a unit leaving a tier the restore
        from the tier it moves to (KV: device -> host -> SSD; a checkpoint: device -> SSD, the host's
        state slots only stage), as the simulator's cache does (`TierPlan`)."""
        plan = TierPlan(self._policy, self.tiers)
        return PolicyState(self._policy, self.core_config, plan.demotion(ItemKind.KV),
                           plan.demotion(ItemKind.CHECKPOINT), node_unit_tokens=1,
                           checkpoint_write_through=self.checkpoints_written_at_creation())

    def checkpoints_written_at_creation(self) -> Optional[bool]:
        """Whether a new checkpoint is written down to the SSD at creation, for eq. 4's pricing: under
        write_back, once an SSD tier exists (state_writes.py; the simulator's `histate-writeback`), and not
        without one (a checkpoint then stays on the device until the device evicts it: `histate-writeback-
        via-host`); None: the policy's own rule (write-through does)."""
        if not self.write_back:
            return None
        return Tier.SSD in self.tiers

    def use_write_back(self, write_back: bool, back_up_state: Optional[Callable[[Any], None]] = None) -> None:
        """HiCache attached with `--hicache-write-policy write_back` (or not): eq. 4 prices a checkpoint by
        its stay on the device, where write_back keeps it (PolicyState), and `back_up_state(sg)` copies a
        device state to the host before SGLang demotes a backed-up leaf without it
        (`eviction.leaf_state_needs_backup`). Called before any request."""
        self.write_back = write_back
        self._back_up_state = back_up_state
        self.state = self.victims.state = self._policy_state()

    def before_device_eviction(self, node: CoreNode, unit: UnitKind) -> None:
        """`unit` of `node` is the device walk's next victim, about to be evicted by SGLang."""
        if self._back_up_state is not None and leaf_state_needs_backup(self.victims.tree_core, node.sg, unit):
            self._back_up_state(node.sg)

    def add_tier(self, tier: Tier, capacity_bytes: Optional[int] = None) -> None:
        """A tier exists from now on (attached while SGLang builds the cache, before any request). The
        SSD is the home tier of historical checkpoints, whose capacity Little's law needs (T_state before
        evictions)."""
        self.tiers.add(tier)
        if capacity_bytes is not None:
            self.core_config = dataclasses.replace(
                self.core_config, capacity_bytes={**self.core_config.capacity_bytes, tier: capacity_bytes})
        self.state = self.victims.state = self._policy_state()

    def adopt_agreed_sizes(self, kv_bytes_per_token: int, checkpoint_bytes: int, device_bytes: int) -> None:
        """The sizes eq. 5-7 and Little's law price units by, agreed over the ranks at construction
        (`HiStateRadixCache._agree_sizes`: the MAX of every rank's own, per rank), so that every rank
        scores alike even if its local pools differ (an uneven pipeline split of layers; the plugin
        refuses --pp-size > 1 today, and TP shards are equal, so the MAX is each rank's own). Called
        before the tree holds anything."""
        self.core_config = dataclasses.replace(
            self.core_config, kv_bytes_per_token=kv_bytes_per_token, checkpoint_size_bytes=checkpoint_bytes,
            capacity_bytes={**self.core_config.capacity_bytes, Tier.GPU: device_bytes})
        self.state = self.victims.state = self._policy_state()

    def bytes_in(self, tier: Tier, size_bytes: int) -> None:
        """Bytes entered a tier (an insert, a load-back, an acknowledged SSD backup): the insertion rates
        of Little's law, as the core's ItemBook reports every put."""
        self.state.on_bytes_in(tier, size_bytes, self.now())

    @property
    def policy(self) -> Any:
        return self._policy

    def now(self) -> float:
        return self.clock()

    # --- stamps ------------------------------------------------------------------------------------

    def new_node(self, node: CoreNode, now_s: float) -> None:
        """A node SGLang just created with KV (insert): its KV stay starts now."""
        node.kv_access_s = node.kv_created_s = now_s

    def new_checkpoint(self, node: CoreNode, now_s: float) -> None:
        """A state landed at `node`'s end (insert): stamp it and re-offer the units whose cost it
        lowered (the core's `_add_checkpoint`)."""
        node.ckpt_access_s = node.ckpt_created_s = now_s
        self.victims.touch_checkpoint_neighbourhood(node)
        if self.misses is not None:
            self.misses.on_checkpoint_placed(node)
        if self.ssd_tier is not None and self.ssd_tier.state_writes is not None:
            self.ssd_tier.state_writes.note_new_checkpoint(node)  # write_back: to the SSD at creation

    # --- matches -----------------------------------------------------------------------------------

    def on_match(self, last_sg: Any, kv_match_tokens: int, req: Any, input_tokens: int,
                 now_s: float, key: Any = None) -> Optional[CoreNode]:
        """Core `begin_request` semantics on SGLang's match: refresh KV along the matched path, the used
        checkpoint (the deepest one on it in any tier, as the core's c) and, for refresh-all policies,
        every checkpoint above it; once per request, learn q and the near-end prior and count the hit
        (by the tier of that checkpoint: an SSD one is restored before admission). Returns the node of
        the used checkpoint (None: nothing reusable)."""
        path = []
        sg = last_sg
        while sg is not None and sg.parent is not None:
            path.append(core_of(sg))
            sg = sg.parent
        path.reverse()
        ckpt_node = next((n for n in reversed(path) if n.ckpt_mask), None)
        self.state.refresh(path, path, ckpt_node, now_s)
        if req is not None and self.config.short_prefill_first:  # its only reader (short_prefill.py)
            setattr(req, REUSE_ATTR, matched_reuse(path, ckpt_node))
        if req is not None and not getattr(req, "_hs_observed", False):
            req._hs_observed = True  # a retried admission is not evidence twice
            diverged_in = path[-1] if path else None
            self.state.observe_match(kv_match_tokens, self.state.end_offset(diverged_in, kv_match_tokens))
            self.metrics.record_lookup(input_tokens)
        if req is not None and not getattr(req, SETTLED_ATTR, False):
            self._claim(req, ckpt_node)
        if req is not None and self.misses is not None and key is not None:
            self._attribute_misses(req, key, kv_match_tokens, ckpt_node, now_s)
        if req is not None and self.holds is not None:  # the latest match counts (a retried admission)
            setattr(req, CHAIN_ATTR, self.state.on_resume(path[-1] if path else None, now_s, self.holds))
            self._count_tool_wait()
        return ckpt_node

    # --- tool-wait residency (core/tool_wait.py) ---------------------------------------------------------

    def on_turn_end(self, req: Any, tail_sg: Any, now_s: float) -> None:
        """A request finished (not aborted) with its insert ending at `tail_sg`: its chain waits there,
        holding the path (the core's `finish_request`)."""
        if self.holds is None:
            return
        tail = core_of(tail_sg) if tail_sg is not None and tail_sg.parent is not None else None
        chain = getattr(req, CHAIN_ATTR, None)
        if chain is None:
            return
        self.state.on_turn_end(tail, chain, now_s, self.holds)
        self._count_tool_wait()

    def _count_tool_wait(self) -> None:
        """Prometheus follows the core's own counts (`ToolWait.counts`), by their increments."""
        counts = self.state.tool_wait.counts()
        seen = self._tool_wait_counted
        for event in TOOL_WAIT_EVENTS:
            if counts[event] > seen.get(event, 0):
                self.metrics.record_tool_wait(event, counts[event] - seen.get(event, 0))
        self._tool_wait_counted = counts

    @staticmethod
    def _claim(req: Any, ckpt_node: Optional[CoreNode]) -> None:
        """Remember what this match would resume from. A request held for an SSD restore matches the same
        checkpoint again once it is on the host: the slowest tier seen at that depth is the hit's tier
        (the restore is what the hit cost)."""
        mask = ckpt_node.ckpt_mask if ckpt_node is not None else 0
        claim = (ckpt_node.depth_pages, fastest_tier(mask)) if mask else (0, None)
        before = getattr(req, CLAIM_ATTR, None)
        if before is not None and before[0] == claim[0] and claim[1] is not None and before[1] > claim[1]:
            claim = before  # tiers are ordered fastest first
        setattr(req, CLAIM_ATTR, claim)

    def settle(self, req: Any, now_s: float) -> None:
        """SGLang built the request's first pass: `req.prefix_len` is what it resumes from, and SGLang's
        `cached_tokens` is counted from it, once (schedule_batch.py:2965-2974). A match promises more
        than that when a host hit's load-back does not go through (the device could not make room; SGLang
        then prefills from the device prefix, schedule_policy.py:1516-1561), so the hit is counted here,
        at the prefix admitted, and the miss attribution is settled to it: the promised tokens that did
        not come back are `not_restored`. Later matches (a retracted request queued again) change
        neither, as SGLang's cached_tokens does not change either."""
        if getattr(req, SETTLED_ATTR, False):
            return
        setattr(req, SETTLED_ATTR, True)
        if self.ssd_tier is not None and hasattr(req, "cache_request_handle"):
            self.ssd_tier.forget_request(req.cache_request_handle)
        reused_tokens = int(req.prefix_len)
        claimed_tokens, claimed_tier = getattr(req, CLAIM_ATTR, None) or (0, None)
        if reused_tokens > 0:
            if reused_tokens == claimed_tokens:
                tier = claimed_tier
            else:  # not what the match promised: where SGLang took the state it resumes from
                tier = Tier.CPU if getattr(req, "host_loaded_length", 0) else Tier.GPU
            self.metrics.record_hit(reused_tokens, SGLANG_TIER_NAMES[tier])
        if self.misses is not None and getattr(req, MISS_ATTR, None) is not None:
            self._settle_misses(req, reused_tokens, now_s)

    def _attribute_misses(self, req: Any, key: Any, kv_match_tokens: int, ckpt_node: Optional[CoreNode],
                          now_s: float) -> None:
        """Why this match leaves tokens uncached (miss_tracker.py): kept on the request (the latest match
        before its first pass wins; counted once it leaves) and in its response's meta_info. `key`:
        SGLang's match key."""
        if getattr(req, SETTLED_ATTR, False):
            return
        origin = getattr(req, "origin_input_ids", None)
        prompt_tokens = len(origin) if origin is not None else len(key) + 1
        keys = self.misses.page_keys(req, key, min(len(key), prompt_tokens - 1))
        reused = ckpt_node.depth_pages if ckpt_node is not None else 0
        self._set_attribution(req, self.misses.attribute(keys, prompt_tokens, kv_match_tokens, reused), now_s)
        req._hs_miss_inputs = (keys, prompt_tokens, kv_match_tokens)

    def _settle_misses(self, req: Any, reused_tokens: int, now_s: float) -> None:
        attribution = getattr(req, MISS_ATTR)
        keys, prompt_tokens, kv_match_tokens = req._hs_miss_inputs
        promised = prompt_tokens - sum(attribution.tokens_by_reason.values())
        if reused_tokens < promised:  # the promised tokens that did not come back (`settle`)
            tokens = dict(attribution.tokens_by_reason)
            tokens["not_restored"] += promised - reused_tokens
            attribution = dataclasses.replace(attribution, tokens_by_reason=tokens)
        elif reused_tokens > promised:  # resumed deeper than the match said (not expected): attribute again
            attribution = self.misses.attribute(keys, prompt_tokens, max(kv_match_tokens, reused_tokens),
                                                reused_tokens)
        else:
            return
        self._set_attribution(req, attribution, now_s)

    @staticmethod
    def _set_attribution(req: Any, attribution: Any, now_s: float) -> None:
        setattr(req, MISS_ATTR, attribution)
        info = getattr(req, "customized_info", None)
        if info is None:
            info = {}
            try:
                req.customized_info = info
            except AttributeError:  # not an SGLang Req (a rig's stand-in): the attribute is enough
                return
        info[META_INFO_KEY] = [as_meta_info(attribution, now_s)]

    def commit_misses(self, req: Any) -> None:
        """The request ran and left: count its latest attribution once (Prometheus `miss_tokens_total`), and
        its context (prompt and output) is one later requests share."""
        attribution = getattr(req, MISS_ATTR, None)
        if attribution is not None and not getattr(req, "_hs_misses_counted", False):
            req._hs_misses_counted = True
            self.metrics.record_misses(attribution.tokens_by_reason)
            self.misses.saw_context(req, getattr(req, "output_ids", None) or ())

    def on_node_removed(self, node: CoreNode) -> None:
        """SGLang unlinked `node` (eviction, or a tombstone chain it cleaned up)."""
        if self.misses is not None:  # before the SSD tier forgets its SSD bits
            self.misses.on_node_removed(node, self.now(), self.ssd_tier)
        if self.holds is not None:  # a held leaf hands its hold to its parent (sessions.py)
            self.holds.on_leaf_removed(node)
        self.victims.on_removed(node)
        if self.ssd_tier is not None:
            self.ssd_tier.on_node_removed(node)

    # --- admission (eq. 3-6) -------------------------------------------------------------------------

    def plan_checkpoints(self, reused_tokens: int, input_tokens: int,
                         kv_match_tokens: Optional[int] = None, hint_tokens: Sequence[int] = ()) -> list[int]:
        """Token positions in (reused, input] where the forward pass should leave a state: the policy's
        admission rule (for `histate`: eq. 5 intervals, the observed branch point at the KV match end,
        and the last grid position) and the positions the request names (`hint_tokens`,
        checkpoint_hints.py), each floored to the grid."""
        grid = self.grid_tokens
        match = reused_tokens if kv_match_tokens is None else kv_match_tokens
        pages = self.state.plan(math.ceil(reused_tokens / grid), match // grid, input_tokens // grid, self.now(),
                                hint_pages=hint_grid_steps(hint_tokens, grid))
        return [p * grid for p in pages]

    # --- eviction bookkeeping --------------------------------------------------------------------------

    def on_evicted(self, node: CoreNode, unit: UnitKind, tier: Tier, now_s: float) -> None:
        """Residence samples with the core's definitions: T_KV when a bundle's KV leaves the device,
        T_state when a checkpoint loses its last copy."""
        self.metrics.record_eviction(unit.value, tier)
        if self.misses is not None:
            self.misses.on_evicted(node, tier, self.state.score(node, unit, 1 << tier))
        if unit is UnitKind.BUNDLE and tier is Tier.GPU:
            self.state.on_kv_left_gpu(node, now_s)
        if tier is Tier.GPU and frees_state(node, unit, tier):
            self.state.on_state_left_device(node, now_s)  # T_state under write_back
        if tier is Tier.GPU and write_back_moves_state(self.victims.tree_core, node.sg, unit):
            return  # write_back: the state is copied to the host before it leaves the device
        if frees_state(node, unit, tier) and not node.ckpt_mask & ~(1 << tier):
            self.state.on_state_gone(node, now_s)
            if self.misses is not None:
                self.misses.on_state_gone(node, now_s)

    def on_state_lost(self, node: CoreNode) -> None:
        """A fault took the last copy of `node`'s checkpoint (an SSD restore no rank could complete)."""
        if self.misses is not None and not node.ckpt_mask:
            self.misses.on_state_gone(node, self.now(), lost=True)
