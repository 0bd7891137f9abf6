"""Fixtures for the storage tests: a store factory per backend, a manual clock, a small real file system.

NIXL tests skip cleanly when nixl cannot import or its POSIX backend cannot start; the plain-file
backend always runs. Stores made by `make_store` are closed at teardown.
"""
from __future__ import annotations

import functools
import subprocess

import pytest

from histate.storage import CheckpointStore, StoreConfig, nixl_available
from storage_helpers import ManualClock

BACKENDS = ["file", "nixl"]


@functools.lru_cache(maxsize=None)
def _nixl_ok() -> bool:
    return nixl_available()


def require_backend(name: str) -> None:
    if name == "nixl" and not _nixl_ok():
        pytest.skip("nixl not importable or its POSIX backend cannot start here")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    require_backend(request.param)
    return request.param


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_store(tmp_path, backend):
    stores: list[CheckpointStore] = []

    def make(dirs=None, capacity_bytes=1 << 30, **kw) -> CheckpointStore:
        callbacks = {k: kw.pop(k) for k in ("on_capacity_needed", "on_evict", "clock") if k in kw}
        cfg = StoreConfig(dirs=dirs or [str(tmp_path / "store")], capacity_bytes=capacity_bytes,
                          backend=kw.pop("backend", backend), **kw)
        store = CheckpointStore(cfg, **callbacks)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close(flush=False)


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MiB tmpfs (real ENOSPC). Needs mount privileges; skipped where they are missing."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
