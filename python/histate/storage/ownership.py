"""Which directories the store may use, and the only ways it touches what is inside them.

Ownership rule. A root directory belongs to a store when it holds the marker file `HISTATE-STORE`
that a store wrote. A store claims a root that does not exist yet or is empty by writing the marker,
which records a random 64-bit root id; a directory holding anything else (and no marker) is refused,
untouched. Inside its root the store only ever creates, reads and removes names of its own scheme
(`layout.classify_name`) inside its 256 fan-out directories (`00` ... `ff`, real directories, never
symlinks), plus the marker. Everything else -- other files, other directories, symlinks, FIFOs -- is
left alone.

A name is not proof enough: a copy of the marker in a user's directory would make every user file
named like the store's (`ab/Util.hs`) look like the store's. So the store removes or replaces a file
only when the file itself proves the store wrote it in this root: every file it writes carries the
root id in its header (format.claimed_root_id), every temp file in its name (layout.temp_root_id). A
copied marker gives its new directory no such files: the store there adds its own and touches none
of the user's.

Exclusion. The root directory itself (its inode, not a file inside it) is `flock`ed for the life of
the store, so emptying the directory (`rm -rf root/*`) cannot hand it to a second store; the lock
dies with the process. Nested roots (a root inside another store's root, or two roots of one store
inside each other) are refused. Every file operation goes through a directory descriptor opened with
O_NOFOLLOW, so a symlink planted as a fan-out directory is refused instead of followed, and a root
deleted and recreated behind the store's back is never written by it.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat

from histate.storage.format import ALIGN_BYTES, claimed_root_id
from histate.storage.layout import classify_name, is_fanout_name, temp_root_id
from histate.storage.results import Fault, IoFault, fault_from_oserror

MARKER_NAME = "HISTATE-STORE"
MARKER_HEAD = (b"histate.storage root (format 3). The store owns only the files in 00..ff that carry this "
               b"root id.\n")
FORMAT2_MARKER = b"histate.storage root (format 2). The store owns only its own file names in 00..ff.\n"
_MARKER_ID = re.compile(rb"root-id ([0-9a-f]{16})\n")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def marker_text(root_id: int) -> bytes:
    return MARKER_HEAD + b"root-id %016x\n" % root_id


def parse_marker(data: bytes) -> int:
    """The root id a marker records; ValueError when `data` is not a format-3 marker."""
    found = _MARKER_ID.fullmatch(data[len(MARKER_HEAD):]) if data.startswith(MARKER_HEAD) else None
    if found is None or not int(found.group(1), 16):
        raise ValueError("not a histate.storage format-3 marker")
    return int(found.group(1), 16)


def new_root_id() -> int:
    """A random, non-zero 64-bit id: what no file the store did not write carries by chance."""
    return int.from_bytes(os.urandom(8), "little") or 1


class StoreDirectoryError(RuntimeError):
    """A directory the store refuses to use (foreign files, nested roots, '/', a garbled marker)."""


class DirectoryInUse(StoreDirectoryError):
    """Another live store holds the directory's lock."""


def _listing(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in sorted(names)[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class OwnedRoot:
    """One claimed root: its locked directory descriptor and the file operations the store may do."""

    def __init__(self, path: str):
        self.path = path
        self.root_id = 0  # known once the marker is read or written
        if os.path.realpath(path) == os.sep:
            raise StoreDirectoryError(f"refusing '{os.sep}' as a store directory: give a dedicated directory")
        try:
            os.makedirs(path, exist_ok=True)
            self.fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            raise StoreDirectoryError(f"{path} cannot be used as a store directory: {exc.strerror}") from None
        try:
            self._lock()
            self._check_marker()
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DirectoryInUse(f"{self.path} is in use by another CheckpointStore "
                                 f"(its directory lock is held)") from None

    def _check_marker(self) -> None:
        names = os.listdir(self.fd)
        if MARKER_NAME not in names:
            if names:
                raise StoreDirectoryError(
                    f"{self.path} is not empty and was not created by histate.storage (no {MARKER_NAME}; it "
                    f"holds {_listing(names)}): give an empty or new directory, nothing in it was touched")
            self.root_id = new_root_id()
            self.ensure_marker()
            return
        data = self._read_marker()
        if data == FORMAT2_MARKER:
            raise StoreDirectoryError(
                f"{self.path} is a store of an older histate.storage (format 2), whose files cannot prove the "
                f"store wrote them: refusing it, nothing in it was touched; it is a cache, delete the directory")
        try:
            self.root_id = parse_marker(data)
        except ValueError:
            raise StoreDirectoryError(f"{self.path}/{MARKER_NAME} is not a histate.storage marker: "
                                      f"refusing the directory, nothing in it was touched") from None

    def _read_marker(self) -> bytes:
        """The marker's bytes (a little more than any valid one: a longer file reads as garbled)."""
        try:
            fd = os.open(MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise StoreDirectoryError(f"{self.path}/{MARKER_NAME} cannot be read ({exc.strerror})") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            return os.read(fd, len(marker_text(1)) + 1)
        finally:
            os.close(fd)

    def ensure_marker(self) -> None:
        """Write the marker if it is missing (first claim, or after someone emptied the root); it keeps
        this root's id, so the files already written stay provably the store's."""
        try:
            fd = os.open(MARKER_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=self.fd)
        except FileExistsError:
            return
        try:
            os.write(fd, marker_text(self.root_id))
        finally:
            os.close(fd)

    def wrote(self, dir_fd: int, name: str) -> bool:
        """Whether regular file `name` (in fan-out directory `dir_fd`) proves the store wrote it in this
        root: a temp file by the id in its name, any other by the id in its header. False when it cannot
        be read (nothing proves it then)."""
        if classify_name(name) == "temp":
            return temp_root_id(name) == self.root_id
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            return claimed_root_id(os.pread(fd, ALIGN_BYTES, 0)) == self.root_id
        except OSError:
            return False
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the flock
            self.fd = -1

    # --- the store's only ways into its fan-out directories -------------------------------------
    def open_fanout(self, fanout: str, create: bool) -> int:
        """Descriptor of fan-out directory `fanout`; recreated when missing (and `create`). Raises
        IoFault(UNSAFE_PATH) when something that is not a real directory sits at its name."""
        if self.fd < 0:
            raise IoFault(Fault.CANCELLED, f"{self.path}: store closed")
        for _attempt in range(2):
            try:
                return os.open(fanout, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
            except FileNotFoundError:
                if not create:
                    raise IoFault(Fault.MISSING_FILE, f"{self.path}/{fanout} is gone") from None
                try:
                    os.mkdir(fanout, 0o755, dir_fd=self.fd)
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise fault_from_oserror(exc, f"mkdir {self.path}/{fanout}") from None
                self.ensure_marker()  # a vanished fan-out directory may mean the whole root was emptied
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise IoFault(Fault.UNSAFE_PATH, f"{self.path}/{fanout} is not a directory the store made "
                                                     f"(symlink or other file): refusing to write through it")
                raise fault_from_oserror(exc, f"open {self.path}/{fanout}") from None
        raise IoFault(Fault.IO_ERROR, f"{self.path}/{fanout} keeps disappearing")

    def fanout_dirs(self) -> tuple[list[str], list[str]]:
        """(fan-out directory names, names of other top-level entries except the marker)."""
        fanouts, foreign = [], []
        with os.scandir(self.fd) as it:
            for de in it:
                if de.name == MARKER_NAME:
                    continue
                if is_fanout_name(de.name) and de.is_dir(follow_symlinks=False):
                    fanouts.append(de.name)
                else:
                    foreign.append(de.name)
        return sorted(fanouts), foreign


def remove_file(dir_fd: int, name: str) -> bool:
    """Unlink `name` if it is a regular file (what the store creates); anything else is left alone.
    True when it is gone (or was never there); OSError from unlink propagates."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    if not stat.S_ISREG(st.st_mode):
        return False
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    return True


def is_replaceable(root: OwnedRoot, dir_fd: int, name: str) -> bool:
    """Whether a rename may land on `name`: nothing there, or a file the store provably wrote in `root`
    (a user's file under a copied marker keeps its place: the put fails `unsafe_path` instead)."""
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    return root.wrote(dir_fd, name)


def check_nesting(paths: list[str]) -> None:
    """Refuse roots listed twice, inside each other, or inside another store's root."""
    real = [os.path.realpath(p) for p in paths]
    for i, (p, r) in enumerate(zip(paths, real)):
        for q, s in zip(paths[:i], real[:i]):
            if r == s:
                raise StoreDirectoryError(f"{p} is listed twice (as {q})")
            if r.startswith(s.rstrip(os.sep) + os.sep) or s.startswith(r.rstrip(os.sep) + os.sep):
                raise StoreDirectoryError(f"store directories {q} and {p} are inside each other")
        parent = os.path.dirname(r)
        while True:
            if os.path.lexists(os.path.join(parent, MARKER_NAME)):
                raise StoreDirectoryError(f"{p} is inside the store directory {parent}: nested stores are refused")
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)


def claim_roots(paths: list[str]) -> list[OwnedRoot]:
    """Claim every root (all or none): nesting checks, lock, marker."""
    check_nesting(paths)
    roots: list[OwnedRoot] = []
    try:
        for p in paths:
            roots.append(OwnedRoot(p))
    except BaseException:
        for r in roots:
            r.release()
        raise
    return roots
