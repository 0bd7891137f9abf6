"""CheckpointStore: the SSD store for recurrent checkpoints and cold KV pages.

Owns the byte budget, the index, the I/O queues and the workers. Callers submit batches of gets and
puts and poll or wait on the returned IoBatch. Reads always run before queued writes; the write backlog
is bounded in items and bytes (drop or delay, counted). Every fault becomes a miss (get) or a failed
put with a reason and a counter; the faulty file is removed and the store keeps serving. The store never
decides *what* to evict beyond its contract: when a put needs room it asks the owner's
`on_capacity_needed(bytes_needed) -> keys`, or takes the oldest files when no callback is given, and it
reports every removal as an EvictionEvent(key, size_bytes, residence_s, reason) to `on_evict`. An
exception in either callback is counted, logged once, and fails the put that triggered it.

Writes are ordered per key: every put gets a sequence number when it is admitted, and a put whose
key was meanwhile published by a later-admitted put is dropped at publication (`superseded`), so the
last put submitted wins, in memory and on disk.

Threading: the public methods are thread-safe. `on_capacity_needed` runs in the submitting thread with
no store lock held (it may call `exists`/`delete`). `on_evict` runs without the lock too, in the thread
that removed the object: the caller's for capacity and delete, an I/O worker's for faults.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from histate.storage.batch import IoBatch
from histate.storage.buffers import aligned_empty, destination_bytes, source_view
from histate.storage.config import StoreConfig
from histate.storage.file_backend import FileSession
from histate.storage.format import (CHECKSUM_NAMES, CHECKSUM_XXH3, DEFAULT_CHECKSUM, MAX_ITEMS, ItemSpec, align_up,
                                    header_bytes_for, xxhash)
from histate.storage.index import Entry, Index, StoredFile, new_entry, rebuild, write_liveness
from histate.storage.io_base import DirectIoChoice, IoSession, probe_direct_io
from histate.storage.layout import Layout, Location, validate_key
from histate.storage.nixl_backend import NixlSession, NixlUnavailable
from histate.storage.ownership import OwnedRoot, claim_roots, is_replaceable, remove_file
from histate.storage.results import (EvictionEvent, Fault, GetResult, IoFault, PutResult, StoreStats,
                                     fault_from_oserror)
from histate.storage.transfer import PipelineConfig, read_items, write_items

log = logging.getLogger(__name__)

_READ_ATTEMPTS = 3  # a get that loses the race with a replacing put retries on the new file
CapacityCallback = Callable[[int], Iterable[str]]
EvictCallback = Callable[[EvictionEvent], None]


@dataclass(eq=False, slots=True)
class _PutItem:
    key: str
    src: np.ndarray  # flat uint8, borrowed from the caller until completion
    spec: ItemSpec
    slot: int  # position in the caller's batch
    cancelled: bool = False


@dataclass(eq=False)
class _WriteOp:
    """One file to write: a single object, or a pack of several items."""

    items: list[_PutItem]
    batch: IoBatch
    pack: bool
    header_bytes: int
    file_bytes: int
    seq: int = 0
    loc: Location | None = None
    reserved_bytes: int = 0
    finished: bool = False  # backlog, reservation and pending entries released
    publication: _Publication | None = None  # prepared beside the I/O, once the header is known

    @property
    def payload_bytes(self) -> int:
        return sum(i.src.size for i in self.items)


@dataclass(eq=False, slots=True)
class _Publication:
    """What publishing a written file takes, built while its payload is still being written: its
    index record, one entry per item, and the results if every item gets published."""

    file: StoredFile
    entries: list[Entry]
    results: list[tuple[int, PutResult]]


@dataclass(eq=False)
class _ReadOp:
    keys: list[str]
    slots: list[int]
    outs: list[object]
    batch: IoBatch


def _make_sessions(cfg: StoreConfig, count: int) -> tuple[str, list[IoSession]]:
    if cfg.backend in ("auto", "nixl"):
        sessions: list[IoSession] = []
        try:
            for _ in range(count):
                sessions.append(NixlSession(cfg.nixl_params, preallocate=cfg.preallocate))
            return "nixl", sessions
        except NixlUnavailable as exc:
            for s in sessions:
                s.shutdown()
            if cfg.backend == "nixl":
                raise
            log.warning("histate.storage: NIXL unavailable (%s); using the plain-file backend", exc)
    return "file", [FileSession(cfg.file_io_threads, preallocate=cfg.preallocate) for _ in range(count)]


class CheckpointStore:
    def __init__(self, config: StoreConfig, *, on_capacity_needed: CapacityCallback | None = None,
                 on_evict: EvictCallback | None = None, clock: Callable[[], float] = time.monotonic,
                 progress: bool = False):
        self.config = config
        self._clock = clock
        self._on_capacity_needed = on_capacity_needed
        self._on_evict = on_evict
        self.layout = Layout(config.roots)
        algo = DEFAULT_CHECKSUM if config.checksum == "auto" else CHECKSUM_NAMES[config.checksum]
        if algo == CHECKSUM_XXH3 and xxhash is None:
            raise ValueError("StoreConfig.checksum='xxh3' needs the xxhash package (pip install xxhash)")
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._reads: deque[_ReadOp] = deque()
        self._writes: deque[_WriteOp] = deque()
        self._pending_puts: dict[str, list[_WriteOp]] = {}
        self._latest_seq: dict[str, int] = {}  # key -> seq of its last publication, while puts of it are pending
        self._backlog_bytes = 0
        self._backlog_items = 0
        self._reserved_bytes = 0
        self._closing = False
        self._owner_errors_logged: set[str] = set()
        self.stats = StoreStats()
        self._crc_pool = None
        self._roots: list[OwnedRoot] = claim_roots(self.layout.roots)
        try:
            self._direct = DirectIoChoice(self._probe, len(self._roots), config.direct_io, clock,
                                          [r.path for r in self._roots])
            if config.direct_io is True and not all(self._direct.snapshot()):
                log.warning("histate.storage: O_DIRECT requested but not (yet) usable in %s; buffered I/O there",
                            [r.path for r, ok in zip(self._roots, self._direct.snapshot()) if not ok])
            self._index, report = rebuild(self.layout, self._roots, clock(), _tqdm_progress if progress else None)
            self._next_seq = report.max_seq + 1
            self.stats.rebuild_kept, self.stats.rebuild_discarded = report.kept, report.discarded
            self.stats.rebuild_foreign = report.foreign
            self.rebuild_report = report
            self.backend_name, sessions = _make_sessions(config, config.num_workers + 1)
        except BaseException:
            self._release_roots()
            raise
        if config.checksum_threads:
            self._crc_pool = ThreadPoolExecutor(config.checksum_threads, thread_name_prefix="histate-crc")
        self._pipe = PipelineConfig(config.chunk_bytes, config.piece_bytes, config.max_inflight, self._crc_pool,
                                    algo)
        self._inline_session, self._sessions = sessions[0], sessions[1:]
        self._inline_lock = threading.Lock()
        self._workers = [threading.Thread(target=self._worker, args=(s,), name=f"histate-store-{i}", daemon=True)
                         for i, s in enumerate(self._sessions)]
        for t in self._workers:
            t.start()

    def _probe(self, root: int) -> bool:
        """One O_DIRECT probe in `root` (raises OSError / IoFault when it cannot tell: DirectIoChoice)."""
        loc = Location(root, "00", "probe").temp(self._roots[root].root_id)
        dir_fd = self._roots[root].open_fanout(loc.fanout, create=True)
        try:
            return probe_direct_io(dir_fd, loc.name)
        finally:
            os.close(dir_fd)

    # --- public API ----------------------------------------------------------------------------
    def submit_put(self, items: Sequence[tuple[str, object]], pack: bool = False) -> IoBatch[PutResult]:
        """Queue writes of (key, array/tensor/buffer). Buffers are borrowed until the batch completes.
        `pack=True` stores the items in as few files as `pack_max_bytes` allows (one for a typical batch
        of KV pages); each item stays addressable, deletable and verified on its own."""
        batch, ops = self._put_ops(items, pack)
        for op in ops:
            self._admit_write(op, inline=False)
        return batch

    def put_many(self, items: Sequence[tuple[str, object]], pack: bool = False) -> list[PutResult]:
        """Synchronous submit_put: runs in the calling thread (no queue hand-off, ~2 thread wake-ups
        saved) when the inline session is free and no queued write could be overtaken, else queues."""
        batch, ops = self._put_ops(items, pack)
        inline = self._inline_lock.acquire(blocking=False)
        try:
            for op in ops:
                if self._admit_write(op, inline=inline):
                    self._execute(self._inline_session, op)
        finally:
            if inline:
                self._inline_lock.release()
        return batch.wait()

    def put(self, key: str, data: object) -> PutResult:
        """Synchronous put of one object (see put_many)."""
        return self.put_many([(key, data)])[0]

    def submit_get(self, keys: Sequence[str], out: Sequence[object] | None = None) -> IoBatch[GetResult]:
        """Queue reads. `out[i]`, when given, is a caller buffer of exactly the stored payload size.
        Keys stored in the same pack are read together (one pipelined transfer)."""
        batch, ops = self._get_ops(keys, out)
        with self._lock:
            self._check_open()
            self._reads.extend(ops)
            self._work.notify(len(ops))
        return batch

    def get_many(self, keys: Sequence[str], out: Sequence[object] | None = None) -> list[GetResult]:
        """Synchronous submit_get; runs in the calling thread when the inline session is free (reads
        have priority over queued writes anyway), else queues and waits."""
        if not self._inline_lock.acquire(blocking=False):
            return self.submit_get(keys, out).wait()
        try:
            batch, ops = self._get_ops(keys, out)
            for op in ops:
                self._execute(self._inline_session, op)
            return batch.wait()
        finally:
            self._inline_lock.release()

    def get(self, key: str, out: object = None) -> GetResult:
        """Synchronous get of one key (see get_many)."""
        return self.get_many([key], None if out is None else [out])[0]

    def _put_ops(self, items: Sequence[tuple[str, object]], pack: bool) -> tuple[IoBatch[PutResult], list]:
        prepared = []
        for slot, (key, data) in enumerate(items):  # bad input raises here, before any I/O
            key = validate_key(key)
            src, dtype_name, shape = source_view(data)
            prepared.append(_PutItem(key, src, ItemSpec(key, src.size, dtype_name, shape), slot))
        batch: IoBatch[PutResult] = IoBatch(len(prepared))
        groups = self._pack_groups(prepared) if pack else [[item] for item in prepared]
        return batch, [self._write_op(group, batch, pack=len(group) > 1) for group in groups]

    def _pack_groups(self, items: list[_PutItem]) -> list[list[_PutItem]]:
        """Consecutive items up to pack_max_bytes and MAX_ITEMS (what one header can list) per file; a
        key given twice starts a new file (so the later copy gets the later sequence number)."""
        groups: list[list[_PutItem]] = []
        size, keys = 0, set()
        for item in items:
            if (not groups or item.key in keys or size + item.src.size > self.config.pack_max_bytes
                    or len(groups[-1]) == MAX_ITEMS):
                groups.append([])
                size, keys = 0, set()
            groups[-1].append(item)
            size += item.src.size
            keys.add(item.key)
        return groups

    def _write_op(self, items: list[_PutItem], batch: IoBatch, pack: bool) -> _WriteOp:
        header_bytes = header_bytes_for([i.spec for i in items], self.config.chunk_bytes)
        return _WriteOp(items, batch, pack, header_bytes, header_bytes + sum(align_up(i.src.size) for i in items))

    def _get_ops(self, keys: Sequence[str], out: Sequence[object] | None) -> tuple[IoBatch[GetResult], list]:
        """One read op per pack the keys live in, one per other key. Destinations are checked loudly here
        (type, contiguity, writability: caller bugs) and kept as flat byte views; their size is compared
        with the stored object's only when it is read, and a difference is a miss (`size_mismatch`): a
        put of another size may have replaced the key since the caller sized the buffer."""
        keys = [validate_key(k) for k in keys]
        outs = list(out) if out is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} destinations for {len(keys)} keys")
        with self._lock:
            self._check_open()
            entries = self._index.get_many(keys)
        batch: IoBatch[GetResult] = IoBatch(len(keys))
        groups: dict[int, _ReadOp] = {}
        for slot, (key, dest, entry) in enumerate(zip(keys, outs, entries)):
            if dest is not None:
                dest = destination_bytes(dest)
            if entry is None:
                group = ~slot  # negative: never an id()
            else:
                group = id(entry.file) if entry.file.is_pack else ~slot
            op = groups.get(group)
            if op is None:
                op = groups[group] = _ReadOp([], [], [], batch)
            op.keys.append(key)
            op.slots.append(slot)
            op.outs.append(dest)
        return batch, list(groups.values())

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def delete(self, key: str) -> bool:
        """Remove `key` (and cancel its queued puts). True if anything was stored or pending and is now
        gone; False if nothing was, or if its file cannot be removed (then the key stays stored and
        served, and `delete_failures` counts it: a key never comes back at restart after True)."""
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[str]) -> list[bool]:
        """delete() for several keys; the keys of one pack cost one write (or one unlink) together."""
        keys = [validate_key(k) for k in keys]
        with self._lock:
            self._check_open()
            pending: set[str] = set()
            by_file: dict[int, list[Entry]] = {}
            for key in dict.fromkeys(keys):
                for op in self._pending_puts.get(key, []):
                    pending.add(key)
                    for item in op.items:
                        if item.key == key:
                            item.cancelled = True
                entry = self._index.get(key)
                if entry is not None:
                    by_file.setdefault(id(entry.file), []).append(entry)
            indexed = {e.key for entries in by_file.values() for e in entries}
            removed: list[Entry] = []
            for entries in by_file.values():
                if self._remove_entries(entries, strict=True):
                    removed += entries
                else:
                    self.stats.delete_failures += len(entries)
        for entry in removed:
            self._emit(entry, "delete")
        gone = {e.key for e in removed}
        return [key in gone or (key not in indexed and key in pending) for key in keys]

    def keys(self) -> list[str]:
        """Published keys, oldest first (what a restarted owner can rebuild its view from)."""
        with self._lock:
            return self._index.keys()

    def payload_bytes(self, key: str) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.item.payload_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes

    @property
    def direct_io(self) -> dict[str, bool]:
        return {r.path: ok for r, ok in zip(self._roots, self._direct.snapshot())}

    def stats_snapshot(self) -> dict:
        with self._lock:
            snap = self.stats.snapshot()
            snap.update(used_bytes=self._index.used_bytes, reserved_bytes=self._reserved_bytes,
                        num_objects=len(self._index), backlog_bytes=self._backlog_bytes,
                        backlog_items=self._backlog_items, backend=self.backend_name)
            return snap

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued or running put has finished."""
        with self._room:
            if not self._room.wait_for(lambda: self._backlog_items == 0, timeout_s):
                raise TimeoutError(f"{self._backlog_items} puts still pending after {timeout_s} s")

    def close(self, flush: bool = True) -> None:
        """Stop the workers (after draining queued puts when `flush`, else cancelling them). A closed
        store touches nothing on disk again: get/delete raise, puts come back `cancelled`."""
        if flush and not self._closing:
            self.flush()
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for op in self._writes:
                for item in op.items:
                    item.cancelled = True
            self._work.notify_all()
        for t in self._workers:
            t.join()
        with self._inline_lock:  # let a running inline call finish
            for s in [self._inline_session, *self._sessions]:
                s.shutdown()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)
        for root in self._roots:  # restore a marker someone deleted while we held the directory
            try:
                root.ensure_marker()
            except OSError as exc:
                log.warning("histate.storage: cannot restore the marker of %s: %s", root.path, exc)
        self._release_roots()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closing:
            raise RuntimeError("store is closed")

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
    def _admit_write(self, op: _WriteOp, inline: bool) -> bool:
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

    def _admit(self, op: _WriteOp) -> Fault | None:
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

    # --- workers -------------------------------------------------------------------------------
    def _worker(self, sess: IoSession) -> None:
        while True:
            with self._work:
                self._work.wait_for(lambda: self._reads or self._writes or self._closing)
                if self._reads:
                    op = self._reads.popleft()
                elif self._writes:
                    op = self._writes.popleft()
                else:
                    return
            self._execute(sess, op)

    def _execute(self, sess: IoSession, op: _WriteOp | _ReadOp) -> None:
        try:
            self._run_write(sess, op) if isinstance(op, _WriteOp) else self._run_read(sess, op)
        except Exception:  # a bug must not leave a batch waiting forever
            log.exception("histate.storage: unexpected error")
            if isinstance(op, _WriteOp):
                with self._lock:
                    if not op.finished:
                        self._finish_put_locked(op, {i.slot: Fault.IO_ERROR for i in op.items})
                for item in op.items:
                    if op.batch._results[item.slot] is None:
                        op.batch._complete(item.slot, PutResult(item.key, Fault.IO_ERROR))
            else:
                for key, slot in zip(op.keys, op.slots):
                    if op.batch._results[slot] is None:
                        op.batch._complete(slot, GetResult(key, Fault.IO_ERROR))

    def _direct_for(self, loc: Location) -> bool:
        return self._direct.use(loc.root)

    # --- reads ---------------------------------------------------------------------------------
    def _run_read(self, sess: IoSession, op: _ReadOp) -> None:
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

    def _read_group(self, sess: IoSession, op: _ReadOp, group: list[tuple[int, Entry]],
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

    def _finish_gets(self, op: _ReadOp, done: list[tuple[int, GetResult]]) -> None:
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

    # --- writes --------------------------------------------------------------------------------
    def _run_write(self, sess: IoSession, op: _WriteOp) -> None:
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

    def _publish(self, op: _WriteOp, dir_fd: int, tmp: Location, header) -> tuple[dict[int, Fault], bool]:
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

    def _may_replace(self, op: _WriteOp, dir_fd: int) -> bool:
        """(lock held) Whether `op`'s file may be renamed over what sits at its name: nothing, the key's
        own indexed copy (proved when it was indexed), or a file that proves the store wrote it here."""
        current = self._index.get(op.items[0].key)
        if current is not None and current.file.loc == op.loc:
            return True
        return is_replaceable(self._roots[op.loc.root], dir_fd, op.loc.name)

    def _prepare_publication(self, op: _WriteOp, header) -> None:
        """Index record, entries and results of `op` (no lock needed: nothing shared is touched). Runs
        beside the payload's I/O when the write is pipelined (write_items' on_sealed)."""
        file = StoredFile(op.loc, self.layout.path(op.loc), header)
        op.publication = _Publication(file, [new_entry(item.key, file, i) for i, item in enumerate(op.items)],
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

    def _finish_put(self, op: _WriteOp, faults: dict[int, Fault], header) -> None:
        with self._lock:
            self._finish_put_locked(op, faults)
        self._complete_puts(op, faults, header)

    def _finish_put_locked(self, op: _WriteOp, faults: dict[int, Fault]) -> None:
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

    def _complete_puts(self, op: _WriteOp, faults: dict[int, Fault], header) -> None:
        if not faults and op.publication is not None:
            op.batch._complete_many(op.publication.results)
        else:
            op.batch._complete_many(self._put_results(op, faults, header))

    def _put_results(self, op: _WriteOp, faults: dict[int, Fault], header) -> list[tuple[int, PutResult]]:
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

    def _release_roots(self) -> None:
        for root in self._roots:
            root.release()


def _tqdm_progress(it):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc="histate.storage: indexing", unit="file", leave=False)
