"""The test that ships with upstream/series 0007 ([mem_cache] insert, split and match events for tree-core
observers).

Written as it would sit in SGLang's own test tree (no HiState import): SGLang's own unified-radix-cache
test kit builds a stock cache (Full + Mamba, Python tree core, on CPU here) and an observer records the
walk events. Every expectation is computed from the prompts, not from the core: which node an insert
reuses, where a prompt leaves a cached path (the split), how many tokens a match finds.
"""
from __future__ import annotations

from array import array

import pytest

from _full_mamba_kit import build_kit, turn
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
    TreeCoreObserver,
    UnifiedTreeCoreInterface,
)


def tokens_of(node) -> list:
    return list(node.key.token_ids)


class Recorder(TreeCoreObserver):
    """The walk events, in order, with what each node held when it was reported."""

    def __init__(self):
        self.events = []

    def on_insert_path_node(self, node):
        self.events.append(("path", tokens_of(node)))

    def on_insert_committed(self, node, is_new_leaf, result):
        self.events.append(("commit", tokens_of(node), is_new_leaf, bool(result.mamba_exist)))

    def on_node_split(self, new_parent, child):
        # the tree must already hold the two halves: parent -> new_parent -> child
        linked = (child.parent is new_parent and child in new_parent.children.values()
                  and new_parent in new_parent.parent.children.values())
        self.events.append(("split", tokens_of(new_parent), tokens_of(child), linked))

    def on_prefix_matched(self, params, result):
        self.events.append(("match", len(params.key), result.full_kv_hit_length))

    def take(self, kind=None) -> list:
        events, self.events = self.events, []
        return [e for e in events if kind is None or e[0] == kind]


@pytest.fixture
def kit():
    kit = build_kit(mamba_slots=8, kv_tokens=512)
    kit.recorder = Recorder()
    kit.cache.tree_core.add_observer(kit.recorder)
    return kit


def test_a_new_prompt_is_one_new_leaf_with_its_state(kit):
    page = kit.cfg.page_size
    a = [1] * (4 * page)
    turn(kit, a)
    events = kit.recorder.take()
    assert events[0] == ("match", len(a), 0)  # nothing cached yet
    assert [e for e in events if e[0] == "commit"] == [("commit", a, True, False)]
    assert not [e for e in events if e[0] in ("path", "split")]  # nothing reused, nothing split


def test_repeating_a_prompt_reuses_its_node_and_refreshes_the_state_there(kit):
    page = kit.cfg.page_size
    a = [1] * (4 * page)
    turn(kit, a)
    kit.recorder.take()
    turn(kit, a)
    events = kit.recorder.take()
    assert events[0] == ("match", len(a), len(a))
    assert ("path", a) in events
    assert [e for e in events if e[0] == "commit"] == [("commit", a, False, True)]  # the state was there
    assert not [e for e in events if e[0] == "split"]


def test_a_prompt_that_leaves_a_cached_path_splits_it_where_they_part(kit):
    page = kit.cfg.page_size
    a = [1] * (2 * page) + [2] * (2 * page)
    b = a[: 2 * page] + [3] * (3 * page)  # shares two pages with a, then leaves it
    turn(kit, a)
    kit.recorder.take()
    turn(kit, b)
    events = kit.recorder.take()
    # the match walk splits a's node where b leaves it (a walk that stops inside an edge splits it), and
    # reports the match once the walk is done
    assert events[:2] == [("split", a[: 2 * page], a[2 * page:], True), ("match", len(b), 2 * page)]
    assert len([e for e in events if e[0] == "split"]) == 1
    commits = [e for e in events if e[0] == "commit"]
    assert commits == [("commit", b[2 * page:], True, False)]  # b's own tail, a new leaf with its state
    assert ("path", a[: 2 * page]) in events  # the insert walked the shared head


def test_a_match_is_reported_once_per_walk_and_not_for_an_empty_cache_path(kit):
    page = kit.cfg.page_size
    a = [7] * (3 * page)
    turn(kit, a)
    kit.recorder.take()
    for probe, expected in ((a, len(a)), (a + [8] * page, len(a)), ([9] * page, 0)):
        kit.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", probe))))
        assert kit.recorder.take() == [("match", len(probe), expected)]


def test_a_core_that_refuses_observers_reports_none():
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore

    core = object.__new__(RustUnifiedTreeCore)
    assert UnifiedTreeCoreInterface.observers.fget(core) == ()
    assert RustUnifiedTreeCore.observers is UnifiedTreeCoreInterface.observers
