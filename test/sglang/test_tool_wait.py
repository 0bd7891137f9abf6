"""`--histate-tool-wait-prefetch on` in SGLang's cache: waiting turns hold their paths (core/tool_wait.py).

Driven through SGLang's own request paths on its kit fixture (real pools, real `Req`s): each turn is
matched with its `Req` (`match_prefix`, where HiState looks up the turn it continues) and released with
`release_kv_cache(checkpoint=True)` (`checkpoint_into_tree`, then `on_release`, where its turn ends).
Expectations come from the stream: which turn continues which, the waits that gives, and a control
cache without the flag that evicts the other way; the core's cache runs the same stream and must hold
the same paths with the same deadlines (one HiState).
"""
from __future__ import annotations

import contextlib
import dataclasses
from array import array
from unittest import mock

import pytest

from histate.core import CacheConfig, HybridPrefixCache, Tier, make_policy
from histate.sglang_plugin.config import HiStateConfigError, resolve_config
from histate.sglang_plugin.core_nodes import core_of

from ._sglang_kit import FULL_MAMBA_CONFIGS, assert_histate_invariants, kit_on_cpu
from sglang_cpu.pools import ManualClock

MAMBA = 2  # sglang ComponentType.MAMBA


class WaitRig:
    """HiState on the kit fixture with a clock the test sets, tool-wait residency on or off."""

    def __init__(self, tool_wait: bool, mamba_slots: int = 8, kv_tokens: int = 512):
        from sglang.test.kits.unified_radix_cache.fixtures import build_fixture
        from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures
        from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
        from histate.sglang_plugin.tree_cache import HiStateRadixCache

        self.clock = ManualClock()
        config = resolve_config({"enable": True, "tool_wait_prefetch": "on" if tool_wait else None}, {})
        self.kit = UnifiedRadixCacheFixtures()
        self.kit.cfg = dataclasses.replace(FULL_MAMBA_CONFIGS[0], mamba_cache_size=mamba_slots, kv_size=kv_tokens)
        with contextlib.ExitStack() as stack:
            stack.enter_context(kit_on_cpu("histate"))
            stack.enter_context(mock.patch.object(
                kit_fixtures, "UnifiedRadixCache",
                lambda params: HiStateRadixCache(params, histate_config=config, clock=self.clock)))
            self.cache, self.allocator, self.pool = build_fixture(self.kit.cfg)

    def turn(self, tokens: list, at_s: float) -> None:
        """One request: matched with its Req at `at_s`, finished and released at `at_s`."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.clock.now = at_s
        if self.pool.mamba_allocator.available_size() < 1:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
        if self.allocator.available_size() < len(tokens):
            self.cache.evict(EvictParams(num_tokens=len(tokens) - self.allocator.available_size()))
        req, _ = self.kit._make_inflight_req(self.cache, self.allocator, self.pool, tokens, allocated=True)
        self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
        req.finished_reason = FINISH_LENGTH(length=0)
        release_kv_cache(req, self.cache, checkpoint=True)

    def evict_states(self, num: int, at_s: float) -> None:
        """A new request's match at `at_s` (which lets go of expired holds, as each match does), then
        an allocation that needs `num` state slots."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.clock.now = at_s
        req, _ = self.kit._make_inflight_req(self.cache, self.allocator, self.pool, [7777] * 16, allocated=True)
        self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", [7777] * 16)), req=req))
        assert self.cache.evict(EvictParams(num_tokens=0, mamba_num=num)).mamba_num_evicted == num

    def state_at(self, tokens: list) -> bool:
        """Whether the node ending exactly at len(tokens) holds a device state."""
        node = self.cache.tree_core.root_node
        pos = 0
        while pos < len(tokens):
            child = next((c for c in node.children.values()
                          if list(c.key.token_ids[:len(c.key)]) == tokens[pos:pos + len(c.key)]), None)
            if child is None:
                return False
            node, pos = child, pos + len(child.key)
        return pos == len(tokens) and node.component_data[MAMBA].value is not None

    def held_depths(self) -> set:
        return {core_of(n).depth_pages for n in self.cache.tree_core._node_arena.values()
                if n is not self.cache.tree_core.root_node and core_of(n).session_ref > 0}


A = list(range(1, 129))
B = list(range(500, 564))
C = list(range(900, 964))


def _stream(rig: WaitRig) -> None:
    """A's first turn at t=0, its continuation at t=5 (one observed wait of 5 s: A's chain holds until
    5 + 2 x 5 = 15), B's first turn at t=6 (held for the shared bound, 5 s: until 11)."""
    rig.turn(A[:32], 0.0)
    rig.turn(A[:64], 5.0)
    rig.turn(B[:32], 6.0)


def test_a_waiting_turns_state_outlives_an_older_unheld_one_until_its_deadline(sglang_plugins):
    control = WaitRig(tool_wait=False)
    _stream(control)
    control.evict_states(1, 12.0)
    assert control.state_at(B[:32]) and not control.state_at(A[:32])  # eq. 7 alone: A's interior (cheapest)
    rig = WaitRig(tool_wait=True)
    _stream(rig)
    assert rig.cache.histate.holds is not None
    assert rig.held_depths() == {32, 64}  # A's path root -> 64 and B's root -> 32 (both within their holds)
    rig.evict_states(1, 12.0)  # B let go at t=11, A holds until 15
    assert rig.state_at(A[:32]) and rig.state_at(A[:64]) and not rig.state_at(B[:32])
    assert rig.cache.histate.metrics.totals[("tool_wait_turns_total", "expired")] == 1
    rig.turn(C[:32], 16.0)  # past A's deadline: A is eq. 7's again
    assert all(core_of(n).session_ref == 0 for n in rig.cache.tree_core._node_arena.values()
               if list(n.key.token_ids[:1]) == [A[0]])
    rig.cache.sanity_check()
    assert_histate_invariants(rig.cache)


def test_the_server_holds_what_the_cores_cache_holds_on_the_same_stream(sglang_plugins):
    """The same turns through the core's `HybridPrefixCache` (its own tree, pages of 16 tokens here):
    the same chains continue, with the same waits and deadlines."""
    rig = WaitRig(tool_wait=True)
    core = HybridPrefixCache(CacheConfig(page_num_tokens=16, kv_bytes_per_token=1, checkpoint_size_bytes=64,
                                         capacity_bytes={Tier.GPU: 1 << 20}, tool_wait=True),
                             make_policy("histate"))
    stream = [(A[:32], 0.0), (A[:64], 5.0), (B[:32], 6.0), (A[:96], 9.0), (B[:48], 30.0), (A[:128], 31.0),
              (A[:48] + C[:16], 32.0)]  # a branch inside A's held path: both trees split it at 48
    for tokens, at_s in stream:
        rig.turn(tokens, at_s)
        lease = core.begin_request([tuple(tokens[i:i + 16]) for i in range(0, len(tokens), 16)], at_s)
        core.finish_request(lease, None, at_s, [len(tokens) // 16])
        plugin_wait, core_wait = rig.cache.histate.state.tool_wait, core.state.tool_wait
        assert plugin_wait._deadline_s == core_wait._deadline_s
        assert plugin_wait.gaps.bound_s == core_wait.gaps.bound_s
        assert rig.held_depths() == {n.depth_pages * 16 for n in core.tree.iter_nodes() if n.session_ref > 0}
    # a match alone (a request not finished yet) splitting a held node: the head is held as the tail is
    probe = A[:80] + C[:16]
    rig.clock.now = 33.0
    req, _ = rig.kit._make_inflight_req(rig.cache, rig.allocator, rig.pool, probe, allocated=True)
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    rig.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", probe)), req=req))
    core.abort_request(core.begin_request([tuple(probe[i:i + 16]) for i in range(0, len(probe), 16)], 33.0))
    assert 80 in rig.held_depths() and rig.held_depths() == {n.depth_pages * 16 for n in core.tree.iter_nodes()
                                                             if n.session_ref > 0}
    totals, counts = rig.cache.histate.metrics.totals, core.state.tool_wait.counts()
    assert {e: totals[("tool_wait_turns_total", e)] for e in ("held", "expired", "back_in_time", "back_late")} == \
        {e: counts[e] for e in ("held", "expired", "back_in_time", "back_late")}
    assert counts["back_late"] >= 1 and counts["back_in_time"] >= 1
    # A: waits 5, 4, 22 (its hold, 2 x 4 = 8 s after t=9, expired at t=17: a new hold at t=31)
    assert core.state.tool_wait.num_expired >= 1 and 22.0 in core.state.tool_wait.gaps._recent_s


def test_the_flag_takes_on_or_off_and_needs_histate():
    assert resolve_config({"enable": True, "tool_wait_prefetch": "on"}, {}).tool_wait_prefetch == "on"
    assert resolve_config({"enable": True}, {"HISTATE_TOOL_WAIT_PREFETCH": "on"}).tool_wait_prefetch == "on"
    with pytest.raises(HiStateConfigError, match="--histate-tool-wait-prefetch"):
        resolve_config({"enable": True, "tool_wait_prefetch": "yes"}, {})
    with pytest.raises(HiStateConfigError, match="needs --enable-histate"):
        resolve_config({"tool_wait_prefetch": "on"}, {})
