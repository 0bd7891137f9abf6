"""The store's byte budget and write backlog: admitting a put (backlog bound, reservation, capacity
eviction through the owner's `on_capacity_needed` or oldest files first), removing files, and
reporting removals to the owner's `on_evict` (docs/storage.md, "Capacity and eviction contract")."""
from __future__ import annotations

import logging
import os

from histate.storage.index import Entry, write_liveness
from histate.storage.ops import WriteOp
from histate.storage.ownership import remove_file
from histate.storage.results import EvictionEvent, Fault, IoFault, PutResult

log = logging.getLogger("histate.storage.store")


class BudgetMixin:
    """Backlog bound and byte budget of the store's puts; removal and its events.
    Part of `CheckpointStore` (store.py), kept apart because it is one job of the store's: the
    methods read and change the store's state under `self._lock` and rely on the attributes
    `CheckpointStore.__init__` sets, as SGLang's scheduler mixins rely on the Scheduler's."""

    # --- owner callbacks -----------------------------------------------------------------------
    def _owner_failed(self, name: str) -> None:
        """Count an exception raised by an owner callback; log it (with traceback) once per callback."""
        with self._lock:
            self.stats.owner_errors[name] = self.stats.owner_errors.get(name, 0) + 1
            first = name not in self._owner_errors_logged
            self._owner_errors_logged.add(name)
        if first:
            log.warning("histate.storage: the owner's %s raised; the put that needed it fails with "
                        "owner_error (further errors of it are counted in stats owner_errors, not logged)",
                        name, exc_info=True)

    def _emit(self, entry: Entry, reason: str) -> bool:
        """Report a removal to on_evict; False if the callback raised (counted and logged)."""
        if self._on_evict is None:
            return True
        try:
            self._on_evict(EvictionEvent(entry.key, entry.file_bytes, self._clock() - entry.file.published_s, reason))
        except Exception:
            self._owner_failed("on_evict")
            return False
        return True

    # --- admission: backlog bound and byte budget ------------------------------------------------
    def _admit_write(self, op: WriteOp, inline: bool) -> bool:
        """Backlog bound + byte budget + sequence number. Queues the op (or, `inline`, leaves it to the
        caller to run) and returns True; on refusal completes its items with the fault and returns False.
        An inline put falls back to the queue when queued writes exist or the key has a put pending."""
        fault = self._admit(op)
        if fault is not None:
            with self._lock:
                for item in op.items:
                    self.stats.puts += 1
                    self.stats.count(self.stats.put_failures, fault)
            for item in op.items:
                op.batch._complete(item.slot, PutResult(item.key, fault))
            return False
        with self._lock:
            inline = inline and not self._writes and not any(i.key in self._pending_puts for i in op.items)
            op.seq = self._next_seq
            self._next_seq += 1
            op.loc = self.layout.pack_location(op.seq) if op.pack else self.layout.object_location(op.items[0].key)
            for item in op.items:
                self._pending_puts.setdefault(item.key, []).append(op)
            if not inline:
                self._writes.append(op)
                self._work.notify()
        return inline

    def _admit(self, op: WriteOp) -> Fault | None:
        payload, count = op.payload_bytes, len(op.items)
        cfg = self.config
        with self._lock:
            if self._closing:
                return Fault.CANCELLED

            def room() -> bool:  # an oversized put is admitted alone rather than never
                return self._backlog_items == 0 or (
                    self._backlog_items + count <= cfg.max_write_backlog_items
                    and self._backlog_bytes + payload <= cfg.max_write_backlog_bytes)

            if not room():
                if cfg.backlog_policy == "drop":
                    return Fault.BACKLOG_FULL
                self.stats.writes_delayed += 1
                self._room.wait_for(lambda: room() or self._closing)
                if self._closing:
                    return Fault.CANCELLED
            self._backlog_items += count
            self._backlog_bytes += payload
        fault: Fault | None = Fault.IO_ERROR
        try:
            fault = self._reserve(op.file_bytes)
        finally:
            if fault is not None:  # any refusal, or an exception escaping: give the backlog slot back
                with self._lock:
                    self._backlog_items -= count
                    self._backlog_bytes -= payload
                    self._room.notify_all()
        if fault is None:
            op.reserved_bytes = op.file_bytes
        return fault

    def _reserve(self, file_bytes: int) -> Fault | None:
        """Reserve `file_bytes` of the budget, removing victims until they fit. The victims are asked for
        again while the last round removed something: another thread (a delete, another put's round)
        may have removed some of them since they were chosen, so a round can free less than it was
        asked to (seen: an owner's snapshot naming objects an earlier round had already removed)."""
        capacity = self.config.capacity_bytes
        if file_bytes > capacity:
            return Fault.NO_CAPACITY
        while True:
            with self._lock:
                need = self._index.used_bytes + self._reserved_bytes + file_bytes - capacity
                if need <= 0:
                    self._reserved_bytes += file_bytes
                    return None
                victims = None if self._on_capacity_needed else self._oldest_covering(need)
            if victims is None:
                try:
                    victims = list(self._on_capacity_needed(need))
                except Exception:
                    self._owner_failed("on_capacity_needed")
                    return Fault.OWNER_ERROR
            owner_ok, removed = True, 0
            for key in victims:
                for entry in self._evict_file_of(key):
                    removed += 1
                    owner_ok = self._emit(entry, "capacity") and owner_ok
            if not owner_ok:
                return Fault.OWNER_ERROR
            if not removed:
                return Fault.NO_CAPACITY

    def _oldest_covering(self, need: int) -> list[str]:
        """Keys of the oldest files whose removal frees `need` bytes (one key per file suffices)."""
        victims, freed, seen = [], 0, set()
        for entry in self._index.oldest_first():
            if freed >= need:
                break
            if id(entry.file) not in seen:
                seen.add(id(entry.file))
                victims.append(entry.key)
                freed += entry.file.file_bytes
        return victims

    def _evict_file_of(self, key: str) -> list[Entry]:
        """Capacity eviction works in files: the whole file holding `key` (a pack: all its live items)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return []
            entries = self._index.entries_of(entry.file)
            return entries if self._remove_entries(entries, strict=True) else []

    # --- removal (lock held) -----------------------------------------------------------------------
    def _remove_entries(self, entries: list[Entry], strict: bool) -> bool:
        """Remove entries of one file from disk, then from the index. The file goes when none of its items
        stays indexed; otherwise each item is marked deleted in its pack. `strict`: if the disk refuses,
        keep everything indexed and return False; else (faults) unindex anyway."""
        file = entries[0].file
        dying = file.live == {e.index for e in entries}
        try:
            dir_fd = self._roots[file.loc.root].open_fanout(file.loc.fanout, create=False)
        except IoFault as fault:
            dir_fd = None
            ok = fault.fault is Fault.MISSING_FILE  # the directory (and so the file) is already gone
        if dir_fd is not None:
            try:
                if dying:
                    ok = remove_file(dir_fd, file.loc.name)
                else:
                    write_liveness(dir_fd, file.loc.name, file.header, file.live - {e.index for e in entries})
                    ok = True
            except OSError as exc:
                log.warning("histate.storage: cannot remove %r from %s: %s", entries[0].key, file.path, exc)
                ok = False
            finally:
                os.close(dir_fd)
        if strict and not ok:
            return False
        for e in entries:
            if self._index.remove(e.key, e.generation) is not None:
                self.stats.evictions += 1
        return True
