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

Layout: this module holds the API, the queues and the workers; the budget (budget.py), the read path
(read_path.py) and the write path (write_path.py) are mixins of `CheckpointStore`, one job each, and
ops.py holds the records of queued work.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

from histate.storage.batch import IoBatch
from histate.storage.budget import BudgetMixin
from histate.storage.buffers import destination_bytes, source_view
from histate.storage.config import StoreConfig
from histate.storage.file_backend import FileSession
from histate.storage.format import (CHECKSUM_NAMES, CHECKSUM_XXH3, DEFAULT_CHECKSUM, MAX_ITEMS, ItemSpec, align_up,
                                    header_bytes_for, xxhash)
from histate.storage.index import Entry, rebuild
from histate.storage.io_base import DirectIoChoice, IoSession, probe_direct_io
from histate.storage.layout import Layout, Location, validate_key
from histate.storage.nixl_backend import NixlSession, NixlUnavailable
from histate.storage.ownership import OwnedRoot, claim_roots
from histate.storage.results import EvictionEvent, Fault, GetResult, PutResult, StoreStats
from histate.storage.ops import PutItem, ReadOp, WriteOp
from histate.storage.read_path import ReadPathMixin
from histate.storage.transfer import PipelineConfig
from histate.storage.write_path import WritePathMixin

log = logging.getLogger(__name__)

CapacityCallback = Callable[[int], Iterable[str]]
EvictCallback = Callable[[EvictionEvent], None]


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


class CheckpointStore(BudgetMixin, ReadPathMixin, WritePathMixin):
    """The store's public API, its queues and workers; the byte budget (budget.py), the read path
    (read_path.py) and the write path (write_path.py) are its other jobs, one module each."""

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
        self._reads: deque[ReadOp] = deque()
        self._writes: deque[WriteOp] = deque()
        self._pending_puts: dict[str, list[WriteOp]] = {}
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
            prepared.append(PutItem(key, src, ItemSpec(key, src.size, dtype_name, shape), slot))
        batch: IoBatch[PutResult] = IoBatch(len(prepared))
        groups = self._pack_groups(prepared) if pack else [[item] for item in prepared]
        return batch, [self._write_op(group, batch, pack=len(group) > 1) for group in groups]

    def _pack_groups(self, items: list[PutItem]) -> list[list[PutItem]]:
        """Consecutive items up to pack_max_bytes and MAX_ITEMS (what one header can list) per file; a
        key given twice starts a new file (so the later copy gets the later sequence number)."""
        groups: list[list[PutItem]] = []
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

    def _write_op(self, items: list[PutItem], batch: IoBatch, pack: bool) -> WriteOp:
        header_bytes = header_bytes_for([i.spec for i in items], self.config.chunk_bytes)
        return WriteOp(items, batch, pack, header_bytes, header_bytes + sum(align_up(i.src.size) for i in items))

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
        groups: dict[int, ReadOp] = {}
        for slot, (key, dest, entry) in enumerate(zip(keys, outs, entries)):
            if dest is not None:
                dest = destination_bytes(dest)
            if entry is None:
                group = ~slot  # negative: never an id()
            else:
                group = id(entry.file) if entry.file.is_pack else ~slot
            op = groups.get(group)
            if op is None:
                op = groups[group] = ReadOp([], [], [], batch)
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

    def _execute(self, sess: IoSession, op: WriteOp | ReadOp) -> None:
        try:
            self._run_write(sess, op) if isinstance(op, WriteOp) else self._run_read(sess, op)
        except Exception:  # a bug must not leave a batch waiting forever
            log.exception("histate.storage: unexpected error")
            if isinstance(op, WriteOp):
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

    def _release_roots(self) -> None:
        for root in self._roots:
            root.release()


def _tqdm_progress(it):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc="histate.storage: indexing", unit="file", leave=False)
