"""Byte budget and the eviction contract: owner callback or oldest-first, exact events and residence times."""
import os

import numpy as np
import pytest

from histate.storage import Fault

OBJ = 10_000  # payload bytes -> one 4 KiB header block + 12 KiB of payload blocks
FILE_BYTES = 4096 + 12288


def _arr(i):
    return np.full(OBJ, i % 256, dtype=np.uint8)


def _check_accounting(store):
    on_disk = sum(os.path.getsize(store.layout.final_path(k)) for k in store.keys())
    assert store.used_bytes == on_disk == FILE_BYTES * len(store.keys()) <= store.config.capacity_bytes


def test_oldest_first_without_callback(make_store, clock):
    events = []
    store = make_store(capacity_bytes=3 * FILE_BYTES, clock=clock, on_evict=events.append)
    for i in range(3):
        assert store.put(f"k{i}", _arr(i)).file_bytes == FILE_BYTES
        clock.advance(10.0)
        _check_accounting(store)
    assert store.put("k3", _arr(3)).stored
    assert store.keys() == ["k1", "k2", "k3"]
    assert [(e.key, e.size_bytes, e.residence_s, e.reason) for e in events] == [("k0", FILE_BYTES, 30.0, "capacity")]
    _check_accounting(store)
    assert store.get("k0").fault is Fault.NOT_FOUND and store.get("k1").array()[0] == 1


def test_owner_callback_decides_and_learns(make_store, clock):
    events, asked = [], []
    store = None

    def on_capacity_needed(bytes_needed):
        asked.append(bytes_needed)
        assert store.exists("k1")  # the callback may query the store: no lock is held
        return ["k1"]

    store = make_store(capacity_bytes=3 * FILE_BYTES, clock=clock, on_evict=events.append,
                       on_capacity_needed=on_capacity_needed)
    for i in range(3):
        store.put(f"k{i}", _arr(i))
        clock.advance(1.0)
    clock.advance(100.0)
    assert store.put("k3", _arr(3)).stored
    assert asked == [FILE_BYTES]
    assert store.keys() == ["k0", "k2", "k3"]
    assert [(e.key, e.residence_s, e.reason) for e in events] == [("k1", 102.0, "capacity")]
    _check_accounting(store)


def test_callback_that_frees_too_little_refuses_the_put(make_store):
    events = []
    store = make_store(capacity_bytes=2 * FILE_BYTES, on_capacity_needed=lambda n: [],
                       on_evict=events.append)
    store.put("a", _arr(0))
    store.put("b", _arr(1))
    r = store.put("c", _arr(2))
    assert r.fault is Fault.NO_CAPACITY and events == [] and store.keys() == ["a", "b"]
    assert store.stats_snapshot()["put_failures"] == {"no_capacity": 1}
    _check_accounting(store)


def test_a_round_that_frees_too_little_asks_the_owner_again(make_store):
    """The owner's first answer frees one file of the two the put needs (another thread removed the
    rest of what it chose, seen with the SSD tier's snapshot of orphans): the store asks again, with
    what is still missing, and admits the put. A round that removes nothing ends it (no_capacity)."""
    asked, answers = [], [["k0", "gone"], ["k1"]]

    def on_capacity_needed(bytes_needed):
        asked.append(bytes_needed)
        return answers.pop(0) if answers else []

    store = make_store(capacity_bytes=3 * FILE_BYTES, on_capacity_needed=on_capacity_needed)
    for i in range(3):
        store.put(f"k{i}", _arr(i))
    big = np.zeros(OBJ + 12288, dtype=np.uint8)  # two files' worth: 4 KiB header + 24 KiB of payload
    r = store.put("big", big)
    assert r.stored and r.file_bytes == 2 * FILE_BYTES - 4096
    assert asked == [2 * FILE_BYTES - 4096, FILE_BYTES - 4096]
    assert sorted(store.keys()) == ["big", "k2"]
    assert store.used_bytes == sum(os.path.getsize(store.layout.final_path(k)) for k in store.keys()) <= 3 * FILE_BYTES
    assert store.put("more", big).fault is Fault.NO_CAPACITY and len(asked) == 3  # nothing removed: ends
    assert store.used_bytes == sum(os.path.getsize(store.layout.final_path(k)) for k in store.keys()) <= 3 * FILE_BYTES


def test_writes_in_flight_count_against_the_budget(make_store, monkeypatch):
    """Two puts queued and not yet written hold their bytes (reservations): a third that only fits if
    they are forgotten is refused, and the budget holds once they land. The writer is held on a gate
    until the third put was decided; the gate counts the writes it held (the hold must have happened)."""
    import threading

    store = make_store(capacity_bytes=2 * FILE_BYTES, on_capacity_needed=lambda n: [])
    gate, held = threading.Event(), []
    execute = type(store)._execute

    def gated(self, sess, op):
        held.append(op)
        assert gate.wait(30)
        return execute(self, sess, op)

    monkeypatch.setattr(type(store), "_execute", gated)
    try:
        first = store.submit_put([("a", _arr(0)), ("b", _arr(1))])
        third = store.submit_put([("c", _arr(2))])
        reserved = store.stats_snapshot()["reserved_bytes"]  # c was decided while a and b were in flight
    finally:
        gate.set()
    assert reserved == 2 * FILE_BYTES
    assert [r.stored for r in first.wait(30)] == [True, True]
    assert third.wait(30)[0].fault is Fault.NO_CAPACITY
    assert len(held) >= 1  # the gate held the queued writes: the reservation was what refused c
    store.flush(30)
    assert sorted(store.keys()) == ["a", "b"]  # several writer threads: either may land first
    _check_accounting(store)


def test_object_larger_than_capacity_is_refused_without_evicting(make_store):
    store = make_store(capacity_bytes=2 * FILE_BYTES)
    store.put("a", _arr(0))
    assert store.put("huge", np.zeros(3 * FILE_BYTES, np.uint8)).fault is Fault.NO_CAPACITY
    assert store.keys() == ["a"]


def test_delete_reports_residence_and_frees_bytes(make_store, clock):
    events = []
    store = make_store(capacity_bytes=10 * FILE_BYTES, clock=clock, on_evict=events.append)
    store.put("a", _arr(0))
    clock.advance(7.5)
    assert store.delete("a") is True and store.delete("a") is False
    assert [(e.key, e.size_bytes, e.residence_s, e.reason) for e in events] == [("a", FILE_BYTES, 7.5, "delete")]
    assert store.used_bytes == 0 and not os.path.exists(store.layout.final_path("a"))


def test_capacity_holds_under_a_long_random_sequence(make_store, clock):
    rng = np.random.default_rng(11)
    store = make_store(capacity_bytes=5 * FILE_BYTES, clock=clock)
    live = set()
    for step in range(120):
        key = f"k{rng.integers(0, 12)}"
        if rng.random() < 0.2:
            store.delete(key)
            live.discard(key)
        else:
            assert store.put(key, _arr(step)).stored
            live.add(key)
        clock.advance(1.0)
        assert set(store.keys()) <= live and len(store.keys()) <= 5
        _check_accounting(store)
        if key in live:  # written this very step: never the oldest, so never the victim
            assert store.get(key).array()[0] == step % 256


def test_invalid_config_is_reported(tmp_path):
    from histate.storage import StoreConfig
    with pytest.raises(ValueError, match="backend="):
        StoreConfig(dirs=[str(tmp_path)], capacity_bytes=1, backend="gds")
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        StoreConfig(dirs=[str(tmp_path)], capacity_bytes=0)
    with pytest.raises(ValueError, match="backlog_policy="):
        StoreConfig(dirs=[str(tmp_path)], capacity_bytes=1, backlog_policy="block")
