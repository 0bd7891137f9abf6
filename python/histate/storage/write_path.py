"""The store's write path, on an I/O worker or inline: write a file under a temporary name, publish it
by an atomic rename unless a later put of its key won meanwhile (`superseded`) or the name holds a file
the store cannot prove it wrote (`unsafe_path`), index it, bury the copy it replaced, and release the
op's backlog and reservation (docs/storage.md)."""
from __future__ import annotations

import logging
import os

from histate.storage.format import align_up
from histate.storage.index import Entry, StoredFile, new_entry, write_liveness
from histate.storage.io_base import IoSession
from histate.storage.layout import Location
from histate.storage.ops import Publication, WriteOp
from histate.storage.ownership import is_replaceable, remove_file
from histate.storage.results import Fault, IoFault, PutResult, fault_from_oserror
from histate.storage.transfer import write_items

log = logging.getLogger("histate.storage.store")


class WritePathMixin:
    """Puts, run by the store's workers (or inline by the caller).
    Part of `CheckpointStore` (store.py), kept apart because it is one job of the store's: the
    methods read and change the store's state under `self._lock` and rely on the attributes
    `CheckpointStore.__init__` sets, as SGLang's scheduler mixins rely on the Scheduler's."""

    def _run_write(self, sess: IoSession, op: WriteOp) -> None:
        if all(item.cancelled for item in op.items):
            self._finish_put(op, {item.slot: Fault.CANCELLED for item in op.items}, None)
            return
        loc, root = op.loc, self._roots[op.loc.root]
        tmp = loc.temp(root.root_id)
        label = os.path.join(root.path, tmp.fanout, tmp.name)
        try:
            dir_fd = root.open_fanout(loc.fanout, create=True)
        except IoFault as fault:
            log.warning("histate.storage: put %r failed: %s", op.items[0].key, fault)
            self._finish_put(op, {item.slot: fault.fault for item in op.items}, None)
            return
        try:
            try:
                f = sess.create(dir_fd, tmp.name, op.file_bytes, self._direct_for(loc), label)
                try:
                    header = write_items(sess, f, op.seq, [i.spec for i in op.items], [i.src for i in op.items],
                                         self._pipe, op.header_bytes, lambda h: self._prepare_publication(op, h),
                                         root_id=root.root_id)
                finally:
                    sess.close(f)
            except BaseException as exc:
                remove_file(dir_fd, tmp.name)
                if not isinstance(exc, (IoFault, OSError)):
                    raise
                fault = exc if isinstance(exc, IoFault) else fault_from_oserror(exc, f"write {label}")
                log.info("histate.storage: put %r failed: %s", op.items[0].key, fault)
                self._finish_put(op, {item.slot: fault.fault for item in op.items}, None)
                return
            with self._lock:
                faults, published = self._publish(op, dir_fd, tmp, header)
                self._finish_put_locked(op, faults)
        finally:
            os.close(dir_fd)
        self._complete_puts(op, faults, header if published else None)

    def _publish(self, op: WriteOp, dir_fd: int, tmp: Location, header) -> tuple[dict[int, Fault], bool]:
        """(lock held) Decide which items are still wanted, make the others dead in the file, rename it
        into place and index it. Returns per-slot faults of the items not published, and whether the file was."""
        faults: dict[int, Fault] = {}
        indexed, latest_seq = self._index.get, self._latest_seq.get
        for item in op.items:
            if item.cancelled:
                faults[item.slot] = Fault.CANCELLED
                continue
            current = indexed(item.key)
            if (current is not None and current.file.header.seq > op.seq) or latest_seq(item.key, 0) > op.seq:
                faults[item.slot] = Fault.SUPERSEDED
        unsafe = len(faults) < len(op.items) and not self._may_replace(op, dir_fd)
        if len(faults) == len(op.items) or unsafe:
            remove_file(dir_fd, tmp.name)
            if unsafe:
                log.warning("histate.storage: %s is not a file the store provably wrote; not replacing it",
                            self.layout.path(op.loc))
                faults.update({item.slot: Fault.UNSAFE_PATH for item in op.items if item.slot not in faults})
            return faults, False
        try:
            if faults:
                write_liveness(dir_fd, tmp.name, header, [i for i, it in enumerate(op.items) if it.slot not in faults])
            os.rename(tmp.name, op.loc.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # atomic publish
        except OSError as exc:
            remove_file(dir_fd, tmp.name)
            fault = fault_from_oserror(exc, f"publish {self.layout.path(op.loc)}").fault
            faults.update({item.slot: fault for item in op.items if item.slot not in faults})
            return faults, False
        if op.publication is None:
            self._prepare_publication(op, header)
        op.publication.file.published_s = self._clock()
        publish, pending = self._index.publish, self._pending_puts.get
        for entry, item in zip(op.publication.entries, op.items):
            if faults and item.slot in faults:
                continue
            replaced = publish(entry)
            if len(pending(item.key, ())) > 1:  # an older put of it may still be running
                self._latest_seq[item.key] = op.seq
            if replaced is not None and replaced.file.loc != op.loc:
                self._bury(replaced)
        return faults, True

    def _may_replace(self, op: WriteOp, dir_fd: int) -> bool:
        """(lock held) Whether `op`'s file may be renamed over what sits at its name: nothing, the key's
        own indexed copy (proved when it was indexed), or a file that proves the store wrote it here."""
        current = self._index.get(op.items[0].key)
        if current is not None and current.file.loc == op.loc:
            return True
        return is_replaceable(self._roots[op.loc.root], dir_fd, op.loc.name)

    def _prepare_publication(self, op: WriteOp, header) -> None:
        """Index record, entries and results of `op` (no lock needed: nothing shared is touched). Runs
        beside the payload's I/O when the write is pipelined (write_items' on_sealed)."""
        file = StoredFile(op.loc, self.layout.path(op.loc), header)
        op.publication = Publication(file, [new_entry(item.key, file, i) for i, item in enumerate(op.items)],
                                      self._put_results(op, {}, header))

    def _bury(self, old: Entry) -> None:
        """(lock held) The replaced copy of a key: delete its file, or mark it dead in its pack, so it
        cannot come back at restart (if that fails, the newer copy's higher seq still wins there)."""
        try:
            dir_fd = self._roots[old.file.loc.root].open_fanout(old.file.loc.fanout, create=False)
        except IoFault:
            return
        try:
            if not old.file.live:
                remove_file(dir_fd, old.file.loc.name)
            else:
                write_liveness(dir_fd, old.file.loc.name, old.header, old.file.live)
        except OSError as exc:
            log.warning("histate.storage: cannot remove the replaced copy of %r in %s: %s", old.key, old.path, exc)
        finally:
            os.close(dir_fd)

    def _finish_put(self, op: WriteOp, faults: dict[int, Fault], header) -> None:
        with self._lock:
            self._finish_put_locked(op, faults)
        self._complete_puts(op, faults, header)

    def _finish_put_locked(self, op: WriteOp, faults: dict[int, Fault]) -> None:
        op.finished = True
        self._reserved_bytes -= op.reserved_bytes
        op.reserved_bytes = 0
        payload_bytes = op.payload_bytes
        self._backlog_items -= len(op.items)
        self._backlog_bytes -= payload_bytes
        pending_puts, latest_seq = self._pending_puts, self._latest_seq
        for item in op.items:
            pending = pending_puts.get(item.key)
            if pending is None:
                continue
            if len(pending) == 1:
                if pending[0] is op:
                    del pending_puts[item.key]
                    if latest_seq:
                        latest_seq.pop(item.key, None)
            else:
                pending[:] = [p for p in pending if p is not op]
        self.stats.puts += len(op.items)
        self.stats.puts_stored += len(op.items) - len(faults)
        self.stats.bytes_written += (sum(item.src.size for item in op.items if item.slot not in faults) if faults
                                     else payload_bytes)
        for fault in faults.values():
            self.stats.count(self.stats.put_failures, fault)
        self._room.notify_all()

    def _complete_puts(self, op: WriteOp, faults: dict[int, Fault], header) -> None:
        if not faults and op.publication is not None:
            op.batch._complete_many(op.publication.results)
        else:
            op.batch._complete_many(self._put_results(op, faults, header))

    def _put_results(self, op: WriteOp, faults: dict[int, Fault], header) -> list[tuple[int, PutResult]]:
        """Results of every item: a stored item reports its share of the file (a pack's header counts
        with its first item, so the shares add up to the file size)."""
        results = []
        for i, item in enumerate(op.items):
            fault = faults.get(item.slot) if faults else None
            if fault is not None:
                results.append((item.slot, PutResult(item.key, fault)))
            elif not op.pack:
                results.append((item.slot, PutResult(item.key, None, header.file_bytes)))
            else:
                share = align_up(item.src.size) + (header.header_bytes if i == 0 else 0)
                results.append((item.slot, PutResult(item.key, None, share)))
        return results

