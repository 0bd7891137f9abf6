"""Later writes win, per key: a slow earlier put never overwrites a later completed one, nor at restart.

The earlier put is frozen inside its checksum (which runs beside its I/O, before publication) until
the later put of the same key has completed, so the race is forced, not hoped for.
"""
import threading

import numpy as np
import pytest

import histate.storage.transfer as transfer
from histate.storage import CheckpointStore, StoreConfig

OLD, NEW = 1, 2


@pytest.fixture
def freeze_old(monkeypatch):
    """Checksums of payloads whose first byte is OLD wait for `release` (they signal `frozen` first)."""
    frozen, release = threading.Event(), threading.Event()
    real = transfer.chunk_checksum

    def checksum(chunk, *args):
        if len(chunk) and chunk[0] == OLD and not release.is_set():
            frozen.set()
            assert release.wait(30)
        return real(chunk, *args)

    monkeypatch.setattr(transfer, "chunk_checksum", checksum)
    return frozen, release


@pytest.mark.parametrize("pack", [False, True], ids=["objects", "packed"])
def test_an_earlier_slower_put_does_not_overwrite_a_later_one(tmp_path, backend, freeze_old, pack):
    frozen, release = freeze_old
    cfg = StoreConfig(dirs=[str(tmp_path / "s")], capacity_bytes=1 << 30, backend=backend, num_workers=2)
    store = CheckpointStore(cfg)
    try:
        old = [("k", np.full(300_000, OLD, np.uint8)), ("other", np.full(5000, OLD, np.uint8))]
        kw = {"pack": True} if pack else {}
        earlier = store.submit_put(old if pack else old[:1], **kw)
        assert frozen.wait(30)
        later = store.submit_put([("k", np.full(200_000, NEW, np.uint8)), ("x", np.zeros(10, np.uint8))], **kw)
        assert all(r.stored for r in later.wait(30))
        release.set()
        results = earlier.wait(30)
        assert not results[0].stored and results[0].fault.value == "superseded"
        assert store.get("k").array()[0] == NEW and store.payload_bytes("k") == 200_000
        if pack:
            assert results[1].stored and store.get("other").array()[0] == OLD
        store.flush(30)
    finally:
        release.set()
        store.close()
    with CheckpointStore(cfg) as store:  # and on disk: the restart serves the later value
        r = store.get("k")
        assert r.hit and r.buffer.size == 200_000 and (r.buffer == NEW).all()


def test_many_overlapping_puts_of_one_key_end_on_the_last_submitted(tmp_path, backend):
    cfg = StoreConfig(dirs=[str(tmp_path / "s")], capacity_bytes=1 << 30, backend=backend, num_workers=3)
    rng = np.random.default_rng(3)
    with CheckpointStore(cfg) as store:
        batches = []
        for version in range(1, 41):
            size = int(rng.integers(1, 40)) * 50_000  # big and small interleaved: completion order varies
            batches.append(store.submit_put([("k", np.full(size, version % 256, np.uint8))],
                                            pack=bool(version % 2)))
        for b in batches:
            b.wait(60)
        assert store.get("k").array()[0] == 40
    with CheckpointStore(cfg) as store:
        assert store.get("k").array()[0] == 40
