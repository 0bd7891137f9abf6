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
