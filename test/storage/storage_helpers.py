"""Shared helpers for the storage tests (deterministic payloads, a manual clock, file listing)."""
from __future__ import annotations

import os
import zlib

import numpy as np


class ManualClock:
    """Deterministic time for residence-time assertions."""

    def __init__(self, now_s: float = 1000.0):
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s



def versioned_payload(key: str, version: int, num_bytes: int) -> np.ndarray:
    """Deterministic bytes for (key, version); the first 8 bytes carry the version so a reader can
    regenerate exactly what was written for whatever version it was served."""
    num_bytes = max(num_bytes, 8)
    rng = np.random.default_rng([zlib.crc32(key.encode()), version])
    out = rng.integers(0, 256, num_bytes, dtype=np.uint8)
    out[:8] = np.frombuffer(np.uint64(version).tobytes(), dtype=np.uint8)
    return out


def version_of(buf: np.ndarray) -> int:
    return int(np.frombuffer(buf[:8].tobytes(), dtype=np.uint64)[0])


def files_under(root) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        out.extend(os.path.join(dirpath, n) for n in names)
    return sorted(out)


def snapshot_tree(root) -> dict[str, bytes]:
    """Relative path -> content of every regular file under `root` (symlinks: their target)."""
    out = {}
    for path in files_under(root):
        rel = os.path.relpath(path, root)
        if os.path.islink(path):
            out[rel] = b"-> " + os.readlink(path).encode()
        else:
            with open(path, "rb") as fh:
                out[rel] = fh.read()
    return out


def root_id_of(root) -> int:
    """The random id a store root's marker records (what its files carry as proof of ownership)."""
    from histate.storage.ownership import MARKER_NAME, parse_marker

    with open(os.path.join(root, MARKER_NAME), "rb") as fh:
        return parse_marker(fh.read())


def temp_name_in(root, final_path: str, pid: int = 999, n: int = 1) -> str:
    """Where a write to `final_path` that died would have left its temp file."""
    stem = final_path.rsplit(".", 1)[0]
    return f"{stem}.tmp-{root_id_of(root):016x}-{pid}-{n}"
