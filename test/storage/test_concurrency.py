"""Several threads submitting puts, gets and deletes on overlapping keys under a tight byte budget."""
import itertools
import os
import threading

import numpy as np

from histate.storage import Fault

from storage_helpers import files_under, version_of, versioned_payload

NUM_THREADS = 4
OPS_PER_THREAD = 60
KEYS = [f"k{i}" for i in range(12)]


def _size(key, version):
    return 20_000 + (version * 7919) % 400_000  # a size per version: replacing changes the size


def test_concurrent_mixed_workload_serves_only_written_bytes(make_store):
    store = make_store(num_workers=3, capacity_bytes=8 * 430_000, chunk_bytes=16384, piece_bytes=65536)
    versions = itertools.count(1)
    written: dict[str, set[int]] = {k: set() for k in KEYS}
    written_lock = threading.Lock()
    errors: list[str] = []

    def check(result):
        if not result.hit:
            if result.fault is not Fault.NOT_FOUND:  # deleted or evicted (even mid-read) is a plain miss
                errors.append(f"{result.key}: unexpected miss {result.fault}")
            return
        v = version_of(result.buffer)
        with written_lock:
            known = v in written[result.key]
        if not known or not np.array_equal(result.buffer, versioned_payload(result.key, v, _size(result.key, v))):
            errors.append(f"{result.key}: served bytes of version {v} do not match what was written")

    def worker(seed):
        rng = np.random.default_rng(seed)
        for _ in range(OPS_PER_THREAD):
            op = rng.random()
            keys = list(rng.choice(KEYS, size=int(rng.integers(1, 4)), replace=False))
            if op < 0.45:
                items = []
                for k in keys:
                    v = next(versions)
                    with written_lock:
                        written[k].add(v)
                    items.append((k, versioned_payload(k, v, _size(k, v))))
                for r in store.submit_put(items).wait(60):
                    # budget; delete() race; a later put of the same key won (later writes win)
                    if not r.stored and r.fault not in (Fault.NO_CAPACITY, Fault.CANCELLED, Fault.SUPERSEDED):
                        errors.append(f"{r.key}: put failed with {r.fault}")
            elif op < 0.9:
                for r in store.submit_get(keys).wait(60):
                    check(r)
            else:
                store.delete(keys[0])

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(NUM_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    store.flush(60)
    assert errors == []
    snap = store.stats_snapshot()
    assert snap["gets"] > 0 and snap["hits"] > 0 and snap["puts_stored"] > 0
    assert snap["backlog_items"] == 0 and snap["reserved_bytes"] == 0
    # the index and the directory agree exactly, and the budget held
    finals = [f for f in files_under(store.layout.roots[0]) if f.endswith(".hs")]
    assert sorted(finals) == sorted(store.layout.final_path(k) for k in store.keys())
    assert store.used_bytes == sum(os.path.getsize(f) for f in finals) <= store.config.capacity_bytes
    assert not [f for f in files_under(store.layout.roots[0]) if ".tmp-" in f]
    for r in store.submit_get(store.keys()).wait(60):
        assert r.hit
        check(r)
    assert errors == []


def test_a_get_into_a_buffer_sized_for_a_replaced_object_is_a_miss(make_store):
    """The caller sized `out` for the stored object; a put of another size replaced the key before the
    get ran. That is a miss (`size_mismatch`), as any other lost race is, never an exception in the
    caller (before: `ValueError` from `get`, which the SGLang backend's `batch_get` did not expect)."""
    store = make_store()
    store.put("k", np.ones(5000, np.uint8))
    out = np.empty(store.payload_bytes("k"), np.uint8)
    store.put("k", np.full(7000, 2, np.uint8))  # the concurrent put, already published
    r = store.get("k", out=out)
    assert r.fault is Fault.SIZE_MISMATCH and r.buffer is None
    assert store.submit_get(["k", "k"], out=[out, np.empty(7000, np.uint8)]).wait(10)[0].fault is Fault.SIZE_MISMATCH
    assert store.stats_snapshot()["misses"] == {"size_mismatch": 2}
    assert store.get("k", out=np.empty(7000, np.uint8)).array()[0] == 2


def test_readers_with_fixed_buffers_under_puts_that_change_the_size(make_store):
    """A reader keeps one buffer for the small version while a writer alternates sizes: every get is a
    hit with the small version's bytes or a `size_mismatch` miss, and none raises."""
    store = make_store(num_workers=2)
    small, large = np.full(5000, 1, np.uint8), np.full(9000, 2, np.uint8)
    store.put("k", small)
    stop, errors = threading.Event(), []

    def writer():
        for i in range(150):
            store.put("k", large if i % 2 else small)
        stop.set()

    def reader():
        out = np.empty(small.size, np.uint8)
        while not stop.is_set():
            try:
                r = store.get("k", out=out)
            except Exception as exc:  # the bug: the race surfaced as an exception
                errors.append(repr(exc))
                return
            if (r.hit and not np.array_equal(out, small)) or (not r.hit and r.fault is not Fault.SIZE_MISMATCH):
                errors.append(f"{r.fault}: {out[:4]}")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
