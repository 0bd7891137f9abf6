"""I/O scheduling: reads before queued writes, a bounded write backlog (drop or delay), async handles.

A gate inside the (single) worker's first write holds the queue still, so the order in which queued
work runs is observed deterministically, without sleeps.
"""
import threading
import time

import numpy as np
import pytest

import histate.storage.read_path as read_path
import histate.storage.write_path as write_path
from histate.storage import Fault


@pytest.fixture
def gated(monkeypatch):
    """Record execution order; the put of key 'blocker' waits for `gate` once it has started."""
    gate, started, order = threading.Event(), threading.Event(), []
    real_write, real_read = write_path.write_items, read_path.read_items

    def write_items(sess, f, seq, specs, *args, **kw):
        order.append(("put", specs[0].key))
        if specs[0].key == "blocker":
            started.set()
            assert gate.wait(30)
        return real_write(sess, f, seq, specs, *args, **kw)

    def read_items(sess, f, header, indices, *args):
        order.append(("get", header.items[indices[0]].key))
        return real_read(sess, f, header, indices, *args)

    monkeypatch.setattr(write_path, "write_items", write_items)
    monkeypatch.setattr(read_path, "read_items", read_items)
    return gate, started, order


def _block(store, started):
    batch = store.submit_put([("blocker", np.zeros(1000, np.uint8))])
    assert started.wait(30)
    return batch


def test_reads_overtake_queued_writes(make_store, gated):
    gate, started, order = gated
    store = make_store(num_workers=1)
    store.submit_put([("r1", np.ones(100, np.uint8)), ("r2", np.ones(100, np.uint8))]).wait()
    order.clear()
    blocker = _block(store, started)
    writes = store.submit_put([("w1", np.ones(10, np.uint8)), ("w2", np.ones(10, np.uint8))])
    reads = store.submit_get(["r1", "r2"])
    assert not reads.poll() and not writes.poll()
    gate.set()
    assert all(r.hit for r in reads.wait(30)) and all(r.stored for r in writes.wait(30))
    blocker.wait(30)
    assert order == [("put", "blocker"), ("get", "r1"), ("get", "r2"), ("put", "w1"), ("put", "w2")]


def test_backlog_full_drops_and_counts(make_store, gated):
    gate, started, _ = gated
    store = make_store(num_workers=1, max_write_backlog_items=3, max_write_backlog_bytes=10_000)
    _block(store, started)  # 1 item, 1000 bytes in the backlog
    queued = store.submit_put([("a", np.ones(1000, np.uint8)), ("b", np.ones(1000, np.uint8))])
    dropped = store.submit_put([("c", np.ones(10, np.uint8))])  # 4th item
    assert dropped.poll() and dropped.wait()[0].fault is Fault.BACKLOG_FULL
    too_big = store.submit_put([("d", np.ones(9000, np.uint8))])
    assert too_big.wait()[0].fault is Fault.BACKLOG_FULL  # bytes bound too (items now 3 anyway)
    snap = store.stats_snapshot()
    assert snap["put_failures"] == {"backlog_full": 2} and snap["backlog_items"] == 3
    assert snap["backlog_bytes"] == 3000
    gate.set()
    assert all(r.stored for r in queued.wait(30))
    store.flush(30)
    assert store.stats_snapshot()["backlog_items"] == 0 and not store.exists("c")


def test_backlog_full_delays_the_submitter(make_store, gated):
    gate, started, _ = gated
    store = make_store(num_workers=1, max_write_backlog_items=2, backlog_policy="delay")
    _block(store, started)
    store.submit_put([("a", np.ones(10, np.uint8))])
    results = []
    submitter = threading.Thread(target=lambda: results.append(store.put("late", np.ones(10, np.uint8))))
    submitter.start()
    deadline = time.monotonic() + 30
    while store.stats_snapshot()["writes_delayed"] == 0:  # wait for the condition, not for a time
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert submitter.is_alive() and not store.exists("late")
    gate.set()
    submitter.join(30)
    assert results[0].stored and store.exists("late")


def test_delete_cancels_a_queued_put(make_store, gated):
    gate, started, order = gated
    store = make_store(num_workers=1)
    _block(store, started)
    queued = store.submit_put([("a", np.ones(10, np.uint8))])
    assert store.delete("a") is True
    gate.set()
    assert queued.wait(30)[0].fault is Fault.CANCELLED
    store.flush(30)
    assert not store.exists("a") and ("put", "a") not in order


def test_wait_timeout_and_poll(make_store, gated):
    gate, started, _ = gated
    store = make_store(num_workers=1)
    store.put("x", np.ones(10, np.uint8))
    _block(store, started)
    batch = store.submit_put([("y", np.ones(10, np.uint8))])
    with pytest.raises(TimeoutError, match="1 of 1 items still pending"):
        batch.wait(timeout_s=0.01)
    gate.set()
    assert batch.wait(30)[0].stored and batch.poll()


def test_close_cancels_queued_puts_when_not_flushing(make_store, gated):
    gate, started, _ = gated
    store = make_store(num_workers=1)
    blocker = _block(store, started)
    queued = store.submit_put([("a", np.ones(10, np.uint8))])
    closer = threading.Thread(target=store.close, kwargs={"flush": False})
    closer.start()
    deadline = time.monotonic() + 30
    while not store._closing:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    gate.set()
    closer.join(30)
    assert blocker.wait(30)[0].stored and queued.wait(30)[0].fault is Fault.CANCELLED
    assert store.submit_put([("b", np.ones(1, np.uint8))]).wait()[0].fault is Fault.CANCELLED
    with pytest.raises(RuntimeError, match="closed"):
        store.submit_get(["a"])
