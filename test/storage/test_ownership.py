"""Directory ownership: the store only ever creates, reads or removes files it provably made.

A root is the store's own when it carries the marker the store writes into an empty (or new)
directory; a directory holding anything else is refused, with its files untouched. Inside its root
the store only looks at its naming scheme inside its 256 fan-out directories.
"""
import os
import re

import numpy as np
import pytest

from histate.storage import CheckpointStore, StoreConfig, StoreDirectoryError

from storage_helpers import files_under, snapshot_tree

PROJECT = {  # what a user's project folder may hold: Haskell sources, editor temp files, a look-alike tree
    "Main.hs": b"main = putStrLn \"hi\"\n",
    "src/Lib.hs": b"module Lib where\n",
    "ab/Util.hs": b"module Util where\n",
    "notes.tmp-1-1": b"editor swap file\n",
    "LOCK": b"",
}


def _project(root):
    for rel, data in PROJECT.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)


def _open(root, backend, **kw):
    return CheckpointStore(StoreConfig(dirs=[str(root)], capacity_bytes=1 << 30, backend=backend, **kw))


@pytest.mark.parametrize("via_symlink", [False, True], ids=["direct", "symlinked-root"])
def test_a_directory_with_foreign_files_is_refused_and_left_intact(tmp_path, backend, via_symlink):
    project = tmp_path / "project"
    _project(str(project))
    before = snapshot_tree(project)
    root = project
    if via_symlink:
        root = tmp_path / "link"
        os.symlink(project, root)
    with pytest.raises(StoreDirectoryError, match="not created by histate.storage") as err:
        _open(root, backend)
    message = str(err.value)
    assert "\n" not in message and (str(project) in message or str(root) in message)
    assert snapshot_tree(project) == before  # not one file removed, added or changed


def test_a_namespace_under_a_foreign_directory_leaves_it_alone(tmp_path, backend):
    """`--histate-ssd-dir ~/project`: the store lives in its own subdirectory and touches nothing else."""
    project = tmp_path / "project"
    _project(str(project))
    before = snapshot_tree(project)
    store = _open(project, backend, namespace="rank0")
    assert store.put("k", np.arange(1000, dtype=np.int32)).stored
    store.close()
    store = _open(project, backend, namespace="rank0")  # warm restart: rebuild scans only its own root
    assert store.keys() == ["k"]
    store.close()
    after = snapshot_tree(project)
    assert {p: v for p, v in after.items() if not p.startswith("rank0" + os.sep)} == before


def test_an_empty_directory_is_adopted_and_only_documented_files_appear(tmp_path, backend):
    root = tmp_path / "store"
    root.mkdir()
    store = _open(root, backend)
    rng = np.random.default_rng(0)
    store.put("ckpt/a", rng.integers(0, 256, 100_000, dtype=np.uint8))
    store.submit_put([(f"kv/{i}", rng.integers(0, 256, 8192, dtype=np.uint8)) for i in range(5)], pack=True).wait()
    store.delete("kv/1")
    store.close()
    names = [os.path.relpath(p, root) for p in files_under(root)]
    allowed = re.compile(r"^(HISTATE-STORE|[0-9a-f]{2}/([A-Za-z0-9_-]|%[0-9A-F]{2})+\.hs|[0-9a-f]{2}/[0-9a-f]{16}\.hsp)$")
    assert names and all(allowed.match(n) for n in names), names
    assert "HISTATE-STORE" in names


def test_foreign_files_inside_an_owned_root_survive_restart(tmp_path, backend):
    root = tmp_path / "store"
    store = _open(root, backend)
    store.put("k", np.ones(5000, np.uint8))
    fanout = os.path.dirname(store.layout.final_path("k"))
    store.close()
    planted = {os.path.join(str(root), "README.txt"): b"hello", os.path.join(fanout, "notes.txt"): b"x",
               os.path.join(fanout, ".hidden.hs"): b"y", os.path.join(str(root), "sub", "deep.hs"): b"z",
               os.path.join(str(root), "zz", "odd.hs"): b"not a fan-out name"}
    for path, data in planted.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    store = _open(root, backend)
    assert store.keys() == ["k"] and store.rebuild_report.foreign >= 2
    store.delete("k")
    store.close()
    for path, data in planted.items():
        with open(path, "rb") as fh:
            assert fh.read() == data, path


def test_a_garbled_marker_is_refused(tmp_path, backend):
    root = tmp_path / "store"
    _open(root, backend).close()
    with open(root / "HISTATE-STORE", "w") as fh:
        fh.write("something else\n")
    with pytest.raises(StoreDirectoryError, match="HISTATE-STORE"):
        _open(root, backend)
