"""Directory ownership: the store only ever creates, reads or removes files it provably made.

A root is the store's own when it carries the marker the store writes into an empty (or new)
directory; a directory holding anything else is refused, with its files untouched. Inside its root
the store only looks at its naming scheme inside its 256 fan-out directories.
"""
import os
import re
import shutil

import numpy as np
import pytest

from histate.storage import CheckpointStore, Fault, StoreConfig, StoreDirectoryError

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


def test_a_copied_marker_proves_nothing_about_the_files_beside_it(tmp_path, backend):
    """A user copies a store's marker into a project whose files are named like the store's (`ab/Util.hs`,
    a pack name, a temp name). The store opens the directory -- the marker is genuine -- but none of
    those files carries the root id the marker records, so none is deleted at restart, none is replaced
    by a put of the same name, none is served; they are counted foreign. (Before: the restart deleted
    every one of them as a torn or corrupt file of its own.)"""
    store_root, project = tmp_path / "store", tmp_path / "project"
    _open(store_root, backend).close()
    planted = {"ab/Util.hs": b"module Util where\n", "ab/0000000000000001.hsp": b"not a pack\n",
               "ab/Main.tmp-1-1": b"an editor's swap file\n",
               "ab/Main.tmp-0123456789abcdef-1-1": b"a temp file of another root\n",  # not the marker's id
               "ab/Big.hs": b"HSTSTORE" + bytes(8192)}  # store magic, no root id: still not provably ours
    for rel, data in {**PROJECT, **planted}.items():
        os.makedirs(project / os.path.dirname(rel), exist_ok=True)
        (project / rel).write_bytes(data)
    shutil.copyfile(store_root / "HISTATE-STORE", project / "HISTATE-STORE")
    before = snapshot_tree(project)
    store = _open(project, backend)
    assert store.keys() == [] and store.rebuild_report.discarded == 0
    assert store.rebuild_report.foreign >= len(planted)
    util = store.layout.object_location("Util")
    os.makedirs(project / util.fanout, exist_ok=True)
    (project / util.fanout / util.name).write_bytes(b"module Util where\n")  # where put("Util") must land
    before[os.path.join(util.fanout, util.name)] = b"module Util where\n"
    assert store.put("Util", np.arange(100, dtype=np.int32)).fault is Fault.UNSAFE_PATH
    assert store.put("Other", np.arange(100, dtype=np.int32)).stored  # its own files it may add
    store.close()
    store = _open(project, backend)  # restart: rebuild again
    assert store.keys() == ["Other"]
    store.close()
    after = snapshot_tree(project)
    assert {p: v for p, v in after.items() if p in before} == before  # not one user file changed or removed


def test_a_format_2_store_is_refused_untouched(tmp_path, backend):
    """Its marker (and its files) carry no root id: the store cannot tell its files from a user's."""
    root = tmp_path / "old"
    root.mkdir()
    (root / "HISTATE-STORE").write_bytes(
        b"histate.storage root (format 2). The store owns only its own file names in 00..ff.\n")
    (root / "ab").mkdir()
    (root / "ab" / "k.hs").write_bytes(b"x" * 5000)
    before = snapshot_tree(root)
    with pytest.raises(StoreDirectoryError, match="format 2"):
        _open(root, backend)
    assert snapshot_tree(root) == before
