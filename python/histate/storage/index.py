"""The in-memory index of published objects and its warm-restart rebuild from the directories.

The index is the single source of truth for what the store serves: a key is readable only once its
file was renamed into place and its entry published. Entries keep publication order (oldest first)
for the default eviction order. Rebuild trusts nothing: temp files are torn writes and are deleted;
a final file is kept only if its header decodes, names the key its file name encodes, and its size
matches the header. Payload checksums are verified on every read, so a file with a valid header but
torn payload (possible after power loss, see docs/storage.md) becomes a miss when first read.
"""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator

from histate.storage.format import ALIGN_BYTES, FormatError, Header, decode_header, header_bytes_from_prefix
from histate.storage.layout import FINAL_SUFFIX, Layout, encode_key, is_final_name, is_temp_name

_generations = itertools.count(1)


@dataclass(frozen=True)
class Entry:
    key: str
    path: str
    header: Header
    published_s: float
    generation: int  # identity of this publication: guards unlinks against a newer file at the same path

    @property
    def file_bytes(self) -> int:
        return self.header.file_bytes


def new_entry(key: str, path: str, header: Header, published_s: float) -> Entry:
    return Entry(key, path, header, published_s, next(_generations))


class Index:
    """Published entries plus the byte total they occupy. Not thread-safe: the store locks around it."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def publish(self, entry: Entry) -> Entry | None:
        """Insert or replace; returns the replaced entry. The entry becomes the newest."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self.used_bytes -= old.file_bytes
        self._entries[entry.key] = entry
        self.used_bytes += entry.file_bytes
        return old

    def remove(self, key: str, generation: int | None = None) -> Entry | None:
        """Remove `key` (only if it is still publication `generation`, when given)."""
        entry = self._entries.get(key)
        if entry is None or (generation is not None and entry.generation != generation):
            return None
        del self._entries[key]
        self.used_bytes -= entry.file_bytes
        return entry

    def oldest_first(self) -> Iterator[Entry]:
        return iter(list(self._entries.values()))

    def keys(self) -> list[str]:
        return list(self._entries)


def read_header_file(path: str) -> Header:
    """Decode the header of `path` with plain buffered reads (used at rebuild, before any backend)."""
    with open(path, "rb", buffering=0) as fh:
        prefix = fh.read(ALIGN_BYTES)
        header_bytes = header_bytes_from_prefix(prefix)
        rest = fh.read(header_bytes - len(prefix)) if header_bytes > len(prefix) else b""
    return decode_header(prefix + rest)


@dataclass
class RebuildReport:
    kept: int = 0
    discarded: int = 0  # temp files, corrupt/short/misnamed files, duplicates
    reasons: dict[str, int] | None = None

    def discard(self, path: str, reason: str) -> None:
        self.discarded += 1
        self.reasons = self.reasons or {}
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        try:
            os.unlink(path)
        except OSError:
            pass


def _candidate_files(root: str) -> Iterator[os.DirEntry]:
    if not os.path.isdir(root):
        return
    with os.scandir(root) as top:
        subdirs = []
        for de in top:
            if de.is_dir(follow_symlinks=False):
                subdirs.append(de.path)
            elif de.is_file(follow_symlinks=False):
                yield de
    for d in sorted(subdirs):
        with os.scandir(d) as it:
            yield from (de for de in it if de.is_file(follow_symlinks=False))


def rebuild(layout: Layout, now_s: float, progress: Callable[[Iterator], Iterator] | None = None
            ) -> tuple[Index, RebuildReport]:
    """Scan every root, delete torn/corrupt files, and index the rest oldest-mtime first."""
    report = RebuildReport()
    found: dict[str, tuple[float, str, Header]] = {}
    files = (de for root in layout.roots for de in _candidate_files(root))
    for de in (progress(files) if progress else files):
        name = de.name
        if is_temp_name(name):
            report.discard(de.path, "temp")
            continue
        if not is_final_name(name):
            continue  # LOCK and foreign files are not ours to judge
        try:
            header = read_header_file(de.path)
            st = os.stat(de.path)
        except FormatError:
            report.discard(de.path, "corrupt")
            continue
        except OSError:
            report.discard(de.path, "unreadable")
            continue
        if encode_key(header.key) + FINAL_SUFFIX != name:
            report.discard(de.path, "misnamed")
            continue
        if st.st_size != header.file_bytes:
            report.discard(de.path, "short" if st.st_size < header.file_bytes else "corrupt")
            continue
        prev = found.get(header.key)
        if prev is not None:  # same key under two roots (root list changed): keep the expected location
            keep_new = layout.is_expected_path(header.key, de.path)
            report.discard(prev[1] if keep_new else de.path, "duplicate")
            if not keep_new:
                continue
        found[header.key] = (st.st_mtime, de.path, header)
    index = Index()
    for key, (_mtime, path, header) in sorted(found.items(), key=lambda kv: kv[1][0]):
        index.publish(new_entry(key, path, header, now_s))
        report.kept += 1
    return index, report
