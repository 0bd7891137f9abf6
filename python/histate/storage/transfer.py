"""Moving the items of one file between host buffers and the file: pipelined I/O, checksums beside it.

The payloads being moved are cut into pieces of about `piece_bytes` (`_plan_pieces`; an item larger
than that spans several pieces, cut at multiples of the chunk size; small items share a piece).

Writes post the payload -- in one vectored call when no bounce buffer is needed, else piece by piece
with up to `max_inflight` in flight -- with a zero placeholder for the header block. Meanwhile every
chunk is checksummed, the header is built and encoded and the caller's `on_sealed` runs (the store
prepares the file's index entries and put results there): on the checksum pool beside a synchronous
session's syscall, or in this thread between polls of an asynchronous session. So when the payload
has landed only the header's own write is left. A file up to SINGLE_CALL_MAX_BYTES is checksummed
first and written in one call, header included.

Reads post the pieces of the items asked for and verify piece k while later pieces are read; the
pieces halve towards the end of the read, down to one chunk, so only one small piece's verification
follows the last I/O. When posted pieces land together (as NIXL's did on the reference VM), an idle
pool thread takes one while this thread verifies the next. One item's checksum mismatch fails that
item only.

With O_DIRECT, host memory that is not block aligned (and the partial last block of each item) goes
through session-owned, registered bounce buffers; aligned caller memory is transferred in place.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Executor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from histate.storage.buffers import address_of
from histate.storage.format import (ALIGN_BYTES, DEFAULT_CHECKSUM, DEFAULT_CHUNK_BYTES, FileHeader, FormatError,
                                    ItemSpec, align_up, build_header, chunk_checksum, chunk_seed, encode_header,
                                    header_bytes_for, header_matches, item_offsets, item_seed)
from histate.storage.io_base import IoSession, OpenFile, Segment
from histate.storage.results import Fault, IoFault

SINGLE_CALL_MAX_BYTES = 4 << 20  # up to this payload a write is one call, header included (checksums first)


@dataclass(frozen=True)
class PipelineConfig:
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # checksum granularity (recorded in each file's header)
    piece_bytes: int = 8 << 20  # I/O unit of the pipeline; rounded to a multiple of chunk_bytes
    max_inflight: int = 4  # pieces posted but not yet completed
    checksum_pool: Executor | None = None  # where checksums run when the session's I/O blocks this thread
    checksum_algo: int = DEFAULT_CHECKSUM  # for new files (reads use the file's own)


_Range = tuple[int, int, int]  # (slot: which of the items being moved, start, stop: payload offsets in it)


@dataclass
class _Piece:
    ranges: list[_Range]
    segments: list[Segment] = field(default_factory=list)
    copy_back: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (staging, destination)
    token: object = None


def _step(cfg: PipelineConfig, chunk_bytes: int) -> int:
    return max(1, cfg.piece_bytes // chunk_bytes) * chunk_bytes


def _plan_pieces(sizes: Sequence[int], step: int, chunk_bytes: int, tail_bytes: int = 0) -> list[_Piece]:
    """Cut the items (in order) into pieces of about `step` bytes; a cut inside an item falls on a
    multiple of `chunk_bytes` (chunks are checksummed whole). With `tail_bytes`, the pieces halve
    towards the end, down to about `tail_bytes`: a read verifies piece k while it reads the later
    ones, so only the last, small piece's verification is left when the I/O ends."""
    remaining = sum(-(-size // ALIGN_BYTES) * ALIGN_BYTES for size in sizes)

    def target() -> int:
        return min(step, max(tail_bytes, remaining // 2)) if tail_bytes else step

    pieces, current, current_bytes, want = [], [], 0, target()
    for slot, size in enumerate(sizes):
        start = 0
        while start < size:
            if size <= chunk_bytes:  # a page: never cut, one range (the common case, without the arithmetic)
                stop = size
            else:
                stop = min(size, start + max(chunk_bytes, -(-(want - current_bytes) // chunk_bytes) * chunk_bytes))
            current.append((slot, start, stop))
            current_bytes += -(-(stop - start) // ALIGN_BYTES) * ALIGN_BYTES
            start = stop
            if current_bytes >= want:
                pieces.append(_Piece(current))
                remaining -= current_bytes
                current, current_bytes, want = [], 0, target()
    if current:
        pieces.append(_Piece(current))
    return pieces


def _addresses(f: OpenFile, hosts: Sequence[np.ndarray]) -> list[int] | None:
    """Base address of each host buffer, when O_DIRECT needs them (alignment is checked per range)."""
    return [address_of(h) for h in hosts] if f.direct else None


def _in_place(f: OpenFile, hosts: Sequence[np.ndarray]) -> bool:
    """Whether every host buffer moves in place: always without O_DIRECT; with it, when each starts
    and ends on a block boundary (then so does every range cut from it: cuts fall on chunk multiples).
    One pass instead of planning bounce buffers range by range."""
    return not f.direct or all(not h.size % ALIGN_BYTES and not address_of(h) % ALIGN_BYTES for h in hosts if h.size)


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
               offsets: Sequence[int], bounce_slot: int, writing: bool) -> None:
    """Segments for every range of `piece`, bouncing through staging slot `bounce_slot` what O_DIRECT
    rejects (`addrs` None: everything moves in place)."""
    if addrs is None:
        piece.segments += [(offsets[slot] + start, hosts[slot][start: stop]) for slot, start, stop in piece.ranges]
        return
    need = _bounce_bytes(piece.ranges, addrs)
    stage = sess.staging(f"bounce{bounce_slot}", need) if need else None
    pos = 0
    for slot, start, stop in piece.ranges:
        offset = offsets[slot] + start
        view = hosts[slot]
        if start or stop != view.size:
            view = view[start: stop]
        if (addrs[slot] + start) % ALIGN_BYTES == 0:
            if not view.size % ALIGN_BYTES:  # the common case: in place, whole
                piece.segments.append((offset, view))
                continue
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


def _checksum_ranges(ranges: Sequence[_Range], hosts: Sequence[np.ndarray], chunk_bytes: int, algo: int,
                     seeds: Sequence[int], sums: list[list[int]], between=None) -> None:
    """Append the checksum of every chunk of `ranges` to its item's list in `sums` (ranges in order)."""
    for slot, start, stop in ranges:
        host, seed, out = hosts[slot], seeds[slot], sums[slot]
        for i in range(start, stop, chunk_bytes):
            out.append(chunk_checksum(host[i: min(i + chunk_bytes, stop)], algo, chunk_seed(seed, i // chunk_bytes)))
            if between is not None:
                between()


def _whole_items(hosts: Sequence[np.ndarray]) -> list[_Range]:
    return [(slot, 0, h.size) for slot, h in enumerate(hosts) if h.size]


def _seal_into(hdr: np.ndarray, seq: int, chunk_bytes: int, algo: int, specs: Sequence[ItemSpec],
               hosts: Sequence[np.ndarray], sums: list[list[int]] | None, on_sealed, root_id: int) -> FileHeader:
    """Checksums (unless `sums` already holds them), the header encoded into `hdr`, then the caller's
    `on_sealed`: everything a write needs before its header's own write, in one job."""
    if sums is None:
        sums = [[] for _ in specs]
        _checksum_ranges(_whole_items(hosts), hosts, chunk_bytes, algo, [item_seed(s.key, seq) for s in specs], sums)
    header = build_header(seq, chunk_bytes, algo, specs, sums, root_id)
    hdr[:] = np.frombuffer(encode_header(header), dtype=np.uint8)
    if on_sealed is not None:
        on_sealed(header)
    return header


def _checksum_pool(cfg: PipelineConfig, sess: IoSession) -> Executor | None:
    """Checksums overlap the I/O: with a synchronous session (plain syscalls in this thread) they run in
    the pool; with an asynchronous one (NIXL) they run here, polling the queue between chunks (NIXL's
    POSIX queue only advances when polled), which costs no thread hand-off."""
    return cfg.checksum_pool if sess.synchronous else None


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


def _zero_header(sess: IoSession, header_bytes: int) -> np.ndarray:
    """Placeholder for the header block, written with the payload: on ext4/XFS an O_DIRECT write into
    an unwritten (preallocated) block needs a journalled extent change at completion, which beside
    the payload's own conversion now and then waits for a journal commit (+3 ms in about one write
    of five on the reference VM); an overwrite of a written block does not. So the real header is
    written after the payload, over these zeros. The staging buffer is zero-filled when allocated
    and never written."""
    return sess.staging("zero_header", header_bytes)


def write_items(sess: IoSession, f: OpenFile, seq: int, specs: Sequence[ItemSpec], hosts: Sequence[np.ndarray],
                cfg: PipelineConfig, header_bytes: int | None = None,
                on_sealed: Callable[[FileHeader], None] | None = None, root_id: int = 0) -> FileHeader:
    """Fill the new file `f` (sized for `specs`) with every item's payload and the header; returns it.
    `root_id` goes into the header: the store root's proof that it wrote the file (ownership.py).
    `header_bytes`, when the caller already sized the file, saves computing it again. `on_sealed(header)`
    runs once the header is known, beside the payload's I/O when the file is large enough to pipeline
    (on the checksum pool, or in this thread between polls): the caller's own per-item work for after
    the write (index records, results) costs no time on the critical path there."""
    chunk_bytes, algo = cfg.chunk_bytes, cfg.checksum_algo
    header_bytes = header_bytes or header_bytes_for(specs, chunk_bytes)
    step = _step(cfg, chunk_bytes)
    offsets = item_offsets(specs, header_bytes)
    addrs = None if _in_place(f, hosts) else _addresses(f, hosts)
    whole = _Piece(_whole_items(hosts))
    hdr = sess.staging("header", header_bytes)
    if sum(h.size for h in hosts) <= min(step, SINGLE_CALL_MAX_BYTES):
        # small file: checksums first, then one vectored call for header + payloads (cheaper than a
        # second I/O for the header)
        header = _seal_into(hdr, seq, chunk_bytes, algo, specs, hosts, None, on_sealed, root_id)
        _map_piece(sess, whole, hosts, addrs, offsets, 0, True)
        sess.run(f, "WRITE", [(0, hdr)] + whole.segments)
        return header
    # The I/O: the whole payload in one vectored call when staging stays small (aligned sources, or
    # buffered I/O): one syscall, or one transfer to post; otherwise piece by piece, at most
    # `max_inflight` in flight (they share the staging slots). Checksums and the header meanwhile.
    if _bounce_bytes(whole.ranges, addrs) <= step:
        io_pieces = [whole]
    else:
        io_pieces = _plan_pieces([h.size for h in hosts], step, chunk_bytes)
    inflight: deque[_Piece] = deque()
    posted = 0

    def prepare(k: int) -> _Piece:
        piece = io_pieces[k]
        _map_piece(sess, piece, hosts, addrs, offsets, k % cfg.max_inflight, True)
        if k == 0:  # zeros now (an invalid header), so the real one later rewrites a written block
            piece.segments.insert(0, (0, _zero_header(sess, header_bytes)))
        return piece

    def post(piece: _Piece | None = None) -> None:
        nonlocal posted
        piece = piece or prepare(posted)
        piece.token = sess.submit(f, "WRITE", piece.segments)
        inflight.append(piece)
        posted += 1

    pool = _checksum_pool(cfg, sess)
    job = None
    try:
        first = prepare(0)  # before the pool starts: its Python would compete for the GIL
        if pool is not None:  # checksums and header on the pool, beside the payload's I/O in this thread
            job = pool.submit(_seal_into, hdr, seq, chunk_bytes, algo, specs, hosts, None, on_sealed, root_id)
        post(first)
        while posted < len(io_pieces) and len(inflight) < cfg.max_inflight:
            post()
        sums: list[list[int]] = [[] for _ in specs] if job is None else []
        seeds = [item_seed(s.key, seq) for s in specs] if job is None else []
        between = _poller(sess, inflight)
        for piece in io_pieces:
            if job is None:  # here, while the disk writes, polling the queue between chunks
                _checksum_ranges(piece.ranges, hosts, chunk_bytes, algo, seeds, sums, between)
            if posted < len(io_pieces):
                sess.wait(inflight.popleft().token)
                post()
        if job is None:
            header = _seal_into(hdr, seq, chunk_bytes, algo, specs, hosts, sums, on_sealed, root_id)
        while inflight:
            sess.wait(inflight.popleft().token)
        if job is not None:
            header = job.result()
    finally:
        _drain(sess, inflight)
        if job is not None:
            futures_wait([job])  # it writes into `hdr` and runs on_sealed: done before anything else
    sess.run(f, "WRITE", [(0, hdr)])
    return header


def _verify_piece(piece: _Piece, outs: Sequence[np.ndarray], header: FileHeader, indices: Sequence[int],
                  between=None) -> list[tuple[int, IoFault]]:
    """Checksum every range of a piece; the faults found, per slot (an item's fault fails that item only)."""
    faults = []
    cb, algo, seeds = header.chunk_bytes, header.checksum_algo, header.item_seeds
    for slot, start, stop in piece.ranges:
        index, out = indices[slot], outs[slot]
        expected, seed = header.items[index].chunk_checksums, seeds[index]
        for i in range(start, stop, cb):
            try:
                found = chunk_checksum(out[i: min(i + cb, stop)], algo, chunk_seed(seed, i // cb))
            except FormatError as exc:
                faults.append((slot, IoFault(Fault.CORRUPT, f"{header.items[index].key!r}: {exc}")))
                break
            if found != expected[i // cb]:
                faults.append((slot, IoFault(Fault.CORRUPT, f"payload checksum mismatch in chunk {i // cb} of "
                                                            f"{header.items[index].key!r}")))
                break
            if between is not None:
                between()
    return faults


def _check_header(buf: np.ndarray, expected: FileHeader, label: str) -> None:
    if not header_matches(buf, expected):
        raise IoFault(Fault.CORRUPT, f"{label}: header differs from the index")


def read_items(sess: IoSession, f: OpenFile, header: FileHeader, indices: Sequence[int], outs: Sequence[np.ndarray],
               cfg: PipelineConfig, verify_header: bool) -> list[IoFault | None]:
    """Fill `outs[j]` (flat uint8, the item's payload size) with item `indices[j]` of `f`, verifying every
    chunk. Returns one entry per item: None, or the IoFault that failed it (a checksum mismatch). A
    fault of the whole file (size, I/O error, header mismatch when `verify_header`) raises IoFault."""
    if f.size_bytes != header.file_bytes:
        fault = Fault.SHORT_FILE if f.size_bytes < header.file_bytes else Fault.CORRUPT
        raise IoFault(fault, f"{f.path} holds {f.size_bytes} bytes, its header needs {header.file_bytes}")
    items, cb = header.items, header.chunk_bytes
    offsets = [items[i].offset for i in indices]
    pieces = _plan_pieces([items[i].payload_bytes for i in indices], _step(cfg, cb), cb, tail_bytes=cb)
    hdr = sess.staging("header", header.header_bytes) if verify_header else None
    addrs = None if _in_place(f, outs) else _addresses(f, outs)
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
    premapped = addrs is None or not _bounce_bytes([r for p in pieces for r in p.ranges], addrs)
    if premapped:  # no staging slot to reuse: map every piece now, not between two reads
        for piece in pieces:
            _map_piece(sess, piece, outs, addrs, offsets, 0, False)

    def post() -> None:
        k, piece = pending.popleft()
        if not premapped:
            _map_piece(sess, piece, outs, addrs, offsets, k % cfg.max_inflight, False)
        segments = ([(0, hdr)] if (k == 0 and hdr is not None) else []) + piece.segments
        piece.token = sess.submit(f, "READ", segments)
        inflight.append(piece)

    # A synchronous session reads piece k+1 in this thread while the pool verifies piece k. An
    # asynchronous one keeps `max_inflight` pieces posted and verifies here between polls; when the
    # next piece has landed too (posted pieces tend to complete together), the idle pool takes this
    # one, so the two threads share what is left to verify.
    window = 1 if sess.synchronous else cfg.max_inflight
    pool, pool_job = cfg.checksum_pool, None
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
            if pending and not sess.synchronous:
                post()
            if sess.synchronous:
                beside = pool is not None and bool(pending)  # not the last: the pool's, before this thread reads on
            else:
                beside = (pool is not None and inflight and (pool_job is None or pool_job.done())
                          and sess.poll(inflight[0].token))
            if beside:
                pool_job = pool.submit(_verify_piece, piece, outs, header, indices)
                checks.append(pool_job)
            else:
                checks.append(_verify_piece(piece, outs, header, indices, between))
            if pending and sess.synchronous:
                post()
    finally:
        _drain(sess, inflight)
    for job in checks:
        for slot, fault in (job if isinstance(job, list) else job.result()):
            results[slot] = results[slot] or fault
    return results
