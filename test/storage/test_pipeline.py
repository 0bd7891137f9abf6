"""The transfer pipeline's shape: what runs beside the I/O, and what is left after it.

A logging plain-file session records every transfer, and an executor that runs each job the moment it
is submitted (or, to keep the pool busy, only when its result is asked for) stands in for the checksum
pool, so the order of I/O, checksums and header building is deterministic: these tests check the
structure of the overlap, not timings (the speed is measured by benchmark/storage_io.py).
"""
import os
from concurrent.futures import Future

import numpy as np
import pytest

import histate.storage.transfer as transfer
from histate.storage.buffers import aligned_empty
from histate.storage.file_backend import FileSession
from histate.storage.format import DEFAULT_CHECKSUM, ItemSpec, file_bytes_for
from histate.storage.transfer import PipelineConfig, _plan_pieces, read_items, write_items

MiB = 1 << 20


class _InlineExecutor:
    """Runs a job when it is submitted (in the submitting thread), so its place in the log is fixed."""

    def submit(self, fn, *args):
        fut = Future()
        fut.set_result(fn(*args))
        return fut


class _LoggingSession(FileSession):
    def __init__(self, log):
        super().__init__(io_threads=0, preallocate=False)
        self.log = log

    def submit(self, f, op, segments):
        self.log.append((op, sum(v.size for _, v in segments)))
        return super().submit(f, op, segments)

    def run(self, f, op, segments):
        self.wait(self.submit(f, op, segments))


def _piece_bytes(pieces):
    return [sum(stop - start for _slot, start, stop in p.ranges) for p in pieces]


@pytest.mark.parametrize("sizes, expected_mib", [
    ([256 << 10] * 64, [8, 4, 2, 1, 1]),  # a 64-page KV pack
    ([64 * MiB], [16, 16, 16, 8, 4, 2, 1, 1]),  # a 64 MiB checkpoint
    ([MiB], [1]),
])
def test_read_pieces_halve_towards_the_end(sizes, expected_mib):
    pieces = _plan_pieces(sizes, 16 * MiB, MiB, tail_bytes=MiB)
    assert _piece_bytes(pieces) == [n * MiB for n in expected_mib]
    ranges = [r for p in pieces for r in p.ranges]
    # every item exactly once, in order, cut only at chunk multiples
    for slot, size in enumerate(sizes):
        mine = [(start, stop) for s, start, stop in ranges if s == slot]
        assert mine[0][0] == 0 and mine[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert all(start % MiB == 0 for start, _ in mine)
    assert [r[0] for r in ranges] == sorted(r[0] for r in ranges)


def test_without_a_tail_pieces_keep_the_step():
    pieces = _plan_pieces([5 * MiB, 3 * MiB, 100], 2 * MiB, MiB)
    assert _piece_bytes(pieces) == [2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 100]


def _specs_and_pages(num_pages, page_bytes, seed=0):
    pool = aligned_empty(num_pages * page_bytes)
    pool[:] = np.random.default_rng(seed).integers(0, 256, pool.size, dtype=np.uint8)
    pages = [pool[i * page_bytes: (i + 1) * page_bytes] for i in range(num_pages)]
    return [ItemSpec(f"kv/{i}", page_bytes, "|u1", (page_bytes,)) for i in range(num_pages)], pages


def _new_file(sess, tmp_path, file_bytes):
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return sess.create(dir_fd, "f.tmp-1-1", file_bytes, direct=False, label="f")
    finally:
        os.close(dir_fd)


def _cfg():
    return PipelineConfig(checksum_pool=_InlineExecutor(), checksum_algo=DEFAULT_CHECKSUM)


def _write_pack(tmp_path, log):
    """A pack of 64 pages of 256 KiB written through a logging session: (session, header, pages)."""
    sess = _LoggingSession(log)
    specs, pages = _specs_and_pages(64, 256 << 10)
    f = _new_file(sess, tmp_path, file_bytes_for(specs, MiB))
    try:
        header = write_items(sess, f, 7, specs, pages, _cfg())
    finally:
        sess.close(f)
    return sess, header, pages


def test_a_write_seals_its_header_beside_the_payload(tmp_path, monkeypatch):
    """Checksums and the header are built by one pool job submitted before the payload's write, so
    once the payload lands only the header's own write is left (before: the header was built after
    the payload write returned). The inline executor runs that job at once."""
    log = []
    real_build = transfer.build_header
    monkeypatch.setattr(transfer, "build_header", lambda *a: (log.append(("build_header",)), real_build(*a))[1])
    sess, header, _pages = _write_pack(tmp_path, log)
    payload = ("WRITE", header.header_bytes + 64 * (256 << 10))  # zeroed header block + every page, one call
    assert log == [("build_header",), payload, ("WRITE", header.header_bytes)]
    sess.shutdown()


def test_a_read_verifies_each_piece_before_reading_the_next(tmp_path, monkeypatch):
    """Only the last piece (one chunk) is verified after the last read; every byte is verified once."""
    log = []
    sess, header, pages = _write_pack(tmp_path, log)
    real_checksum = transfer.chunk_checksum
    monkeypatch.setattr(transfer, "chunk_checksum", lambda chunk, *a: (log.append(("VERIFY", chunk.size)),
                                                                       real_checksum(chunk, *a))[1])
    log.clear()
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    f = sess.open_read(dir_fd, "f.tmp-1-1", direct=False, label="f")
    os.close(dir_fd)
    outs = [np.empty(256 << 10, np.uint8) for _ in range(64)]
    try:
        faults = read_items(sess, f, header, list(range(64)), outs, _cfg(), verify_header=False)
    finally:
        sess.close(f)
    assert faults == [None] * 64 and all(o.tobytes() == p.tobytes() for o, p in zip(outs, pages))
    reads = [n for op, n in log if op == "READ"]
    assert reads == [8 * MiB, 4 * MiB, 2 * MiB, MiB, MiB]
    last_read = max(i for i, (op, _) in enumerate(log) if op == "READ")
    assert sum(n for op, n in log[last_read:] if op == "VERIFY") == MiB
    assert sum(n for op, n in log if op == "VERIFY") == 64 * (256 << 10)
    # piece k's verification is handed to the pool before piece k+1 is read (here it runs at once)
    verified_before = [sum(n for op, n in log[:i] if op == "VERIFY") for i, (op, _) in enumerate(log) if op == "READ"]
    assert verified_before == [0, 8 * MiB, 12 * MiB, 14 * MiB, 15 * MiB]
    sess.shutdown()



class _DeferredExecutor:
    """Holds each job until its result is asked for: the pool stays busy with its first job."""

    def __init__(self):
        self.jobs = []

    def submit(self, fn, *args):
        self.jobs.append(args[0])  # the piece

        class _Later(Future):
            def result(self, timeout=None):
                if not self.done():
                    self.set_result(fn(*args))
                return super().result(timeout)

        return _Later()


class _LandedAtOnce(_LoggingSession):
    """Asynchronous to the pipeline, but every posted piece has landed when it is first polled: the
    case of posted pieces completing together (as the NIXL queue's did on the reference VM)."""

    def __init__(self, log):
        super().__init__(log)
        self.synchronous = False

    def poll(self, token):
        return True


def test_pieces_that_land_together_are_verified_on_two_threads(tmp_path, monkeypatch):
    """An idle pool takes a landed piece while this thread verifies the next ones (before: with an
    asynchronous session every piece was verified in the waiting thread, one after the other)."""
    log = []
    sess, header, pages = _write_pack(tmp_path, log)
    sess.shutdown()
    sess = _LandedAtOnce(log)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    f = sess.open_read(dir_fd, "f.tmp-1-1", direct=False, label="f")
    os.close(dir_fd)
    pool = _DeferredExecutor()
    outs = [np.empty(256 << 10, np.uint8) for _ in range(64)]
    try:
        faults = read_items(sess, f, header, list(range(64)), outs, PipelineConfig(checksum_pool=pool),
                            verify_header=False)
    finally:
        sess.close(f)
    assert faults == [None] * 64 and all(o.tobytes() == p.tobytes() for o, p in zip(outs, pages))
    assert _piece_bytes(pool.jobs) == [8 * MiB]  # the first piece; the pool stays busy with it
    sess.shutdown()
