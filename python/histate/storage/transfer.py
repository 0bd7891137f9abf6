"""Moving one object between a host buffer and its file: pipelined I/O with per-chunk checksums.

A payload is cut into pieces of `piece_bytes` (a multiple of the format's chunk size). Writes post
piece k and checksum it while the disk works, keeping up to `max_inflight` pieces in flight, then write
the header (it holds the checksums) last, over a zero placeholder written with piece 0. Reads post the header with the first pieces and verify each
piece's chunks as it lands. So checksum cost overlaps I/O instead of adding to it. With O_DIRECT,
host memory that is not block aligned (and the partial last block) goes through session-owned,
registered bounce buffers; aligned caller memory is transferred in place.
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import numpy as np

from histate.storage.buffers import is_aligned
from histate.storage.format import (ALIGN_BYTES, FormatError, Header, align_up, DEFAULT_CHECKSUM, chunk_checksum, decode_header,
                                    encode_header, header_bytes_for, num_chunks_for)
from histate.storage.io_base import IoSession, OpenFile, Segment
from histate.storage.results import Fault, IoFault


@dataclass(frozen=True)
class PipelineConfig:
    chunk_bytes: int = 1 << 20  # checksum granularity (recorded in each file's header)
    piece_bytes: int = 8 << 20  # I/O unit of the pipeline; rounded to a multiple of chunk_bytes
    max_inflight: int = 4  # pieces posted but not yet completed
    checksum_pool: Executor | None = None  # checksums run here, beside the I/O; None = inline
    checksum_algo: int = DEFAULT_CHECKSUM  # for new files (reads use the file's own)


@dataclass
class _Piece:
    start: int  # payload offset
    stop: int
    segments: list[Segment]
    copy_back: list[tuple[np.ndarray, np.ndarray]]  # (staging view, destination view) after a read
    token: object = None


def _piece_bytes(cfg: PipelineConfig, chunk_bytes: int) -> int:
    return max(1, cfg.piece_bytes // chunk_bytes) * chunk_bytes


def _plan_piece(sess: IoSession, f: OpenFile, host: np.ndarray, start: int, stop: int, header_bytes: int,
                slot: int, writing: bool) -> _Piece:
    """Segments for payload[start:stop] mapped onto `host[start:stop]`, bouncing what O_DIRECT rejects."""
    view = host[start:stop]
    offset = header_bytes + start
    piece = _Piece(start, stop, [], [])
    if not f.direct:
        piece.segments.append((offset, view))
        return piece
    if is_aligned(view):
        body = (view.size // ALIGN_BYTES) * ALIGN_BYTES
        if body:
            piece.segments.append((offset, view[:body]))
        tail = view[body:]
        if tail.size:
            stage = sess.staging("tail", ALIGN_BYTES)
            if writing:
                stage[tail.size:] = 0
                stage[: tail.size] = tail
            else:
                piece.copy_back.append((stage[: tail.size], tail))
            piece.segments.append((offset + body, stage))
        return piece
    padded = align_up(view.size)
    stage = sess.staging(f"bounce{slot}", padded)
    if writing:
        stage[view.size:] = 0
        stage[: view.size] = view
    else:
        piece.copy_back.append((stage[: view.size], view))
    piece.segments.append((offset, stage))
    return piece


def _piece_checksums(src: np.ndarray, start: int, stop: int, chunk_bytes: int, algo: int,
                     progress=None) -> list[int]:
    sums = []
    for i in range(start, stop, chunk_bytes):
        sums.append(chunk_checksum(src[i: min(i + chunk_bytes, stop)], algo))
        if progress is not None:
            progress()
    return sums


def _spawn(cfg: PipelineConfig, fn, *args):
    """Run a checksum job in the pool (no progress callback: polling stays in the I/O thread)."""
    if cfg.checksum_pool is None:
        return fn(*args)
    return cfg.checksum_pool.submit(fn, *args[:-1])


def _result(job):
    return job.result() if isinstance(job, Future) else job


def _progress(sess: IoSession, inflight: deque) -> None:
    for piece in inflight:
        sess.poll(piece.token)


def _drain(sess: IoSession, inflight: deque) -> None:
    """Wait out every posted piece after a failure (buffers and fds must outlive the I/O)."""
    while inflight:
        try:
            sess.wait(inflight.popleft().token)
        except Exception:
            pass


def write_object(sess: IoSession, path: str, src: np.ndarray, key: str, dtype_name: str,
                 shape: tuple[int, ...], direct: bool, cfg: PipelineConfig) -> Header:
    """Create `path` holding header + payload; returns the header. Unlinks `path` on any failure."""
    payload_bytes = src.size
    chunk_bytes = cfg.chunk_bytes
    n_chunks = num_chunks_for(payload_bytes, chunk_bytes)
    header_bytes = header_bytes_for(key, dtype_name, len(shape), n_chunks)
    f = sess.create(path, header_bytes + align_up(payload_bytes), direct)
    inflight: deque[_Piece] = deque()
    published = False
    try:
        if not f.direct and not sess.preallocate:
            os.ftruncate(f.fd, header_bytes + align_up(payload_bytes))  # same file size in every mode
        header = _write_payload_and_header(sess, f, src, key, dtype_name, shape, header_bytes, cfg, inflight)
        published = True
        return header
    finally:
        _drain(sess, inflight)
        sess.close(f)
        if not published:
            _unlink_quietly(path)


def _write_payload_and_header(sess: IoSession, f: OpenFile, src: np.ndarray, key: str, dtype_name: str,
                              shape: tuple[int, ...], header_bytes: int, cfg: PipelineConfig,
                              inflight: deque) -> Header:
    payload_bytes = src.size
    chunk_bytes = cfg.chunk_bytes
    step = _piece_bytes(cfg, chunk_bytes)
    algo = cfg.checksum_algo
    piece_sums: list = []
    if payload_bytes <= step:  # small object: one vectored call for header + payload
        sums = _piece_checksums(src, 0, payload_bytes, chunk_bytes, algo)
        header = Header(key, payload_bytes, dtype_name, tuple(shape), chunk_bytes, tuple(sums), algo)
        segments = [(0, _staged_header(sess, header))]
        if payload_bytes:
            segments += _plan_piece(sess, f, src, 0, payload_bytes, header_bytes, 0, True).segments
        sess.run(f, "WRITE", segments)
        return header
    for slot, start in enumerate(range(0, payload_bytes, step)):
        if len(inflight) >= cfg.max_inflight:
            sess.wait(inflight.popleft().token)
        stop = min(start + step, payload_bytes)
        piece = _plan_piece(sess, f, src, start, stop, header_bytes, slot % cfg.max_inflight, True)
        if start == 0:  # zeros now (an invalid header) so the real one later rewrites allocated blocks
            piece.segments.insert(0, (0, _zero_header(sess, header_bytes)))
        # checksum piece k beside its write (in the pool, or here between polls of the queue)
        piece_sums.append(_spawn(cfg, _piece_checksums, src, start, stop, chunk_bytes, algo,
                                 lambda: _progress(sess, inflight)))
        piece.token = sess.submit(f, "WRITE", piece.segments)
        inflight.append(piece)
    sums = [c for job in piece_sums for c in _result(job)]
    header = Header(key, payload_bytes, dtype_name, tuple(shape), chunk_bytes, tuple(sums), algo)
    hdr = _staged_header(sess, header)
    while inflight:
        sess.wait(inflight.popleft().token)
    sess.run(f, "WRITE", [(0, hdr)])
    return header


def _zero_header(sess: IoSession, header_bytes: int) -> np.ndarray:
    """Placeholder for the header block, written with the first piece: on ext4/XFS an O_DIRECT write
    into an unallocated or unwritten block needs a journalled extent change (~0.2-1 ms on the reference
    VM), an overwrite of a written block does not; and zeros fail the magic check if we crash."""
    buf = sess.staging("zero_header", header_bytes)
    if buf.any():
        buf[:] = 0
    return buf


def _staged_header(sess: IoSession, header: Header) -> np.ndarray:
    hdr = sess.staging("header", header.header_bytes)
    hdr[:] = np.frombuffer(encode_header(header), dtype=np.uint8)
    return hdr


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_back(piece: _Piece) -> None:
    for staged, dest in piece.copy_back:
        dest[:] = staged


def _verify_piece(out: np.ndarray, piece: _Piece, header: Header, progress=None) -> None:
    cb = header.chunk_bytes
    for i in range(piece.start, piece.stop, cb):
        try:
            found = chunk_checksum(out[i: min(i + cb, piece.stop)], header.checksum_algo)
        except FormatError as exc:
            raise IoFault(Fault.CORRUPT, f"{header.key!r}: {exc}") from None
        if found != header.chunk_checksums[i // cb]:
            raise IoFault(Fault.CORRUPT, f"payload checksum mismatch in chunk {i // cb} of {header.key!r}")
        if progress is not None:
            progress()


def _verify_header(buf: np.ndarray, expected: Header, path: str) -> None:
    try:
        found = decode_header(buf)
    except FormatError as exc:
        raise IoFault(Fault.CORRUPT, f"{path}: {exc}") from None
    if found != expected:
        raise IoFault(Fault.CORRUPT, f"{path}: header differs from the index (key {found.key!r})")


def read_object(sess: IoSession, path: str, header: Header, out: np.ndarray, direct: bool,
                cfg: PipelineConfig) -> None:
    """Fill `out` (flat uint8, payload_bytes long) from `path`, verifying header and every chunk."""
    f = sess.open_read(path, direct)
    inflight: deque[_Piece] = deque()
    try:
        if f.size_bytes != header.file_bytes:
            fault = Fault.SHORT_FILE if f.size_bytes < header.file_bytes else Fault.CORRUPT
            raise IoFault(fault, f"{path} holds {f.size_bytes} bytes, its header needs {header.file_bytes}")
        hdr = sess.staging("header", header.header_bytes)
        step = _piece_bytes(cfg, header.chunk_bytes)
        starts = list(range(0, header.payload_bytes, step))
        if len(starts) <= 1:  # small object: one vectored call
            segments: list[Segment] = [(0, hdr)]
            piece = None
            if header.payload_bytes:
                piece = _plan_piece(sess, f, out, 0, header.payload_bytes, header.header_bytes, 0, False)
                segments += piece.segments
            sess.run(f, "READ", segments)
            _verify_header(hdr, header, path)
            if piece is not None:
                _copy_back(piece)
                _verify_piece(out, piece, header)
            return
        pending = deque(starts)
        first = True

        def post() -> None:
            nonlocal first
            start = pending.popleft()
            slot = (len(starts) - len(pending) - 1) % cfg.max_inflight
            piece = _plan_piece(sess, f, out, start, min(start + step, header.payload_bytes),
                                header.header_bytes, slot, False)
            segments = ([(0, hdr)] if first else []) + piece.segments
            first = False
            piece.token = sess.submit(f, "READ", segments)
            inflight.append(piece)

        while pending and len(inflight) < cfg.max_inflight:
            post()
        verified_header = False
        checks = []
        while inflight:
            piece = inflight.popleft()
            sess.wait(piece.token)
            if not verified_header:
                _verify_header(hdr, header, path)
                verified_header = True
            _copy_back(piece)  # before its bounce slot is posted again
            if pending:
                post()
            # the disk keeps working on the pieces in flight (in the pool, or polled between chunks)
            checks.append(_spawn(cfg, _verify_piece, out, piece, header, lambda: _progress(sess, inflight)))
        for job in checks:
            _result(job)  # raises the first checksum mismatch
    finally:
        _drain(sess, inflight)
        sess.close(f)
