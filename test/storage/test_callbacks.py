"""Owner callbacks are isolated: an exception in on_capacity_needed / on_evict is counted, logged once,
and becomes a failed put; flush() and close() still return and the store keeps its books exact."""
import logging
import os
import threading

import numpy as np

from histate.storage import Fault

OBJ = 10_000
FILE_BYTES = 4096 + 12288


def _returns_within(fn, timeout_s=20.0):
    """Run fn in a thread; True if it returned (a hang must fail the test, not the suite)."""
    done = threading.Event()
    errors = []

    def run():
        try:
            fn()
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(timeout_s)
    if errors:
        raise errors[0]
    return finished


def _full_store(make_store, **callbacks):
    store = make_store(capacity_bytes=2 * FILE_BYTES, **callbacks)
    for k in ("a", "b"):
        assert store.put(k, np.ones(OBJ, np.uint8)).stored
    return store


def _books_exact(store):
    snap = store.stats_snapshot()
    assert snap["backlog_items"] == 0 and snap["backlog_bytes"] == 0 and snap["reserved_bytes"] == 0
    on_disk = sum(os.path.getsize(store.layout.final_path(k)) for k in store.keys())
    assert store.used_bytes == on_disk <= store.config.capacity_bytes


def test_raising_on_capacity_needed_fails_the_put_and_never_hangs(make_store, caplog):
    calls = []

    def broken(bytes_needed):
        calls.append(bytes_needed)
        raise KeyError("owner bug")

    store = _full_store(make_store, on_capacity_needed=broken)
    with caplog.at_level(logging.WARNING, logger="histate.storage"):
        r1 = store.put("c", np.ones(OBJ, np.uint8))
        r2 = store.submit_put([("d", np.ones(OBJ, np.uint8))]).wait(10)[0]
    assert r1.fault is Fault.OWNER_ERROR and r2.fault is Fault.OWNER_ERROR and len(calls) == 2
    assert _returns_within(lambda: store.flush(5))
    snap = store.stats_snapshot()
    assert snap["owner_errors"] == {"on_capacity_needed": 2}
    assert snap["put_failures"] == {"owner_error": 2}
    assert sum("on_capacity_needed" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert store.keys() == ["a", "b"]
    _books_exact(store)
    assert _returns_within(store.close)


def test_raising_on_evict_fails_the_put_and_never_hangs(make_store, caplog):
    seen = []

    def broken(event):
        seen.append((event.key, event.reason))
        raise RuntimeError("owner bug")

    store = _full_store(make_store, on_evict=broken)
    with caplog.at_level(logging.WARNING, logger="histate.storage"):
        r = store.put("c", np.ones(OBJ, np.uint8))
        assert store.delete("b") is True  # the removal happened; the owner's error is counted, not raised
    assert r.fault is Fault.OWNER_ERROR and seen == [("a", "capacity"), ("b", "delete")]
    assert _returns_within(lambda: store.flush(5))
    assert store.stats_snapshot()["owner_errors"] == {"on_evict": 2}
    assert sum("on_evict" in rec.getMessage() for rec in caplog.records) == 1
    assert store.keys() == [] and not os.path.exists(store.layout.final_path("a"))
    _books_exact(store)
    assert store.put("d", np.ones(OBJ, np.uint8)).stored  # the store keeps serving
    assert _returns_within(store.close)
