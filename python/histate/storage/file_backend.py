"""Plain-file backend: preadv/pwritev (optionally O_DIRECT), asynchronous through a small thread pool.

The fallback when NIXL is missing or fails to start, and forcible by config. The syscalls release the
GIL, so a helper thread moves segment k+1 while the store worker checksums segment k. Adjacent
segments are coalesced into one vectored syscall, so a small object (header + payload) costs one call.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import os

import numpy as np

from histate.storage.io_base import IoSession, OpenFile, Segment
from histate.storage.results import Fault, IoFault, fault_from_oserror


def _coalesce(segments: Sequence[Segment]) -> list[tuple[int, list[np.ndarray]]]:
    """Runs of file-contiguous segments -> [(file_offset, [views])] for vectored I/O."""
    runs: list[tuple[int, list[np.ndarray]]] = []
    end = None
    for offset, view in segments:
        if runs and offset == end and len(runs[-1][1]) < 512:
            runs[-1][1].append(view)
        else:
            runs.append((offset, [view]))
        end = offset + view.size
    return runs


def _advance(views: list[np.ndarray], num_bytes: int) -> list[np.ndarray]:
    out = []
    for v in views:
        if num_bytes >= v.size:
            num_bytes -= v.size
            continue
        out.append(v[num_bytes:])
        num_bytes = 0
    return out


def move_segments(f: OpenFile, op: str, segments: Sequence[Segment]) -> int:
    """Blocking transfer of every segment; returns bytes moved. Raises IoFault (short file included)."""
    moved = 0
    for offset, views in _coalesce(segments):
        total = sum(v.size for v in views)
        done = 0
        while done < total:
            pending = _advance(views, done) if done else views
            try:
                if op == "READ":
                    n = os.preadv(f.fd, pending, offset + done)
                else:
                    n = os.pwritev(f.fd, pending, offset + done)
            except OSError as exc:
                raise fault_from_oserror(exc, f"{op.lower()} {f.path} at {offset + done}") from None
            if n <= 0:
                raise IoFault(Fault.SHORT_FILE, f"{f.path}: end of file at {offset + done}, "
                                                f"wanted {total - done} more bytes")
            done += n
        moved += total
    return moved


class _Done:
    """A token for work finished inline."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None):
        self.error = error


class FileSession(IoSession):
    name = "file"

    def __init__(self, io_threads: int = 1, preallocate: bool = True):
        super().__init__(preallocate=preallocate)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="histate-file-io") if io_threads else None
        self.synchronous = self._pool is None

    def run(self, f: OpenFile, op: str, segments: Sequence[Segment]) -> None:
        move_segments(f, op, segments)

    def submit(self, f: OpenFile, op: str, segments: Sequence[Segment]) -> object:
        if self._pool is None:
            try:
                move_segments(f, op, segments)
            except BaseException as exc:  # surfaced by wait(), like a pooled failure
                return _Done(exc)
            return _Done(None)
        return self._pool.submit(move_segments, f, op, list(segments))

    def poll(self, token: object) -> bool:
        return token.done() if isinstance(token, Future) else True

    def wait(self, token: object) -> None:
        if isinstance(token, Future):
            token.result()
        elif token.error is not None:
            raise token.error

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        super().shutdown()
