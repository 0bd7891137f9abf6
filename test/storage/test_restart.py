"""Warm restart: the index is rebuilt from the directories; torn, corrupt and misnamed files are discarded."""
import os
import shutil

import numpy as np
import pytest

from histate.storage import Fault
from histate.storage.layout import encode_key

from storage_helpers import files_under, temp_name_in, versioned_payload


def _populate(store, n=6, nbytes=300_000):
    arrays = {f"ckpt-{i}": versioned_payload(f"ckpt-{i}", 0, nbytes + i) for i in range(n)}
    assert all(r.stored for r in store.submit_put(list(arrays.items())).wait())
    return arrays


def test_rebuild_keeps_good_files_and_discards_bad_ones(make_store, tmp_path):
    dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = make_store(dirs=dirs)
    arrays = _populate(store)
    paths = {k: store.layout.final_path(k) for k in arrays}
    assert {p.split(os.sep)[-3] for p in paths.values()} == {"a", "b"}
    store.close()
    # plant the debris a crash or a bad disk leaves behind
    torn_tmp = temp_name_in(os.path.dirname(os.path.dirname(paths["ckpt-0"])), paths["ckpt-0"])
    shutil.copyfile(paths["ckpt-0"], torn_tmp)
    not_our_tmp = paths["ckpt-0"].replace(".hs", ".tmp-999-1")  # the temp name of no root (older stores')
    shutil.copyfile(paths["ckpt-0"], not_our_tmp)
    with open(paths["ckpt-1"], "r+b") as fh:
        fh.write(b"GARBAGE!")
    os.truncate(paths["ckpt-2"], 8192)
    misnamed = os.path.join(os.path.dirname(paths["ckpt-3"]), encode_key("impostor") + ".hs")
    shutil.copyfile(paths["ckpt-3"], misnamed)
    foreign = os.path.join(dirs[0], "README.txt")
    open(foreign, "w").write("not ours")

    store = make_store(dirs=dirs)
    report = store.rebuild_report
    assert (report.kept, report.discarded) == (4, 4)
    assert report.reasons == {"temp": 1, "corrupt": 1, "short": 1, "misnamed": 1}
    assert sorted(store.keys()) == ["ckpt-0", "ckpt-3", "ckpt-4", "ckpt-5"]
    for k in store.keys():
        assert np.array_equal(store.get(k).buffer, arrays[k])
    left = files_under(tmp_path)
    assert torn_tmp not in left and misnamed not in left and paths["ckpt-1"] not in left
    assert foreign in left and not_our_tmp in left and report.foreign == 2
    assert store.used_bytes == sum(os.path.getsize(paths[k]) for k in store.keys())


def test_torn_payload_behind_a_valid_header_is_a_miss_not_wrong_data(make_store, tmp_path):
    """What power loss without fsync can leave: a renamed file whose data blocks never reached the disk."""
    store = make_store()
    arrays = _populate(store, n=2, nbytes=3 << 20)
    path = store.layout.final_path("ckpt-1")
    store.close()
    with open(path, "r+b") as fh:
        fh.seek(4096 + (2 << 20))
        fh.write(bytes(4096))
    store = make_store()
    assert sorted(store.keys()) == ["ckpt-0", "ckpt-1"]  # header valid: indexed
    assert store.get("ckpt-1").fault is Fault.CORRUPT  # payload checksum catches it on first read
    assert np.array_equal(store.get("ckpt-0").buffer, arrays["ckpt-0"])


def test_oldest_first_order_survives_restart(make_store, tmp_path):
    store = make_store(capacity_bytes=1 << 30)
    for k in ["new", "old", "mid"]:
        store.put(k, np.ones(10_000, np.uint8))
    for k, mtime in [("old", 1_000_000), ("mid", 2_000_000), ("new", 3_000_000)]:
        os.utime(store.layout.final_path(k), (mtime, mtime))
    store.close()
    store = make_store(capacity_bytes=3 * 16384)
    assert store.keys() == ["old", "mid", "new"]
    store.put("newest", np.ones(10_000, np.uint8))
    assert store.keys() == ["mid", "new", "newest"]


def test_a_directory_has_one_owner(make_store):
    make_store()
    with pytest.raises(RuntimeError, match="in use by another CheckpointStore"):
        make_store()
