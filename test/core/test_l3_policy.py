"""The L3 write and read rules (core/l3_policy.py), against expectations worked out by hand."""
import pytest

from histate.core import L3Put, L3WriteConfig, plan_l3_writes, restorable_pages

NOTHING = lambda page: False  # noqa: E731


def test_a_first_request_writes_every_page_of_its_bundle_and_only_the_deepest_state():
    # states held at depths 2 and 4: the interior one (keyed by page 1) stays private
    puts = plan_l3_writes(4, [2, 4], NOTHING, shared_pages=0, config=L3WriteConfig())
    assert puts == [L3Put(0, False, False, 1, 0), L3Put(1, False, False, 1, 1),
                    L3Put(2, False, False, 1, 2), L3Put(3, True, True, 1, 3)]


def test_the_bundle_ends_at_the_deepest_state_not_at_the_request_end():
    # 5 pages, states at depths 1 and 3: pages 3 and 4 have no state at or after them -> useless in L3.
    puts = plan_l3_writes(5, [3, 1], NOTHING, shared_pages=0, config=L3WriteConfig())
    assert [(p.page_index, p.with_state, p.soft_pin) for p in puts] == [(0, False, False), (1, False, False),
                                                                       (2, True, True)]


def test_pages_already_written_are_skipped_but_a_new_state_on_a_written_page_is_not():
    written = {0, 1, 2}.__contains__
    puts = plan_l3_writes(3, [3], written, shared_pages=0, config=L3WriteConfig())
    assert [(p.page_index, p.with_state) for p in puts] == [(2, True)]
    puts = plan_l3_writes(3, [3], written, shared_pages=0, config=L3WriteConfig(),
                          state_already_written={2}.__contains__)
    assert puts == []
    # a later turn: states at depths 3 (written) and 5 (new), pages 0-2 written
    puts = plan_l3_writes(5, [3, 5], written, shared_pages=0, config=L3WriteConfig(),
                          state_already_written={2}.__contains__)
    assert [(p.page_index, p.with_state, p.soft_pin) for p in puts] == [(3, False, False), (4, True, True)]


def test_shared_pages_get_replicas_and_only_the_terminal_page_is_pinned():
    puts = plan_l3_writes(3, [3], NOTHING, shared_pages=2, config=L3WriteConfig(shared_replicas=2))
    assert [p.replicas for p in puts] == [2, 2, 1]
    assert [p.soft_pin for p in puts] == [False, False, True]


@pytest.mark.parametrize("depths", [[], [0], [7]])
def test_no_state_within_the_request_writes_nothing(depths):
    assert plan_l3_writes(4, depths, NOTHING, shared_pages=0, config=L3WriteConfig()) == []


def test_disabled_writes_nothing():
    assert plan_l3_writes(4, [4], NOTHING, 0, L3WriteConfig(enabled=False)) == []


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="shared_replicas"):
        L3WriteConfig(shared_replicas=0)
    with pytest.raises(ValueError, match="TTL"):
        L3WriteConfig(pin_ttl_s=-1)


@pytest.mark.parametrize("kv, states, expected", [
    ([True, True, True], [False, True, False], 2),   # state at page 1 -> 2 pages
    ([True, True, True], [True, False, True], 3),
    ([True, False, True], [True, False, True], 1),   # a KV hole ends the prefix
    ([True, True], [False, False], 0),               # KV alone is no resume point
    ([], [], 0),
    ([True, True, True], [False, True], 2),          # fewer state flags than pages
])
def test_restorable_pages_follow_trailing_pages(kv, states, expected):
    assert restorable_pages(kv, states) == expected
