"""Hangs and tampering: whatever is done to the directory behind the store's back, it refuses clearly or
recovers; no operation blocks forever and nothing is written or removed outside what the store owns."""
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest

from histate.storage import CheckpointStore, DirectoryInUse, Fault, StoreConfig, StoreDirectoryError


def _cfg(root, backend, **kw):
    return StoreConfig(dirs=[str(root)] if isinstance(root, (str, os.PathLike)) else root,
                       capacity_bytes=1 << 30, backend=backend, **kw)


def _within(fn, timeout_s=20.0):
    """fn() in a daemon thread; (finished, result). A hang fails the test instead of the suite."""
    out, done = [], threading.Event()

    def run():
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(timeout_s)
    if finished and isinstance(out[0], BaseException):
        raise out[0]
    return finished, (out[0] if finished else None)


def test_a_fifo_at_an_object_path_is_a_miss_not_a_hang(make_store):
    store = make_store()
    store.put("victim", np.ones(5000, np.uint8))
    store.put("ok", np.full(5000, 7, np.uint8))
    path = store.layout.final_path("victim")
    os.unlink(path)
    os.mkfifo(path)
    finished, r = _within(lambda: store.get("victim"))
    assert finished and r.fault is Fault.CORRUPT
    finished, results = _within(lambda: store.submit_get(["victim", "ok"]).wait(10))
    assert finished and results[0].fault is Fault.NOT_FOUND and results[1].hit
    assert os.path.exists(path)  # not ours: a FIFO is never removed or replaced
    assert store.put("victim", np.ones(10, np.uint8)).fault is Fault.UNSAFE_PATH
    assert _within(store.close)[0]


def test_a_deleted_fanout_directory_is_recreated(make_store):
    store = make_store()
    assert store.put("k", np.ones(5000, np.uint8)).stored
    fanout = os.path.dirname(store.layout.final_path("k"))
    shutil.rmtree(fanout)
    assert store.get("k").fault is Fault.MISSING_FILE
    r = store.put("k", np.full(5000, 3, np.uint8))
    assert r.stored and store.get("k").array()[0] == 3


def test_emptying_the_root_does_not_hand_it_to_a_second_store(tmp_path, backend):
    root = tmp_path / "store"
    first = CheckpointStore(_cfg(root, backend))
    try:
        first.put("before", np.ones(100, np.uint8))
        for name in os.listdir(root):  # rm -rf store/*
            path = root / name
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        with pytest.raises(DirectoryInUse, match="in use by another CheckpointStore"):
            CheckpointStore(_cfg(root, backend))
        assert first.put("after", np.ones(100, np.uint8)).stored  # recovers: fan-out dir and marker made again
    finally:
        first.close()
    with CheckpointStore(_cfg(root, backend)) as second:  # the marker is back, so the directory is still ours
        assert second.keys() == ["after"]


def test_a_planted_symlink_fanout_directory_is_refused(tmp_path, make_store):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = make_store(dirs=[str(tmp_path / "store")])
    fanout = os.path.dirname(store.layout.final_path("k"))
    os.symlink(outside, fanout)
    r = store.put("k", np.ones(5000, np.uint8))
    assert r.fault is Fault.UNSAFE_PATH and not store.exists("k")
    assert list(outside.iterdir()) == []  # nothing landed outside the root
    r = store.submit_put([("k", np.ones(5000, np.uint8)), ("j", np.ones(5000, np.uint8))], pack=True).wait()
    assert list(outside.iterdir()) == []
    store.close()
    again = CheckpointStore(_cfg(tmp_path / "store", store.config.backend))
    assert os.path.islink(fanout) and again.rebuild_report.foreign >= 1  # left alone, reported
    again.close()


def test_a_fanout_replaced_by_a_symlink_is_not_read_or_cleaned_through(tmp_path, make_store):
    store = make_store(dirs=[str(tmp_path / "store")])
    store.put("k", np.ones(5000, np.uint8))
    fanout = os.path.dirname(store.layout.final_path("k"))
    outside = tmp_path / "outside"
    shutil.move(fanout, outside)  # our directory, with our file, now lives elsewhere
    os.symlink(outside, fanout)
    r = store.get("k")
    assert r.fault is Fault.UNSAFE_PATH and not store.exists("k")
    assert sorted(os.listdir(outside)) == [os.path.basename(store.layout.final_path("k"))]  # not removed


@pytest.mark.parametrize("inner", ["sub", "fanout", "same-call", "duplicate"])
def test_nested_roots_are_refused(tmp_path, backend, inner):
    outer = tmp_path / "outer"
    with CheckpointStore(_cfg(outer, backend)) as store:
        store.put("k", np.ones(10, np.uint8))
        fanout = os.path.dirname(store.layout.final_path("k"))
    dirs = {"sub": [str(outer / "sub")], "fanout": [fanout],
            "same-call": [str(tmp_path / "x"), str(tmp_path / "x" / "y")],
            "duplicate": [str(tmp_path / "x"), str(tmp_path / "x")]}[inner]
    with pytest.raises(StoreDirectoryError, match="inside|twice"):
        CheckpointStore(_cfg(dirs, backend))
    with CheckpointStore(_cfg(outer, backend)) as store:  # the outer store is untouched
        assert store.keys() == ["k"]


def test_a_closed_handle_touches_nothing(tmp_path, backend):
    root = tmp_path / "store"
    old = CheckpointStore(_cfg(root, backend))
    old.put("k", np.ones(100, np.uint8))
    old.close()
    with CheckpointStore(_cfg(root, backend)) as new:
        with pytest.raises(RuntimeError, match="closed"):
            old.delete("k")
        with pytest.raises(RuntimeError, match="closed"):
            old.get("k")
        assert old.put("j", np.ones(10, np.uint8)).fault is Fault.CANCELLED
        assert new.get("k").hit and not new.exists("j")


@pytest.fixture
def immutable(request):
    """chattr +i on a path (undone at teardown); skips where the file system or privileges refuse."""
    paths = []

    def make(path):
        res = subprocess.run(["chattr", "+i", path], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"chattr +i not available here: {res.stderr.strip()}")
        paths.append(path)

    yield make
    for p in paths:
        subprocess.run(["chattr", "-i", p], capture_output=True)


def test_delete_of_an_undeletable_file_says_so_and_keeps_serving(tmp_path, backend, immutable):
    root = tmp_path / "store"
    with CheckpointStore(_cfg(root, backend)) as store:
        store.put("k", np.full(100, 5, np.uint8))
        immutable(store.layout.final_path("k"))
        assert store.delete("k") is False
        assert store.exists("k") and store.get("k").array()[0] == 5
        assert store.stats_snapshot()["delete_failures"] == 1
    with CheckpointStore(_cfg(root, backend)) as store:  # what the store said is what the restart sees
        assert store.keys() == ["k"]


def test_a_root_at_slash_is_refused_before_touching_it(backend):
    before = sorted(os.listdir("/"))
    with pytest.raises(StoreDirectoryError, match="/"):
        CheckpointStore(_cfg("/", backend))
    assert sorted(os.listdir("/")) == before

