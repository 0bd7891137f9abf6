"""Crash safety: SIGKILL a writer mid-stream, restart, and every checkpoint served is byte-identical.

The writer freezes one write half-way (pieces on disk, header not yet written) before it is killed,
so a torn temp file is guaranteed to exist at the crash, not just likely. Without power loss the page
cache survives the process, so every put acknowledged before the kill must still be served. Run with
single objects and with packed batches (four checkpoints per file).
"""
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from histate.storage import CheckpointStore, StoreConfig

from storage_helpers import files_under, version_of, versioned_payload

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crash_writer import payload_bytes  # noqa: E402


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pack", [False, True], ids=["objects", "packed"])
def test_sigkill_mid_stream_then_restart(tmp_path, backend, pack):
    root = str(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "crash_writer.py"), root, backend, "30",
                             *(["pack"] if pack else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    acked: dict[str, int] = {}
    watchdog = threading.Timer(90, proc.kill)  # a writer that never pauses must not hang the suite
    watchdog.start()
    try:
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "ack":
                key, version = rest.split()
                acked[key] = max(acked.get(key, -1), int(version))
            elif word == "paused":
                break
        else:
            pytest.fail(f"writer ended without pausing (rc {proc.wait()}): {proc.stderr.read()[-2000:]}")
    finally:
        watchdog.cancel()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    torn = [f for f in files_under(root) if ".tmp-" in f]
    assert torn, "the frozen write should have left a temp file"
    assert len(acked) == 20 and max(acked.values()) >= 1  # every key written, some overwritten

    with CheckpointStore(StoreConfig(dirs=[root], capacity_bytes=1 << 34, backend=backend)) as store:
        report = store.rebuild_report
        assert report.reasons.get("temp", 0) == len(torn)
        assert not [f for f in files_under(root) if ".tmp-" in f]
        assert set(acked) <= set(store.keys())
        served = store.submit_get(store.keys()).wait(120)
        for r in served:
            assert r.hit, (r.key, r.fault)
            v = version_of(r.buffer)
            assert v >= acked.get(r.key, 0), f"{r.key}: served version {v} older than acknowledged {acked[r.key]}"
            expected = versioned_payload(r.key, v, payload_bytes(r.key, v))
            assert r.buffer.size == expected.size and np.array_equal(r.buffer, expected), r.key
