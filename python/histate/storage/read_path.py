"""The store's read path, on an I/O worker: look the keys up, read each file's wanted items (into the
caller's buffers or fresh aligned ones), retry a key whose file a put replaced meanwhile, and turn a
fault into a miss that removes the faulty file (docs/storage.md)."""
from __future__ import annotations

import logging
import os

import numpy as np

from histate.storage.buffers import aligned_empty
from histate.storage.index import Entry, StoredFile
from histate.storage.io_base import IoSession
from histate.storage.ops import ReadOp
from histate.storage.results import Fault, GetResult, IoFault
from histate.storage.transfer import read_items

log = logging.getLogger("histate.storage.store")

_READ_ATTEMPTS = 3  # a get that loses the race with a replacing put retries on the new file


class ReadPathMixin:
    """Gets, run by the store's workers.
    Part of `CheckpointStore` (store.py), kept apart because it is one job of the store's: the
    methods read and change the store's state under `self._lock` and rely on the attributes
    `CheckpointStore.__init__` sets, as SGLang's scheduler mixins rely on the Scheduler's."""

    def _run_read(self, sess: IoSession, op: ReadOp) -> None:
        todo = list(range(len(op.keys)))
        with self._lock:
            self.stats.gets += len(todo)
        for _attempt in range(_READ_ATTEMPTS):
            with self._lock:
                entries = self._index.get_many([op.keys[j] for j in todo])
            done: list[tuple[int, GetResult]] = []
            by_file: dict[int, list[tuple[int, Entry]]] = {}
            for j, entry in zip(todo, entries):
                if entry is None:
                    done.append((j, GetResult(op.keys[j], Fault.NOT_FOUND)))
                else:
                    by_file.setdefault(id(entry.file), []).append((j, entry))
            retry = []
            for group in by_file.values():
                retry += self._read_group(sess, op, group, done)
            self._finish_gets(op, done)
            if not retry:
                return
            todo = retry
        # replaced on every attempt
        self._finish_gets(op, [(j, GetResult(op.keys[j], Fault.NOT_FOUND)) for j in todo])

    def _read_group(self, sess: IoSession, op: ReadOp, group: list[tuple[int, Entry]],
                    done: list[tuple[int, GetResult]]) -> list[int]:
        """Read items of one file into `done`; returns the positions to retry (their key was replaced)."""
        file = group[0][1].file
        items = file.header.items
        wanted = []
        for j, entry in group:
            size = items[entry.index].payload_bytes
            dest = op.outs[j]
            if dest is None:
                wanted.append((j, entry, aligned_empty(size)))
            elif dest.size == size:
                wanted.append((j, entry, dest))
            else:  # the key holds an object of another size (replaced since the caller sized `dest`)
                done.append((j, GetResult(entry.key, Fault.SIZE_MISMATCH)))
        if not wanted:
            return []
        try:
            faults = self._read_file(sess, file, [e.index for _, e, _ in wanted], [f for _, _, f in wanted],
                                     verify_header=not file.is_pack)
        except IoFault as fault:
            faults = [fault] * len(wanted)
            whole_file = True
        else:
            whole_file = False
        retry, broken = [], []
        if not whole_file and faults.count(None) == len(faults):  # the common case, in one comprehension
            done += [(j, GetResult(entry.key, None, flat, items[entry.index].dtype_name, items[entry.index].shape))
                     for j, entry, flat in wanted]
            return retry
        for (j, entry, flat), fault in zip(wanted, faults):
            if fault is None:
                item = items[entry.index]
                done.append((j, GetResult(entry.key, None, flat, item.dtype_name, item.shape)))
                continue
            with self._lock:
                current = self._index.get(entry.key)
            if current is not None and current.generation != entry.generation:
                retry.append(j)  # a put replaced the file under us: read the new one, not a fault
            elif current is None:
                done.append((j, GetResult(entry.key, Fault.NOT_FOUND)))
            else:
                broken.append(entry)
                done.append((j, GetResult(entry.key, fault.fault)))
        if broken:
            self._drop_faulty(broken, faults[0] if whole_file else None)
        return retry

    def _read_file(self, sess: IoSession, file: StoredFile, indices: list[int], outs: list[np.ndarray],
                   verify_header: bool) -> list[IoFault | None]:
        dir_fd = self._roots[file.loc.root].open_fanout(file.loc.fanout, create=False)
        try:
            f = sess.open_read(dir_fd, file.loc.name, self._direct_for(file.loc), file.path)
        finally:
            os.close(dir_fd)
        try:
            return read_items(sess, f, file.header, indices, outs, self._pipe, verify_header)
        finally:
            sess.close(f)

    def _drop_faulty(self, entries: list[Entry], file_fault: IoFault | None) -> None:
        """A read fault: unindex the items (the whole file for a file-level fault) and remove what we can."""
        log.info("histate.storage: miss on %r: %s", entries[0].key, file_fault or "checksum mismatch")
        with self._lock:
            file = entries[0].file
            if file_fault is not None:  # the file itself is bad: all its items go
                entries = [e for e in self._index.entries_of(file)]
            entries = [e for e in entries if self._index.get(e.key) is e]
            if not entries:
                return
            self._remove_entries(entries, strict=False)
            if file_fault is None or file_fault.fault is not Fault.MISSING_FILE:
                self.stats.files_removed_on_fault += 1
        for e in entries:
            self._emit(e, "fault")

    def _finish_gets(self, op: ReadOp, done: list[tuple[int, GetResult]]) -> None:
        """Count and complete read results, (position in op, result), under one lock acquisition each."""
        if not done:
            return
        hits = [r.buffer.size for _j, r in done if r.fault is None]
        with self._lock:
            self.stats.hits += len(hits)
            self.stats.bytes_read += sum(hits)
            if len(hits) < len(done):
                for _j, result in done:
                    if result.fault is not None:
                        self.stats.count(self.stats.misses, result.fault)
        op.batch._complete_many([(op.slots[j], result) for j, result in done])
