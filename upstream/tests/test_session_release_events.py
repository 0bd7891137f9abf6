"""The test that ships with upstream/series 0009 ([mem_cache] session-release events for tree-core observers).

Written as it would sit in SGLang's own test tree (no HiState import): SGLang's own unified-radix-cache
test kit with session references on (`build_fixture(..., enable_session_radix_cache=True)`, Full + Mamba,
Python core, CPU), finished turns through `release_kv_cache`, sessions closed with `release_radix_session`
as the scheduler closes them. A recording observer must hear of every node whose last session reference
went, and of no other: after each operation the nodes it was told about are exactly those whose reference
count went from positive to zero, read from the tree before and after.
"""
from __future__ import annotations

import dataclasses
from unittest import mock

import pytest

from _full_mamba_kit import turn
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import TreeCoreObserver
from sglang.test.kits.unified_radix_cache import config as kit_config
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

COMPONENTS = (ComponentType.FULL, ComponentType.MAMBA)


class Recorder(TreeCoreObserver):
    def __init__(self):
        self.released = []

    def on_session_released(self, node, component_type):
        self.released.append((node.id, component_type))


@pytest.fixture
def kit():
    kit = UnifiedRadixCacheFixtures()
    kit.cfg = dataclasses.replace(next(c for c in kit_config.CONFIGS if c.has_mamba and not c.has_swa),
                                  mamba_cache_size=8, kv_size=512)
    with mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"):
        kit.cache, kit.allocator, kit.pool = kit_fixtures.build_fixture(
            kit.cfg, tree_core_backend="python", enable_session_radix_cache=True)
    kit.recorder = Recorder()
    kit.cache.tree_core.add_observer(kit.recorder)
    return kit


def refs(kit) -> dict:
    """(node id, component) -> session references, for every node in the tree."""
    core = kit.cache.tree_core
    return {(node.id, ct): node.component_data[ct].session_ref
            for node in core._node_arena.values() if node is not core.root_node for ct in COMPONENTS}


def session_turn(kit, tokens, session_id):
    """`turn` for a session's request: registered under the session at release (SGLang's checkpoint)."""
    original = kit._make_inflight_req

    def make_req(*args, **kwargs):
        req, extra = original(*args, **kwargs)
        req.session_id = session_id
        req.session_generation = kit.cache.ensure_session_generation(session_id)
        return req, extra

    with mock.patch.object(kit, "_make_inflight_req", make_req):
        turn(kit, tokens)


def released_by(kit, operation) -> tuple:
    """(what the observer heard, what the tree says went from >0 to 0) over `operation`."""
    before = refs(kit)
    kit.recorder.released.clear()
    operation()
    after = refs(kit)
    expected = sorted(key for key, count in before.items() if count > 0 and after.get(key, 0) == 0)
    return sorted(kit.recorder.released), expected


def test_closing_a_session_reports_every_node_it_held(kit):
    page = kit.cfg.page_size
    a = [1] * (4 * page)
    session_turn(kit, a, "s1")
    assert any(count for count in refs(kit).values())  # the session holds its path
    heard, expected = released_by(kit, lambda: kit.cache.release_radix_session("s1"))
    assert expected and heard == expected
    assert {ct for _, ct in heard} == set(COMPONENTS)  # its KV path and its state


def test_a_session_that_moves_on_reports_what_it_no_longer_holds(kit):
    page = kit.cfg.page_size
    first = [2] * (4 * page)
    session_turn(kit, first, "s1")
    heard, expected = released_by(kit, lambda: session_turn(kit, first + [3] * (2 * page), "s1"))
    assert heard and heard == expected  # the earlier state, passed by the new turn; its KV path stays held
    assert all(ct == ComponentType.MAMBA for _, ct in heard)


def test_turns_outside_sessions_report_nothing(kit):
    page = kit.cfg.page_size
    heard, expected = released_by(kit, lambda: turn(kit, [4] * (4 * page)))
    assert heard == expected == []
    session_turn(kit, [5] * (4 * page), "s2")
    heard, expected = released_by(kit, lambda: turn(kit, [5] * (4 * page) + [6] * page))
    assert heard == expected == []  # another request on the session's path takes no reference away
