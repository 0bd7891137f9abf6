"""Store configuration: every knob with its unit and the default chosen by measurement."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from histate.storage.format import DEFAULT_CHUNK_BYTES

BACKENDS = ("auto", "nixl", "file")
BACKLOG_POLICIES = ("drop", "delay")
_NAMESPACE = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,200}")


@dataclass
class StoreConfig:
    dirs: list[str]  # one or more directories (ideally one per device); keys spread by hash
    capacity_bytes: int  # on-disk bytes (headers and block padding included)
    backend: str = "auto"  # "auto": NIXL POSIX when it starts, plain files otherwise; "nixl" | "file" force
    direct_io: bool | None = None  # None: O_DIRECT wherever the file system accepts it
    num_workers: int = 2  # I/O worker threads (each with its own NIXL agent or file session)
    file_io_threads: int = 0  # per worker, plain backend: helper threads for the syscalls (0: the worker does them)
    nixl_params: dict[str, str] = field(default_factory=dict)  # POSIX plugin params, e.g. {"use_uring": "true"}
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # checksum granularity
    piece_bytes: int = 16 << 20  # largest read piece (reads halve theirs towards the end); write piece when bounced
    max_inflight: int = 4  # pipeline depth, pieces
    checksum_threads: int = 1  # checksums/headers beside the plain backend's syscalls; shares NIXL reads' verification
    checksum: str = "auto"  # payload checksum of new files: "xxh3" (needs xxhash), "crc32"; auto = xxh3 if installed
    max_write_backlog_bytes: int = 1 << 30  # queued + running put payload bytes
    max_write_backlog_items: int = 4096
    backlog_policy: str = "drop"  # "drop": refuse the put (counted); "delay": block the submitter
    preallocate: bool = True  # posix_fallocate each file: ENOSPC before any data moves
    namespace: str = ""  # "" = each dir is the store's root; else the root is <dir>/<namespace> (one per process)
    pack_max_bytes: int = 64 << 20  # submit_put(pack=True): payload bytes per pack file

    @property
    def roots(self) -> list[str]:
        """The directories the store owns: `dirs`, or `<dir>/<namespace>` for each when namespaced."""
        return [os.path.join(d, self.namespace) if self.namespace else d for d in self.dirs]

    def __post_init__(self) -> None:
        if isinstance(self.dirs, str):
            self.dirs = [self.dirs]
        problems = []
        if not self.dirs:
            problems.append("dirs: at least one directory")
        if self.capacity_bytes <= 0:
            problems.append(f"capacity_bytes={self.capacity_bytes}: must be positive")
        if self.backend not in BACKENDS:
            problems.append(f"backend={self.backend!r}: one of {BACKENDS}")
        if self.backlog_policy not in BACKLOG_POLICIES:
            problems.append(f"backlog_policy={self.backlog_policy!r}: one of {BACKLOG_POLICIES}")
        if self.num_workers < 1 or self.file_io_threads < 0 or self.max_inflight < 1 or self.checksum_threads < 0:
            problems.append("num_workers >= 1, file_io_threads >= 0, max_inflight >= 1, checksum_threads >= 0")
        if self.checksum not in ("auto", "xxh3", "crc32"):
            problems.append(f"checksum={self.checksum!r}: one of auto, xxh3, crc32")
        if self.chunk_bytes <= 0 or self.chunk_bytes % 4096:
            problems.append(f"chunk_bytes={self.chunk_bytes}: a positive multiple of 4096")
        if self.namespace and not _NAMESPACE.fullmatch(self.namespace):
            problems.append(f"namespace={self.namespace!r}: one directory name of [A-Za-z0-9._-], not . or ..")
        if self.pack_max_bytes <= 0:
            problems.append(f"pack_max_bytes={self.pack_max_bytes}: must be positive")
        if problems:
            raise ValueError("invalid StoreConfig: " + "; ".join(problems))
