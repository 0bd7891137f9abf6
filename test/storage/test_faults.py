"""Every fault becomes a miss (or a failed put) with a counter; the bad file goes; the store keeps serving."""
import errno
import os

import numpy as np
import pytest

from histate.storage import Fault

from storage_helpers import files_under


def _filled(make_store, **kw):
    events = []
    store = make_store(on_evict=events.append, **kw)
    rng = np.random.default_rng(0)
    arrays = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n in
              [("victim", 3 << 20), ("small", 5000), ("other", 1 << 20)]}
    assert all(r.stored for r in store.submit_put(list(arrays.items())).wait())
    return store, arrays, events


def _still_serving(store, arrays, gone="victim"):
    for k, a in arrays.items():
        if k != gone:
            r = store.get(k)
            assert r.hit and np.array_equal(r.buffer, a), k
    fresh = np.arange(10_000, dtype=np.int32)
    assert store.put("fresh", fresh).stored and store.get("fresh").array().tobytes() == fresh.tobytes()


def _expect_miss(store, events, fault, removed=True):
    path = store.layout.final_path("victim")
    r = store.get("victim")
    assert r.fault is fault and r.buffer is None
    snap = store.stats_snapshot()
    assert snap["misses"] == {fault.value: 1}
    assert not store.exists("victim") and not os.path.exists(path)
    assert snap["files_removed_on_fault"] == (1 if removed else 0)
    assert [(e.key, e.reason) for e in events] == [("victim", "fault")]
    assert store.get("victim").fault is Fault.NOT_FOUND  # later gets are plain misses


def test_missing_file(make_store):
    store, arrays, events = _filled(make_store)
    os.unlink(store.layout.final_path("victim"))
    _expect_miss(store, events, Fault.MISSING_FILE, removed=False)
    _still_serving(store, arrays)


@pytest.mark.parametrize("keep_bytes", [0, 100, 4096, 4096 + (1 << 20)])
def test_short_file(make_store, keep_bytes):
    store, arrays, events = _filled(make_store)
    os.truncate(store.layout.final_path("victim"), keep_bytes)
    _expect_miss(store, events, Fault.SHORT_FILE)
    _still_serving(store, arrays)


@pytest.mark.parametrize("where", ["header", "first_chunk", "last_chunk", "padding_is_ignored"])
def test_checksum_mismatch(make_store, where):
    store, arrays, events = _filled(make_store)
    path = store.layout.final_path("victim")
    payload_bytes = 3 << 20
    offset = {"header": 20, "first_chunk": 4096 + 7, "last_chunk": 4096 + payload_bytes - 1,
              "padding_is_ignored": None}[where]
    if offset is None:  # the payload is block aligned: there is no padding, corrupt a copy of the header instead
        with open(path, "r+b") as fh:
            fh.seek(0)
            hdr = bytearray(fh.read(4096))
            hdr[4000] ^= 0xFF  # beyond the encoded header: unused bytes, not covered
            fh.seek(0)
            fh.write(hdr)
        r = store.get("victim")
        assert r.hit and np.array_equal(r.buffer, arrays["victim"])
        return
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))
    _expect_miss(store, events, Fault.CORRUPT)
    _still_serving(store, arrays)


def test_file_of_another_key_is_not_served(make_store):
    store, arrays, events = _filled(make_store)
    big = np.random.default_rng(9).integers(0, 256, 3 << 20, dtype=np.uint8)
    store.put("same-size", big)
    os.replace(store.layout.final_path("same-size"), store.layout.final_path("victim"))
    r = store.get("victim")
    assert r.fault is Fault.CORRUPT and not np.array_equal(big, arrays["victim"])
    assert store.stats_snapshot()["misses"] == {"corrupt": 1}


def test_permission_error(make_store, monkeypatch):
    store, arrays, events = _filled(make_store)
    path = store.layout.final_path("victim")
    if os.geteuid() != 0:
        os.chmod(path, 0)
    else:  # root ignores mode bits: inject EACCES at open() for this one file
        real_open = os.open

        def open_denied(p, flags, *args, **kw):  # the store opens by name inside its fan-out directory
            if os.fspath(p) == os.path.basename(path) and flags & os.O_ACCMODE == os.O_RDONLY:
                denied.append(p)
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(p, flags, *args, **kw)

        monkeypatch.setattr(os, "open", open_denied)
    denied = []
    _expect_miss(store, events, Fault.PERMISSION)
    assert os.geteuid() != 0 or denied  # as root, the injected EACCES is what made the miss
    _still_serving(store, arrays)


def test_injected_enospc_on_preallocate_and_on_write(make_store, monkeypatch):
    store, arrays, events = _filled(make_store)
    fired = []

    def full(*_a, **_k):
        fired.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    r = store.put("new", np.ones(10_000, np.uint8))
    assert r.fault is Fault.NO_SPACE and not store.exists("new")
    assert fired  # the injected ENOSPC, not some other refusal
    monkeypatch.undo()
    assert store.stats_snapshot()["put_failures"] == {"no_space": 1}
    assert not [f for f in files_under(store.layout.roots[0]) if ".tmp-" in f]
    assert store.used_bytes == sum(os.path.getsize(store.layout.final_path(k)) for k in arrays)
    _still_serving(store, arrays, gone=None)


def test_injected_enospc_during_write_without_preallocation(make_store, monkeypatch, backend):
    if backend == "nixl":
        pytest.skip("NIXL reports write errors as a bare NIXL_ERR_BACKEND (covered by the transfer-error test)")
    store = make_store(preallocate=False, direct_io=False)
    fired = []

    def full(*_a, **_k):
        fired.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    assert store.put("k", np.ones(5 << 20, np.uint8)).fault is Fault.NO_SPACE
    assert fired
    monkeypatch.undo()
    assert not files_under(store.layout.roots[0]) or all(
        ".tmp-" not in f for f in files_under(store.layout.roots[0]))
    assert store.put("k", np.ones(5 << 20, np.uint8)).stored


def test_real_enospc_on_a_small_filesystem(make_store, small_fs):
    """3 MiB tmpfs, a byte budget that would allow far more: the file system runs out first."""
    store = make_store(dirs=[str(small_fs)], capacity_bytes=1 << 30)
    rng = np.random.default_rng(4)
    stored, failed = {}, 0
    for i in range(8):
        a = rng.integers(0, 256, 600_000, dtype=np.uint8)
        r = store.put(f"k{i}", a)
        if r.stored:
            stored[f"k{i}"] = a
        else:
            assert r.fault is Fault.NO_SPACE
            failed += 1
    assert 2 <= len(stored) <= 5 and failed == 8 - len(stored)
    assert store.stats_snapshot()["put_failures"] == {"no_space": failed}
    assert not [f for f in files_under(small_fs) if ".tmp-" in f]  # no torn temp files left behind
    for k, a in stored.items():
        assert np.array_equal(store.get(k).buffer, a)
    store.delete(next(iter(stored)))
    assert store.put("after-delete", rng.integers(0, 256, 600_000, dtype=np.uint8)).stored


def test_nixl_transfer_error_is_a_miss(make_store, monkeypatch, backend):
    if backend != "nixl":
        pytest.skip("NIXL-specific")
    store, arrays, events = _filled(make_store)
    from nixl._bindings import nixlBackendError

    fired = []

    def broken(*_a, **_k):
        fired.append(1)
        raise nixlBackendError("NIXL_ERR_BACKEND")

    for sess in [store._inline_session, *store._sessions]:
        monkeypatch.setattr(sess.agent, "transfer", broken)
    _expect_miss(store, events, Fault.IO_ERROR)
    assert fired  # the injected transfer error made the miss
    assert store.put("during-outage", np.ones(100, np.uint8)).fault is Fault.IO_ERROR
    assert not [f for f in files_under(store.layout.roots[0]) if ".tmp-" in f]
    monkeypatch.undo()
    _still_serving(store, arrays)
