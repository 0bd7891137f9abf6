"""Moving the items of one file between host buffers and the file: pipelined I/O, checksums beside it.

The payloads of the items being moved are cut into pieces of about `piece_bytes` (an item larger than
that spans several pieces, cut at multiples of the chunk size; small items share a piece). Writes post
piece k and checksum it while the disk works, keeping up to `max_inflight` pieces in flight, then
write the header (it holds the checksums) last, over a zero placeholder written with piece 0; a file
that fits one piece is a single vectored call, header included. Reads post the pieces of the items
asked for and verify each chunk as it lands; one item's checksum mismatch fails that item only. So
checksum cost overlaps I/O instead of adding to it. With O_DIRECT, host memory that is not block
aligned (and the partial last block of each item) goes through session-owned, registered bounce
buffers; aligned caller memory is transferred in place.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from histate.storage.buffers import address_of
from histate.storage.format import (ALIGN_BYTES, DEFAULT_CHECKSUM, FileHeader, FormatError, ItemSpec, align_up,
                                    build_header, chunk_checksum, chunk_seed, decode_header, encode_header,
                                    header_bytes_for, item_offsets, item_seed)
from histate.storage.io_base import IoSession, OpenFile, Segment
from histate.storage.results import Fault, IoFault

SINGLE_CALL_MAX_BYTES = 4 << 20  # up to this payload a write is one call, header included (checksums first)


@dataclass(frozen=True)
class PipelineConfig:
    chunk_bytes: int = 1 << 20  # checksum granularity (recorded in each file's header)
    piece_bytes: int = 8 << 20  # I/O unit of the pipeline; rounded to a multiple of chunk_bytes
    max_inflight: int = 4  # pieces posted but not yet completed
    checksum_pool: Executor | None = None  # where checksums run when the session's I/O blocks this thread
    checksum_algo: int = DEFAULT_CHECKSUM  # for new files (reads use the file's own)


class _Range(NamedTuple):
    slot: int  # which of the items being moved
    start: int  # payload offset within the item
    stop: int


@dataclass
class _Piece:
    ranges: list[_Range]
    segments: list[Segment] = field(default_factory=list)
    copy_back: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (staging, destination)
    token: object = None


def _step(cfg: PipelineConfig, chunk_bytes: int) -> int:
    return max(1, cfg.piece_bytes // chunk_bytes) * chunk_bytes


def _plan_pieces(sizes: Sequence[int], step: int) -> list[_Piece]:
    """Cut the items (in order) into pieces of about `step` bytes; item cuts fall on multiples of step."""
    pieces, current, current_bytes = [], [], 0
    for slot, size in enumerate(sizes):
        for start in range(0, size, step):
            stop = min(start + step, size)
            current.append(_Range(slot, start, stop))
            current_bytes += align_up(stop - start)
            if current_bytes >= step:
                pieces.append(_Piece(current))
                current, current_bytes = [], 0
    if current:
        pieces.append(_Piece(current))
    return pieces


def _addresses(f: OpenFile, hosts: Sequence[np.ndarray]) -> list[int] | None:
    """Base address of each host buffer, when O_DIRECT needs them (alignment is checked per range)."""
    return [address_of(h) for h in hosts] if f.direct else None


def _bounce_bytes(ranges: Sequence[_Range], addrs: list[int] | None) -> int:
    """Staging needed under O_DIRECT: the partial last block of aligned ranges, all of unaligned ones."""
    if addrs is None:
        return 0
    total = 0
    for slot, start, stop in ranges:
        size = stop - start
        if (addrs[slot] + start) % ALIGN_BYTES:
            total += align_up(size)
        elif size % ALIGN_BYTES:
            total += ALIGN_BYTES
    return total


def _map_piece(sess: IoSession, piece: _Piece, hosts: Sequence[np.ndarray], addrs: list[int] | None,
               offsets: Sequence[int], slot: int, writing: bool) -> None:
    """Segments for every range of `piece`, bouncing through staging what O_DIRECT rejects."""
    if addrs is None:
        piece.segments += [(offsets[r.slot] + r.start, hosts[r.slot][r.start: r.stop]) for r in piece.ranges]
        return
    need = _bounce_bytes(piece.ranges, addrs)
    stage = sess.staging(f"bounce{slot}", need) if need else None
    pos = 0
    for r in piece.ranges:
        offset = offsets[r.slot] + r.start
        view = hosts[r.slot][r.start: r.stop]
        if (addrs[r.slot] + r.start) % ALIGN_BYTES == 0:
            body = view.size - view.size % ALIGN_BYTES
            if body:
                piece.segments.append((offset, view[:body]))
            offset, view = offset + body, view[body:]
            if not view.size:
                continue
        padded = align_up(view.size)
        buf = stage[pos: pos + padded]
        pos += padded
        if writing:
            buf[view.size:] = 0
            buf[: view.size] = view
        else:
            piece.copy_back.append((buf[: view.size], view))
        piece.segments.append((offset, buf))


def _checksums(host: np.ndarray, r: _Range, chunk_bytes: int, algo: int, seed: int, between=None) -> list[int]:
    sums = []
    for i in range(r.start, r.stop, chunk_bytes):
        sums.append(chunk_checksum(host[i: min(i + chunk_bytes, r.stop)], algo, chunk_seed(seed, i // chunk_bytes)))
        if between is not None:
            between()
    return sums


def _piece_checksums(piece: _Piece, hosts, chunk_bytes: int, algo: int, seeds, between=None):
    return [(r.slot, _checksums(hosts[r.slot], r, chunk_bytes, algo, seeds[r.slot], between)) for r in piece.ranges]


def _checksum_pool(cfg: PipelineConfig, sess: IoSession) -> Executor | None:
    """Checksums overlap the I/O: with a synchronous session (plain syscalls in this thread) they run in
    the pool; with an asynchronous one (NIXL) they run here, polling the queue between chunks (NIXL's
    POSIX queue only advances when polled), which costs no thread hand-off."""
    return cfg.checksum_pool if sess.synchronous else None


def _spawn(pool: Executor | None, fn, *args, between=None):
    return fn(*args, between=between) if pool is None else pool.submit(fn, *args)


def _result(job):
    return job.result() if isinstance(job, Future) else job


def _poller(sess: IoSession, inflight: deque):
    def poll() -> None:
        for piece in inflight:
            sess.poll(piece.token)
    return poll


def _drain(sess: IoSession, inflight: deque) -> None:
    """Wait out every posted piece after a failure (buffers and fds must outlive the I/O)."""
    while inflight:
        try:
            sess.wait(inflight.popleft().token)
        except Exception:
            pass


def _staged_header(sess: IoSession, header: FileHeader, live: Sequence[bool] | None = None) -> np.ndarray:
    hdr = sess.staging("header", header.header_bytes)
    hdr[:] = np.frombuffer(encode_header(header, live), dtype=np.uint8)
    return hdr


def _zero_header(sess: IoSession, header_bytes: int) -> np.ndarray:
    """Placeholder for the header block, written with the first piece: on ext4/XFS an O_DIRECT write
    into an unallocated or unwritten block needs a journalled extent change (~0.2-1 ms on the reference
    VM), an overwrite of a written block does not; and zeros fail the magic check if we crash. The
    staging buffer is zero-filled when allocated and never written."""
    return sess.staging("zero_header", header_bytes)


def write_items(sess: IoSession, f: OpenFile, seq: int, specs: Sequence[ItemSpec], hosts: Sequence[np.ndarray],
                cfg: PipelineConfig) -> FileHeader:
    """Fill the new file `f` (sized for `specs`) with every item's payload and the header; returns it."""
    chunk_bytes, algo = cfg.chunk_bytes, cfg.checksum_algo
    header_bytes = header_bytes_for(specs, chunk_bytes)
    offsets = item_offsets(specs, header_bytes)
    seeds = [item_seed(s.key, seq) for s in specs]
    step = _step(cfg, chunk_bytes)
    pieces = _plan_pieces([s.payload_bytes for s in specs], step)
    sums: list[list[int]] = [[] for _ in specs]
    if sum(s.payload_bytes for s in specs) <= min(step, SINGLE_CALL_MAX_BYTES):
        # small file: checksums first, then one vectored call for header + payloads (cheaper than a
        # second I/O for the header)
        for piece in pieces:
            for slot, part in _piece_checksums(piece, hosts, chunk_bytes, algo, seeds):
                sums[slot] += part
        header = build_header(seq, chunk_bytes, algo, specs, sums)
        segments = [(0, _staged_header(sess, header))]
        addrs = _addresses(f, hosts)
        for piece in pieces:
            _map_piece(sess, piece, hosts, addrs, offsets, 0, True)
            segments += piece.segments
        sess.run(f, "WRITE", segments)
        return header
    # The I/O: the whole payload in one vectored call when staging stays small (aligned sources, or
    # buffered I/O): one syscall, or one transfer to post; otherwise piece by piece, at most
    # `max_inflight` in flight (they share the staging slots). Checksums go piece by piece meanwhile.
    addrs = _addresses(f, hosts)
    all_ranges = [r for p in pieces for r in p.ranges]
    io_pieces = [_Piece(all_ranges)] if _bounce_bytes(all_ranges, addrs) <= step else pieces
    inflight: deque[_Piece] = deque()
    between = _poller(sess, inflight)
    posted = 0

    def prepare(k: int) -> _Piece:
        piece = io_pieces[k]
        _map_piece(sess, piece, hosts, addrs, offsets, k % cfg.max_inflight, True)
        if k == 0:  # zeros now (an invalid header) so the real one later rewrites allocated blocks
            piece.segments.insert(0, (0, _zero_header(sess, header_bytes)))
        return piece

    def post(piece: _Piece | None = None) -> None:
        nonlocal posted
        piece = piece or prepare(posted)
        piece.token = sess.submit(f, "WRITE", piece.segments)
        inflight.append(piece)
        posted += 1

    pool = _checksum_pool(cfg, sess)
    try:
        first = prepare(0)  # before the pool starts: its Python would compete for the GIL
        # with a pool, every piece's checksum starts now, beside the I/O that runs in this thread
        jobs = [pool.submit(_piece_checksums, p, hosts, chunk_bytes, algo, seeds) for p in pieces] if pool else []
        post(first)
        while posted < len(io_pieces) and len(inflight) < cfg.max_inflight:
            post()
        for piece in pieces:
            if pool is None:  # here, while the disk writes, polling the queue between chunks
                jobs.append(_piece_checksums(piece, hosts, chunk_bytes, algo, seeds, between))
            if posted < len(io_pieces):
                sess.wait(inflight.popleft().token)
                post()
        for job in jobs:
            for slot, part in _result(job):
                sums[slot] += part
        header = build_header(seq, chunk_bytes, algo, specs, sums)
        hdr = _staged_header(sess, header)
        while inflight:
            sess.wait(inflight.popleft().token)
    finally:
        _drain(sess, inflight)
    sess.run(f, "WRITE", [(0, hdr)])
    return header


def _verify(out: np.ndarray, r: _Range, header: FileHeader, index: int, between=None) -> None:
    item = header.items[index]
    cb = header.chunk_bytes
    seed = item_seed(item.key, header.seq)
    for i in range(r.start, r.stop, cb):
        try:
            found = chunk_checksum(out[i: min(i + cb, r.stop)], header.checksum_algo, chunk_seed(seed, i // cb))
        except FormatError as exc:
            raise IoFault(Fault.CORRUPT, f"{item.key!r}: {exc}") from None
        if found != item.chunk_checksums[i // cb]:
            raise IoFault(Fault.CORRUPT, f"payload checksum mismatch in chunk {i // cb} of {item.key!r}")
        if between is not None:
            between()


def _verify_piece(piece: _Piece, outs, header: FileHeader, indices, between=None) -> list[tuple[int, IoFault]]:
    """Checksum every range of a piece; the faults found, per slot (an item's fault fails that item only)."""
    faults = []
    for r in piece.ranges:
        try:
            _verify(outs[r.slot], r, header, indices[r.slot], between)
        except IoFault as fault:
            faults.append((r.slot, fault))
    return faults


def _check_header(buf: np.ndarray, expected: FileHeader, label: str) -> None:
    try:
        found, _live = decode_header(buf)
    except FormatError as exc:
        raise IoFault(Fault.CORRUPT, f"{label}: {exc}") from None
    if found != expected:
        raise IoFault(Fault.CORRUPT, f"{label}: header differs from the index")


def read_items(sess: IoSession, f: OpenFile, header: FileHeader, indices: Sequence[int], outs: Sequence[np.ndarray],
               cfg: PipelineConfig, verify_header: bool) -> list[IoFault | None]:
    """Fill `outs[j]` (flat uint8, the item's payload size) with item `indices[j]` of `f`, verifying every
    chunk. Returns one entry per item: None, or the IoFault that failed it (a checksum mismatch). A
    fault of the whole file (size, I/O error, header mismatch when `verify_header`) raises IoFault."""
    if f.size_bytes != header.file_bytes:
        fault = Fault.SHORT_FILE if f.size_bytes < header.file_bytes else Fault.CORRUPT
        raise IoFault(fault, f"{f.path} holds {f.size_bytes} bytes, its header needs {header.file_bytes}")
    offsets = [header.items[i].offset for i in indices]
    pieces = _plan_pieces([header.items[i].payload_bytes for i in indices], _step(cfg, header.chunk_bytes))
    hdr = sess.staging("header", header.header_bytes) if verify_header else None
    addrs = _addresses(f, outs)
    results: list[IoFault | None] = [None] * len(indices)
    if len(pieces) <= 1:  # small read: one vectored call
        segments = [(0, hdr)] if hdr is not None else []
        for piece in pieces:
            _map_piece(sess, piece, outs, addrs, offsets, 0, False)
            segments += piece.segments
        if segments:
            sess.run(f, "READ", segments)
        if hdr is not None:
            _check_header(hdr, header, f.path)
        for piece in pieces:
            for staged, dest in piece.copy_back:
                dest[:] = staged
            for slot, fault in _verify_piece(piece, outs, header, indices):
                results[slot] = results[slot] or fault
        return results
    pending = deque(enumerate(pieces))
    inflight: deque[_Piece] = deque()
    between = _poller(sess, inflight)
    checks = []

    def post() -> None:
        k, piece = pending.popleft()
        _map_piece(sess, piece, outs, addrs, offsets, k % cfg.max_inflight, False)
        segments = ([(0, hdr)] if (k == 0 and hdr is not None) else []) + piece.segments
        piece.token = sess.submit(f, "READ", segments)
        inflight.append(piece)

    window = 1 if sess.synchronous else cfg.max_inflight  # a synchronous session reads while the pool verifies
    pool = _checksum_pool(cfg, sess)
    try:
        while pending and len(inflight) < window:
            post()
        first = True
        while inflight:
            piece = inflight.popleft()
            sess.wait(piece.token)
            if first and hdr is not None:
                _check_header(hdr, header, f.path)
            first = False
            for staged, dest in piece.copy_back:  # before its bounce slot is posted again
                dest[:] = staged
            # verify piece k while the disk reads the next ones (in the pool, or here between polls); a
            # synchronous session reads in this thread, so the pool gets its job first
            if pending and not sess.synchronous:
                post()
            checks.append(_spawn(pool, _verify_piece, piece, outs, header, indices, between=between))
            if pending and sess.synchronous:
                post()
    finally:
        _drain(sess, inflight)
    for job in checks:
        for slot, fault in _result(job):
            results[slot] = results[slot] or fault
    return results
