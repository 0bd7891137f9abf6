"""The L3 ledger (core/l3_ledger.py): eq. 7 over the bundles a server wrote, worked out by hand.

Units throughout: a page is 10 tokens and 100 bytes (10 B a token); a state is 200 bytes, so
N_s = 20 tokens; tau = 60 s. A bundle costs its pages + one state.
"""
import pytest

from histate.core.l3_ledger import L3Deletes, L3Ledger, L3LedgerConfig, fleet_share_bytes


def ledger(budget_bytes: int) -> L3Ledger:
    return L3Ledger(L3LedgerConfig(budget_bytes=budget_bytes, page_num_tokens=10, kv_page_bytes=100,
                                   state_bytes=200, tau_s=60.0))


A1 = ("a0", "a1", "a2", "a3")          # session A, turn 1: depth 4
A2 = A1 + ("a4",)                      # session A, turn 2: depth 5 (A1 is now interior)
B = ("b0", "b1")                       # session B: depth 2


def fill(budget_bytes: int) -> L3Ledger:
    led = ledger(budget_bytes)
    led.record(A1, 10.0)
    led.record(B, 50.0)
    led.record(A2, 100.0)
    return led


def test_bytes_count_each_page_once_and_one_state_per_bundle():
    led = fill(10_000)
    # pages a0..a4, b0, b1 = 7 x 100; states at a3, b1, a4 = 3 x 200
    assert led.used_bytes == 1300
    led.record(A2, 120.0)              # the same bundle again: nothing new to count
    assert led.used_bytes == 1300


def test_score_terms_by_hand():
    led = fill(10_000)
    # A1 (interior): nothing of this ledger below it -> C = 4 pages = 40 tokens; all its pages are
    # also A2's, so deleting it frees only its state: M = 20 -> H = 10 + 60 * 40 / 20 = 130
    assert led.score_terms("a3") == (10.0, 40.0, 20.0, 130.0)
    # A2: A1 below at depth 4 -> C = 1 page = 10; it alone needs a4 -> M = 10 + 20 = 30
    # -> H = 100 + 60 * 10 / 30 = 120
    assert led.score_terms("a4") == (100.0, 10.0, 30.0, 120.0)
    # B: C = 20, M = 20 + 20 = 40 -> H = 50 + 60 * 20 / 40 = 80
    assert led.score_terms("b1") == (50.0, 20.0, 40.0, 80.0)


def test_eq7_keeps_the_old_interior_state_lru_would_drop_first():
    # over budget by 200 bytes. The least recently used object is A1's state (t = 10), but eq. 7
    # ranks B lowest (80 < 120 < 130): B's pages and state leave, A1 stays whole.
    led = fill(1100)
    deletes = led.plan_deletes(protect="a4")
    assert deletes == L3Deletes(kv_keys=("b0", "b1"), state_keys=("b1",), bundles=("b1",))
    assert led.used_bytes == 900 and "a3" in led and "b1" not in led


def test_an_interior_victim_takes_only_its_state_never_a_page_a_deeper_bundle_needs():
    # budget 850: B goes first (-> 900), then, A2 being protected, A1: its state only (-> 700)
    led = fill(850)
    deletes = led.plan_deletes(protect="a4")
    assert deletes.bundles == ("b1", "a3")
    assert deletes.state_keys == ("b1", "a3")
    assert deletes.kv_keys == ("b0", "b1")
    assert led.used_bytes == 700


def test_deleting_the_deeper_bundle_frees_its_own_pages_and_rescoring_follows():
    led = ledger(10_000)
    led.record(("a0", "a1"), 0.0)
    led.record(("a0", "a1", "a2", "a3"), 0.0)
    # a0..a3 + 2 states = 800; budget 500: the deeper bundle a3 (C = 20, M = 2*10 + 20 = 40 ->
    # H = 30) goes before the shallower a1 (C = 20, M = 20 -> H = 60); it alone needed a2, a3
    led.config = L3LedgerConfig(500, 10, 100, 200, 60.0)
    deletes = led.plan_deletes()
    assert deletes.bundles == ("a3",) and deletes.kv_keys == ("a2", "a3") and deletes.state_keys == ("a3",)
    # a1 is the only bundle now and owns both pages: C = 20, M = 2*10 + 20 = 40 -> H = 0 + 30
    assert led.score_terms("a1") == (0.0, 20.0, 40.0, 30.0)


def test_the_bundle_just_written_is_never_its_own_victim():
    led = ledger(300)
    led.record(B, 0.0)                 # 400 bytes > 300, but it is the one being written
    assert not led.plan_deletes(protect="b1")
    assert "b1" in led


def test_recency_moves_on_a_read_and_ties_go_to_the_shallower_then_older_bundle():
    led = ledger(10_000)
    led.record(("x0",), 0.0)           # C = 10, M = 10 + 20 = 30 -> H = 0 + 20 = 20
    led.record(("y0",), 0.0)           # the same score, recorded later
    led.config = L3LedgerConfig(300, 10, 100, 200, 60.0)
    assert led.plan_deletes().bundles == ("x0",)
    led = ledger(10_000)
    led.record(("x0",), 0.0)
    led.record(("y0",), 0.0)
    led.touch("x0", 5.0)               # x0 read at t = 5: H = 25 > y0's 20
    led.config = L3LedgerConfig(300, 10, 100, 200, 60.0)
    assert led.plan_deletes().bundles == ("y0",)


def test_forget_stops_counting_a_bundle_the_master_evicted_without_deleting_anything():
    led = fill(10_000)
    led.forget("a4")
    # A2 gone from the ledger: a4's page and state no longer counted, A1 and B are
    assert led.used_bytes == 1300 - 100 - 200
    assert "a4" not in led and led.score_terms("a3") == (10.0, 40.0, 60.0, 50.0)  # A1 owns a0..a3 now


def test_the_fleet_budget_is_shared_equally():
    assert fleet_share_bytes(1000, 3) == 333
    with pytest.raises(ValueError):
        fleet_share_bytes(1000, 0)
