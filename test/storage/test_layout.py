"""Key validation and encoding: odd keys are stored safely, never outside the store directory."""
import os

import numpy as np
import pytest

from histate.storage import InvalidKeyError
from histate.storage.layout import Layout, encode_key, validate_key

from storage_helpers import files_under

ODD_KEYS = [
    "../../etc/passwd", "/abs/path", "a/b/../c", ".", "..", ".hidden", "%2F", "%", "a b\tc\n", "ключ/状态",
    "x" * 1024, "y" * 300, "~" + "0" * 64, "k.hs", "k.tmp-1-1", "LOCK", "\\windows\\style", "emoji-🧠",
]


def test_encoding_is_injective_and_stays_in_its_directory(tmp_path):
    layout = Layout([str(tmp_path / "root")])
    paths = [layout.final_path(k) for k in ODD_KEYS]
    assert len(set(paths)) == len(ODD_KEYS)
    root = str(tmp_path / "root") + os.sep
    for key, path in zip(ODD_KEYS, paths):
        name = os.path.basename(path)
        assert path.startswith(root) and os.path.dirname(os.path.dirname(path)) + os.sep == root
        assert "/" not in encode_key(key) and not name.startswith(".") and len(name) <= 255
        assert ".tmp-" not in name


def test_spread_over_several_roots_is_stable(tmp_path):
    roots = [str(tmp_path / f"d{i}") for i in range(3)]
    layout = Layout(roots)
    used = {layout.final_path(f"ckpt-{i}").split(os.sep)[-3] for i in range(200)}
    assert used == {"d0", "d1", "d2"}
    assert Layout(roots).final_path("ckpt-7") == layout.final_path("ckpt-7")


@pytest.mark.parametrize("bad", ["", "a\0b", "z" * 1025, "\udc80", b"bytes", 17, None])
def test_invalid_keys_are_rejected_with_a_clear_error(bad):
    with pytest.raises(InvalidKeyError):
        validate_key(bad)


def test_odd_keys_round_trip_through_the_store(make_store, tmp_path):
    store = make_store(dirs=[str(tmp_path / "s")])
    arrays = {k: np.full(100 + i, i, dtype=np.int16) for i, k in enumerate(ODD_KEYS)}
    assert all(r.stored for r in store.submit_put(list(arrays.items())).wait())
    for k, a in arrays.items():
        got = store.get(k)
        assert got.hit and got.array().tobytes() == a.tobytes()
    outside = [p for p in files_under(tmp_path) if not p.startswith(str(tmp_path / "s") + os.sep)]
    assert outside == []
    with pytest.raises(InvalidKeyError):
        store.put("a\0b", np.zeros(4))
    with pytest.raises(InvalidKeyError):
        store.submit_get([""])
