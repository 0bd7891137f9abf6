"""The O_DIRECT probe: only EINVAL means "refused"; a probe that cannot tell is logged once and retried.

Why: any error of the probe at start (a full disk, a read-only root, no permission) used to turn O_DIRECT
off for the life of the process, silently. Errors here are injected at `os.open` of the probe's file
only, so the store's own files are untouched by the injection.
"""
import errno
import logging
import os

import numpy as np
import pytest

from histate.storage import io_base
from histate.storage.io_base import DIRECT_PROBE_RETRY_S, probe_direct_io

REAL_OPEN = os.open


def _failing_probe_open(monkeypatch, code: int, times: int) -> list:
    """`os.open` of a probe file fails with `code` the first `times` times; returns the calls seen."""
    calls = []

    def fake_open(path, flags, *args, **kw):
        if os.fspath(path).startswith("probe.tmp-"):
            calls.append(path)
            if len(calls) <= times:
                raise OSError(code, os.strerror(code), path)
        return REAL_OPEN(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    return calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO])
def test_an_error_that_says_nothing_about_o_direct_is_not_a_verdict(tmp_path, monkeypatch, code):
    _failing_probe_open(monkeypatch, code, times=1)
    dir_fd = REAL_OPEN(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError):
            probe_direct_io(dir_fd, "probe.tmp-1")
        assert probe_direct_io(dir_fd, "probe.tmp-2") in (True, False)  # the next probe decides
    finally:
        os.close(dir_fd)


def test_einval_is_a_refusal(tmp_path, monkeypatch):
    _failing_probe_open(monkeypatch, errno.EINVAL, times=1)
    dir_fd = REAL_OPEN(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert probe_direct_io(dir_fd, "probe.tmp-1") is False
    finally:
        os.close(dir_fd)


def _o_direct_works_here(tmp_path) -> bool:
    dir_fd = REAL_OPEN(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return probe_direct_io(dir_fd, "probe.tmp-check")
    finally:
        os.close(dir_fd)


def test_a_store_opened_on_a_full_disk_retries_the_probe_later(make_store, clock, monkeypatch, caplog, tmp_path):
    """Two undecided probes (at open, and one retry), then one that decides: buffered I/O meanwhile,
    one warning in all, and O_DIRECT (where the file system takes it) once the disk has room again."""
    works = _o_direct_works_here(tmp_path)
    calls = _failing_probe_open(monkeypatch, errno.ENOSPC, times=2)
    caplog.set_level(logging.WARNING, logger=io_base.__name__)
    store = make_store(clock=clock)
    root = store.layout.roots[0]
    assert store.direct_io == {root: False} and len(calls) == 1
    assert store.put("a", np.ones(10_000, np.uint8)).stored and len(calls) == 1  # not due yet: no probe
    clock.advance(DIRECT_PROBE_RETRY_S)
    assert store.put("b", np.ones(10_000, np.uint8)).stored and len(calls) == 2  # due: probed, still full
    assert store.direct_io == {root: False}
    clock.advance(DIRECT_PROBE_RETRY_S)
    assert store.get("a").hit and len(calls) == 3  # due again: this probe decides
    assert store.direct_io == {root: works}
    assert store.put("c", np.ones(10_000, np.uint8)).stored and len(calls) == 3  # decided: never again
    assert all(store.get(k).hit for k in "abc")
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()


def test_direct_io_false_never_probes(make_store, monkeypatch):
    calls = _failing_probe_open(monkeypatch, errno.ENOSPC, times=0)
    store = make_store(direct_io=False)
    assert store.put("a", np.ones(100, np.uint8)).stored and calls == []
    assert not any(store.direct_io.values())
