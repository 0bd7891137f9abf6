"""What a storage backend provides: one I/O session per store worker, moving byte segments
between host views and one open file, synchronously (`run`) or asynchronously (`submit` / `wait`).

Backends differ only in how segments move (plain syscalls vs NIXL POSIX); opening, creating,
preallocating and closing files is shared here so both produce identical files and classify OS
errors identically. A segment is ``(file_offset, host_view)`` with `host_view` a flat uint8 array.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from histate.storage.buffers import aligned_empty
from histate.storage.format import ALIGN_BYTES
from histate.storage.results import Fault, IoFault, fault_from_oserror

Segment = tuple[int, np.ndarray]
log = logging.getLogger(__name__)


@dataclass
class OpenFile:
    path: str
    fd: int
    size_bytes: int
    direct: bool
    writable: bool
    token: object = None  # backend registration (NIXL FILE registration)


def probe_direct_io(dir_fd: int, name: str) -> bool:
    """Whether files in directory `dir_fd` accept O_DIRECT: False when the file system refuses it
    (EINVAL: tmpfs before Linux 6.6, some FUSE/overlay). Any other error (a full disk, a read-only or
    unwritable directory, an I/O error) says nothing about O_DIRECT and propagates as OSError: the
    caller asks again later. Creates, writes and removes the regular file `name` (a temp name of the
    store's scheme)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    buf = aligned_empty(ALIGN_BYTES)
    buf[:] = 0
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT, 0o644, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    try:
        return os.pwrite(fd, buf, 0) == ALIGN_BYTES
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass


DIRECT_PROBE_RETRY_S = 60.0  # an undecided O_DIRECT probe is retried at most this often (store clock)


class DirectIoChoice:
    """Per store root, whether its files are opened with O_DIRECT.

    Probed when the store opens. A probe that cannot decide (it raised: a full disk, a read-only root)
    used to turn O_DIRECT off for the life of the process, silently; now the root uses buffered I/O for
    the time being, the first such probe is logged, and the next I/O in that root after
    DIRECT_PROBE_RETRY_S probes again, until a probe decides."""

    def __init__(self, probe, num_roots: int, wanted: bool | None, clock, labels: list[str]):
        """`probe(root) -> bool` runs one probe (OSError / IoFault: undecided); `wanted` is
        StoreConfig.direct_io (False: never probe, never O_DIRECT)."""
        self._probe, self._clock, self._labels = probe, clock, labels
        self._decided: list[bool | None] = [False if wanted is False else None] * num_roots
        self._retry_at_s = [0.0] * num_roots
        self._logged: set[int] = set()
        self._lock = threading.Lock()
        for root in range(num_roots):
            if self._decided[root] is None:
                self._run_probe(root)

    def use(self, root: int) -> bool:
        """O_DIRECT for the next file opened in `root`; probes again when due (never waits for another
        thread's probe: that I/O goes buffered)."""
        decided = self._decided[root]
        if decided is not None:
            return decided
        if self._clock() >= self._retry_at_s[root] and self._lock.acquire(blocking=False):
            try:
                if self._decided[root] is None:
                    self._run_probe(root)
            finally:
                self._lock.release()
        return bool(self._decided[root])

    def snapshot(self) -> list[bool]:
        """What each root uses now (undecided: buffered), without probing."""
        return [bool(d) for d in self._decided]

    def _run_probe(self, root: int) -> None:
        try:
            verdict, reason = self._probe(root), ""
        except (OSError, IoFault) as exc:  # no room, read-only, no permission, the fan-out dir unusable
            verdict, reason = None, str(exc)
        self._decided[root] = verdict
        if verdict is not None:
            if root in self._logged:
                log.info("histate.storage: O_DIRECT probe of %s decided at last: %s", self._labels[root],
                            "O_DIRECT" if verdict else "buffered I/O (refused)")
            return
        self._retry_at_s[root] = self._clock() + DIRECT_PROBE_RETRY_S
        if root not in self._logged:
            self._logged.add(root)
            log.warning("histate.storage: cannot tell whether %s accepts O_DIRECT (%s); buffered I/O there, "
                        "probing again every %g s until a probe decides", self._labels[root], reason,
                        DIRECT_PROBE_RETRY_S)


class IoSession:
    """Base class: file handling common to all backends. One session is used by one thread."""

    name = "base"
    synchronous = False  # True when submit() does the I/O before returning (no overlap with this thread)

    def __init__(self, preallocate: bool = True):
        self.preallocate = preallocate
        self._staging: dict[str, np.ndarray] = {}

    # --- files -------------------------------------------------------------------------------
    def open_read(self, dir_fd: int, name: str, direct: bool, label: str) -> OpenFile:
        """Open `name` in directory `dir_fd` for reading. Opened O_NONBLOCK + O_NOFOLLOW and checked to
        be a regular file before anything else: a FIFO, device or symlink planted at an object's name is
        a fault, never a hang. O_DIRECT is switched on afterwards (open() of a FIFO rejects it)."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise IoFault(Fault.CORRUPT, f"{label} is a symlink, not a file the store wrote") from None
            raise fault_from_oserror(exc, f"open {label}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise IoFault(Fault.CORRUPT, f"{label} is not a regular file (mode {st.st_mode:#o})")
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | (os.O_DIRECT if direct else 0))  # O_NONBLOCK off
            f = OpenFile(label, fd, st.st_size, direct, writable=False)
            self._attach(f)
        except OSError as exc:
            os.close(fd)
            raise fault_from_oserror(exc, f"open {label}") from None
        except BaseException:
            os.close(fd)
            raise
        return f

    def create(self, dir_fd: int, name: str, file_bytes: int, direct: bool, label: str) -> OpenFile:
        """Create the new temp file `name` sized `file_bytes`; preallocation surfaces ENOSPC before any I/O."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise fault_from_oserror(exc, f"create {label}") from None
        try:
            if self.preallocate and file_bytes:
                os.posix_fallocate(fd, 0, file_bytes)
            elif file_bytes and not direct:
                os.ftruncate(fd, file_bytes)  # same file size in every mode
            f = OpenFile(label, fd, file_bytes, direct, writable=True)
            self._attach(f)
        except BaseException as exc:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)  # ours: created O_EXCL just above
            if isinstance(exc, OSError):
                raise fault_from_oserror(exc, f"preallocate {file_bytes} bytes for {label}") from None
            raise
        return f

    def close(self, f: OpenFile) -> None:
        try:
            self._detach(f)
        finally:
            os.close(f.fd)

    def _attach(self, f: OpenFile) -> None:
        """Backend hook: make an opened file usable for transfers (NIXL registers it)."""

    def _detach(self, f: OpenFile) -> None:
        """Backend hook: undo `_attach`."""

    # --- host memory -------------------------------------------------------------------------
    def staging(self, name: str, num_bytes: int) -> np.ndarray:
        """A block-aligned scratch buffer owned by this session, reused across operations."""
        buf = self._staging.get(name)
        if buf is None or buf.size < num_bytes:
            if buf is not None:
                self._unregister_staging(buf)
            buf = aligned_empty(max(num_bytes, ALIGN_BYTES))
            buf[:] = 0  # fault the pages in once, not on the hot path
            self._register_staging(buf)
            self._staging[name] = buf
        return buf[:num_bytes]

    def _register_staging(self, buf: np.ndarray) -> None:
        """Backend hook: register a long-lived host buffer once (NIXL)."""

    def _unregister_staging(self, buf: np.ndarray) -> None:
        """Backend hook: undo `_register_staging`."""

    # --- transfers ---------------------------------------------------------------------------
    def run(self, f: OpenFile, op: str, segments: Sequence[Segment]) -> None:
        """Move all segments and return when done; raises IoFault."""
        self.wait(self.submit(f, op, segments))

    def submit(self, f: OpenFile, op: str, segments: Sequence[Segment]) -> object:
        raise NotImplementedError

    def wait(self, token: object) -> None:
        raise NotImplementedError

    def poll(self, token: object) -> bool:
        """Non-blocking progress on a submitted transfer; True once it has ended (`wait` then returns
        at once, or raises its error). Backends whose queue only advances when polled (NIXL POSIX)
        use it to keep the disk busy while the caller checksums."""
        return False

    def shutdown(self) -> None:
        for buf in self._staging.values():
            self._unregister_staging(buf)
        self._staging.clear()
