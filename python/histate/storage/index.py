"""The in-memory index of published items and its warm-restart rebuild from the roots.

The index is the single source of truth for what the store serves: a key is readable only once its
file was renamed into place and its entry published. Entries keep publication order (oldest first)
for the default eviction order. Bytes are accounted per file: a file counts in full while at least
one of its items is indexed (a pack's bytes are freed with its last item).

Rebuild trusts nothing it did not write and touches nothing else: it only looks at names of the
store's scheme inside the fan-out directories of roots the store owns, and it removes a file only when
the file proves the store wrote it in that root (the root id in a temp file's name or in a file's
header, see ownership.py); a file of the scheme without that proof is left alone and counted foreign.
Temp files are torn writes and are deleted; a final file is kept only if its header decodes, its name
matches its content (the key of a single object, the sequence number of a pack) and its size matches
the header. When two files hold the same key, the higher sequence number (the later write) wins and the
other copy is deleted (a single object) or marked deleted in its pack. Payload checksums are verified
on every read, so a file with a valid header but torn payload (possible after power loss, see
docs/storage.md) becomes a miss when first read.
"""
from __future__ import annotations

import itertools
import logging
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, NamedTuple

from histate.storage.format import (ALIGN_BYTES, FileHeader, FormatError, Item, align_up, claimed_root_id,
                                    decode_header, encode_header, header_bytes_from_prefix)
from histate.storage.layout import (Layout, Location, OBJECT_SUFFIX, classify_name, encode_key, pack_stem, PACK_SUFFIX,
                                    temp_root_id)
from histate.storage.ownership import MARKER_NAME, OwnedRoot, StoreDirectoryError, remove_file
from histate.storage.results import IoFault

log = logging.getLogger(__name__)
_generations = itertools.count(1)


@dataclass(eq=False)
class StoredFile:
    """One published file and which of its items are still indexed."""

    loc: Location
    path: str
    header: FileHeader
    live: set[int] = field(default_factory=set)
    is_pack: bool = field(init=False)  # read once per key of every get: a field, not a property
    published_s: float = 0.0  # clock time its items were published (all at once), or indexed at restart

    def __post_init__(self) -> None:
        self.is_pack = self.loc.name.endswith(PACK_SUFFIX)

    @property
    def file_bytes(self) -> int:
        return self.header.file_bytes


class Entry(NamedTuple):
    """One published key (immutable; a tuple because one is made per stored page, on the hot path)."""

    key: str
    file: StoredFile
    index: int  # item index within the file
    generation: int  # identity of this publication: guards removals against a newer copy

    @property
    def published_s(self) -> float:
        return self.file.published_s

    @property
    def header(self) -> FileHeader:
        return self.file.header

    @property
    def item(self) -> Item:
        return self.file.header.items[self.index]

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def offset(self) -> int:
        return self.item.offset

    @property
    def seq(self) -> int:
        return self.file.header.seq

    @property
    def file_bytes(self) -> int:
        """This item's share of the disk: the whole file for a single object, the padded payload in a pack."""
        return self.item.padded_bytes if self.file.is_pack else self.file.file_bytes


def new_entry(key: str, file: StoredFile, index: int) -> Entry:
    return Entry(key, file, index, next(_generations))


class Index:
    """Published entries plus the bytes of the files they live in. Not thread-safe: the store locks."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def get_many(self, keys: list[str]) -> list[Entry | None]:
        return list(map(self._entries.get, keys))

    def publish(self, entry: Entry) -> Entry | None:
        """Insert or replace; returns the replaced entry (its file may now be dead). Newest last."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._drop_item(old)
        if not entry.file.live:
            self.used_bytes += entry.file.file_bytes
        entry.file.live.add(entry.index)
        self._entries[entry.key] = entry
        return old

    def remove(self, key: str, generation: int | None = None) -> Entry | None:
        """Remove `key` (only if it is still publication `generation`, when given)."""
        entry = self._entries.get(key)
        if entry is None or (generation is not None and entry.generation != generation):
            return None
        del self._entries[key]
        self._drop_item(entry)
        return entry

    def _drop_item(self, entry: Entry) -> None:
        entry.file.live.discard(entry.index)
        if not entry.file.live:
            self.used_bytes -= entry.file.file_bytes

    def entries_of(self, file: StoredFile) -> list[Entry]:
        return [self._entries[file.header.items[i].key] for i in sorted(file.live)]

    def oldest_first(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def keys(self) -> list[str]:
        return list(self._entries)


class _Candidate(NamedTuple):
    """What rebuild reads of a file of the scheme: whose it claims to be, and its header if it decodes."""

    root_id: int | None  # the root id at its fixed offset (None: too short, or not a regular file)
    header: FileHeader | None  # None: the header does not decode
    live: tuple[bool, ...]
    size_bytes: int
    mtime_s: float


def _read_candidate(dir_fd: int, name: str) -> _Candidate:
    """One open per file (non-blocking: a FIFO is never waited on). Raises OSError when unreadable."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _Candidate(None, None, (), st.st_size, st.st_mtime)
        prefix = os.pread(fd, ALIGN_BYTES, 0)
        try:
            header_bytes = header_bytes_from_prefix(prefix)
            header_bytes = min(header_bytes, st.st_size)  # a damaged length field must not size the read
            rest = os.pread(fd, header_bytes - len(prefix), len(prefix)) if header_bytes > len(prefix) else b""
            header, live = decode_header(prefix + rest)
        except FormatError:
            header, live = None, ()
    finally:
        os.close(fd)
    return _Candidate(claimed_root_id(prefix), header, live, st.st_size, st.st_mtime)


def write_liveness(dir_fd: int, name: str, header: FileHeader, live: Collection[int]) -> None:
    """Durably record which items of a pack are live: the header blocks holding the liveness bytes are
    re-encoded from `header` and written whole (no read-modify-write of the block)."""
    first = header.liveness_offset // ALIGN_BYTES * ALIGN_BYTES
    stop = align_up(header.liveness_offset + len(header.items))
    block = encode_header(header, [i in live for i in range(len(header.items))])[first:stop]
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")
        os.pwrite(fd, block, first)
    finally:
        os.close(fd)


@dataclass
class RebuildReport:
    kept: int = 0  # items indexed
    discarded: int = 0  # files removed: temp files, corrupt/short/misnamed files, losing duplicates
    foreign: int = 0  # entries not provably the store's (other names, other root ids, unreadable): left alone
    reasons: dict[str, int] = field(default_factory=dict)
    max_seq: int = 0

    def count(self, reason: str) -> None:
        self.discarded += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


@dataclass
class _Found:
    file: StoredFile
    live: list[bool]
    mtime_s: float
    dir_fd: int
    had_live: bool = True


def _scan_fanout(root_idx: int, root: OwnedRoot, fanout: str, layout: Layout, report: RebuildReport,
                 found: list[_Found], fds: list[int]) -> Iterator[None]:
    try:
        dir_fd = root.open_fanout(fanout, create=False)
    except IoFault:  # vanished or replaced since it was listed: nothing of ours to index there
        report.foreign += 1
        return
    fds.append(dir_fd)
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda de: de.name)
    for de in entries:
        yield
        kind = classify_name(de.name)
        if de.name == MARKER_NAME:
            raise StoreDirectoryError(f"{root.path}/{fanout} holds another store's {MARKER_NAME}: nested stores "
                                      f"are refused")
        if kind is None or not de.is_file(follow_symlinks=False):
            report.foreign += 1
            continue
        if kind == "temp":
            if temp_root_id(de.name) != root.root_id:
                report.foreign += 1
                continue
            remove_file(dir_fd, de.name)
            report.count("temp")
            continue
        try:
            found_file = _read_candidate(dir_fd, de.name)
        except OSError:  # unreadable: nothing proves it is ours
            report.foreign += 1
            continue
        if found_file.root_id != root.root_id:
            report.foreign += 1
            continue
        header, live = found_file.header, found_file.live
        if header is None:
            _discard(dir_fd, de.name, report, "corrupt")
            continue
        if kind == "object":
            named_right = len(header.items) == 1 and encode_key(header.items[0].key) + OBJECT_SUFFIX == de.name
        else:
            named_right = pack_stem(header.seq) + PACK_SUFFIX == de.name
        if not named_right:
            _discard(dir_fd, de.name, report, "misnamed")
            continue
        if found_file.size_bytes != header.file_bytes:
            _discard(dir_fd, de.name, report, "short" if found_file.size_bytes < header.file_bytes else "corrupt")
            continue
        report.max_seq = max(report.max_seq, header.seq)
        loc = Location(root_idx, fanout, de.name)
        found.append(_Found(StoredFile(loc, layout.path(loc), header), list(live), found_file.mtime_s, dir_fd,
                            any(live)))


def _discard(dir_fd: int, name: str, report: RebuildReport, reason: str) -> None:
    report.count(reason)
    try:
        remove_file(dir_fd, name)
    except OSError as exc:
        log.warning("histate.storage: cannot remove %s file %s: %s", reason, name, exc)


def rebuild(layout: Layout, roots: list[OwnedRoot], now_s: float,
            progress: Callable[[Iterator], Iterator] | None = None) -> tuple[Index, RebuildReport]:
    """Scan every owned root, drop torn/corrupt files and losing duplicates, index the rest oldest first."""
    report = RebuildReport()
    found: list[_Found] = []
    fds: list[int] = []
    try:
        def walk() -> Iterator[None]:
            for i, root in enumerate(roots):
                fanouts, foreign = root.fanout_dirs()
                report.foreign += len(foreign)
                for fanout in fanouts:
                    yield from _scan_fanout(i, root, fanout, layout, report, found, fds)

        for _ in (progress(walk()) if progress else walk()):
            pass
        winners = _resolve_duplicates(found, report)
        index = Index()
        for f in sorted(found, key=lambda f: (f.mtime_s, f.file.header.seq)):
            f.file.published_s = now_s
            for i, item in enumerate(f.file.header.items):
                if f.live[i] and winners.get(item.key) is f:
                    index.publish(new_entry(item.key, f.file, i))
                    report.kept += 1
            if not f.file.live:  # nothing of it survived: the file goes
                _discard(f.dir_fd, f.file.loc.name, report, "duplicate" if f.had_live else "dead")
    finally:
        for fd in fds:
            os.close(fd)
    return index, report


def _resolve_duplicates(found: list[_Found], report: RebuildReport) -> dict[str, _Found]:
    """Key -> the file holding its latest (highest-seq) live copy; older live copies are deleted on disk."""
    winners: dict[str, _Found] = {}
    for f in sorted(found, key=lambda f: f.file.header.seq):
        for i, item in enumerate(f.file.header.items):
            if not f.live[i]:
                continue
            prev = winners.get(item.key)
            if prev is not None:
                _kill_copy(prev, item.key, report)
            winners[item.key] = f
    return winners


def _kill_copy(f: _Found, key: str, report: RebuildReport) -> None:
    i = next(i for i, item in enumerate(f.file.header.items) if item.key == key and f.live[i])
    f.live[i] = False
    if f.file.is_pack and any(f.live):
        try:
            write_liveness(f.dir_fd, f.file.loc.name, f.file.header, [j for j, alive in enumerate(f.live) if alive])
        except OSError as exc:
            log.warning("histate.storage: cannot mark %r deleted in %s: %s", key, f.file.path, exc)
