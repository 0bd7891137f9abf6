"""Outcome types shared by the store, its backends and callers: results, miss reasons, eviction events."""
from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field

import numpy as np

from histate.storage.buffers import typed_view


class Fault(str, enum.Enum):
    """Why an operation did not produce (or keep) a stored object. Every one is a miss, never an error."""

    NOT_FOUND = "not_found"  # key not in the index (ordinary miss, not a fault)
    MISSING_FILE = "missing_file"  # indexed, but the file is gone
    SHORT_FILE = "short_file"  # file shorter than its header says (torn or truncated)
    CORRUPT = "corrupt"  # header or payload checksum mismatch, wrong key, undecodable header
    PERMISSION = "permission"  # EACCES / EPERM / EROFS
    NO_SPACE = "no_space"  # ENOSPC / EDQUOT from the file system
    IO_ERROR = "io_error"  # any other OS or NIXL transfer error
    NO_CAPACITY = "no_capacity"  # put refused: the byte budget could not be freed
    BACKLOG_FULL = "backlog_full"  # put dropped: write backlog at its bound
    CANCELLED = "cancelled"  # put superseded by delete() or store close
    SUPERSEDED = "superseded"  # put overtaken by a later put of the same key (later writes win)
    OWNER_ERROR = "owner_error"  # put failed because on_capacity_needed / on_evict raised
    UNSAFE_PATH = "unsafe_path"  # something the store did not (provably) create sits where it would write
    SIZE_MISMATCH = "size_mismatch"  # get into a destination whose size is not the stored object's


class IoFault(Exception):
    """A failed file operation, classified; the store turns it into a miss or a failed put."""

    def __init__(self, fault: Fault, detail: str):
        super().__init__(f"{fault.value}: {detail}")
        self.fault = fault
        self.detail = detail


_ERRNO_FAULTS = {
    errno.ENOENT: Fault.MISSING_FILE,
    errno.EACCES: Fault.PERMISSION,
    errno.EPERM: Fault.PERMISSION,
    errno.EROFS: Fault.PERMISSION,
    errno.ENOSPC: Fault.NO_SPACE,
    errno.EDQUOT: Fault.NO_SPACE,
}


def fault_from_oserror(exc: OSError, what: str) -> IoFault:
    return IoFault(_ERRNO_FAULTS.get(exc.errno, Fault.IO_ERROR), f"{what}: {exc}")


@dataclass
class GetResult:
    key: str
    fault: Fault | None = None  # None = hit
    buffer: np.ndarray | None = None  # flat uint8 payload (the caller's `out` when one was given)
    dtype_name: str = ""
    shape: tuple[int, ...] = ()

    @property
    def hit(self) -> bool:
        return self.fault is None

    def array(self) -> np.ndarray:
        """Payload as the array it was stored from (uint8 for dtypes numpy lacks, e.g. torch.bfloat16)."""
        if self.buffer is None:
            raise LookupError(f"{self.key!r} was a miss ({self.fault.value})")
        return typed_view(self.buffer, self.dtype_name, self.shape)

    def tensor(self):
        """Payload as a CPU torch tensor sharing the buffer (torch imported only here)."""
        import torch

        if self.buffer is None:
            raise LookupError(f"{self.key!r} was a miss ({self.fault.value})")
        if self.dtype_name.startswith("torch."):
            dtype = getattr(torch, self.dtype_name.removeprefix("torch."))
            return torch.from_numpy(self.buffer).view(dtype).reshape(self.shape)
        return torch.from_numpy(self.array())


@dataclass
class PutResult:
    key: str
    fault: Fault | None = None  # None = stored and published
    file_bytes: int = 0

    @property
    def stored(self) -> bool:
        return self.fault is None


@dataclass(frozen=True)
class EvictionEvent:
    """One object left the store: what the owner's interval controller learns T_state from."""

    key: str
    size_bytes: int  # on-disk bytes of the object (a packed page: its padded payload; see docs/storage.md)
    residence_s: float  # clock time since the object was published (or indexed at warm restart)
    reason: str  # "capacity" | "delete" | "fault"


@dataclass
class StoreStats:
    """Monotone counters; `snapshot()` copies them under the store lock."""

    gets: int = 0
    hits: int = 0
    puts: int = 0
    puts_stored: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    misses: dict[str, int] = field(default_factory=dict)  # Fault value -> count (reads)
    put_failures: dict[str, int] = field(default_factory=dict)  # Fault value -> count (writes)
    files_removed_on_fault: int = 0
    evictions: int = 0
    writes_delayed: int = 0  # submitter waited for backlog room
    delete_failures: int = 0  # delete() could not remove the file (read-only, immutable): key kept
    owner_errors: dict[str, int] = field(default_factory=dict)  # callback name -> exceptions it raised
    rebuild_kept: int = 0
    rebuild_discarded: int = 0  # torn temp files + corrupt/short/misnamed/duplicate files at warm restart
    rebuild_foreign: int = 0  # entries in the root that are not the store's (left alone)

    def count(self, table: dict[str, int], fault: Fault) -> None:
        table[fault.value] = table.get(fault.value, 0) + 1

    def snapshot(self) -> dict:
        out = dict(self.__dict__)
        out["misses"] = dict(self.misses)
        out["put_failures"] = dict(self.put_failures)
        out["owner_errors"] = dict(self.owner_errors)
        return out
