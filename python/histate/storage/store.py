"""CheckpointStore: the SSD store for recurrent checkpoints and cold KV pages.

Owns the byte budget, the index, the I/O queues and the workers. Callers submit batches of gets and
puts and poll or wait on the returned IoBatch. Reads always run before queued writes; the write backlog
is bounded in items and bytes (drop or delay, counted). Every fault becomes a miss (get) or a failed
put with a reason and a counter; the faulty file is removed and the store keeps serving. The store never
decides *what* to evict beyond its contract: when a put needs room it asks the owner's
`on_capacity_needed(bytes_needed) -> keys`, or takes the oldest objects when no callback is given, and it
reports every removal as an EvictionEvent(key, size_bytes, residence_s, reason) to `on_evict`.

Threading: the public methods are thread-safe. `on_capacity_needed` runs in the submitting thread with
no store lock held (it may call `exists`/`delete`). `on_evict` runs without the lock too, in the thread
that removed the object: the caller's for capacity and delete, an I/O worker's for faults.
"""
from __future__ import annotations

import fcntl
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
from histate.storage.buffers import aligned_empty, destination_view, source_view
from histate.storage.config import StoreConfig
from histate.storage.file_backend import FileSession
from histate.storage.format import CHECKSUM_NAMES, CHECKSUM_XXH3, DEFAULT_CHECKSUM, file_bytes_for, xxhash
from histate.storage.index import Entry, Index, new_entry, rebuild
from histate.storage.io_base import IoSession, probe_direct_io
from histate.storage.layout import LOCK_NAME, Layout, validate_key
from histate.storage.nixl_backend import NixlSession, NixlUnavailable
from histate.storage.results import (EvictionEvent, Fault, GetResult, IoFault, PutResult, StoreStats,
                                     fault_from_oserror)
from histate.storage.transfer import PipelineConfig, read_object, write_object

log = logging.getLogger(__name__)

_READ_ATTEMPTS = 3  # a get that loses the race with a replacing put retries on the new file
CapacityCallback = Callable[[int], Iterable[str]]
EvictCallback = Callable[[EvictionEvent], None]


@dataclass
class _Op:
    is_write: bool
    key: str
    batch: IoBatch
    slot: int
    out: object = None  # read destination (caller buffer) or None
    src: np.ndarray | None = None  # write payload, flat uint8 (borrowed from the caller until completion)
    dtype_name: str = ""
    shape: tuple[int, ...] = ()
    reserved_bytes: int = 0
    cancelled: bool = False


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
        self.layout = Layout(config.dirs)
        algo = DEFAULT_CHECKSUM if config.checksum == "auto" else CHECKSUM_NAMES[config.checksum]
        if algo == CHECKSUM_XXH3 and xxhash is None:
            raise ValueError("StoreConfig.checksum='xxh3' needs the xxhash package (pip install xxhash)")
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._reads: deque[_Op] = deque()
        self._writes: deque[_Op] = deque()
        self._pending_puts: dict[str, list[_Op]] = {}
        self._backlog_bytes = 0
        self._backlog_items = 0
        self._reserved_bytes = 0
        self._closing = False
        self.stats = StoreStats()
        self._lock_fds: list[int] = []
        self._crc_pool = None
        try:
            for root in self.layout.roots:
                self._lock_fds.append(self._lock_root(root))
            self._direct = {root: (config.direct_io is not False) and probe_direct_io(root)
                            for root in self.layout.roots}
            if config.direct_io is True and not all(self._direct.values()):
                log.warning("histate.storage: O_DIRECT requested but refused by %s; buffered I/O there",
                            [r for r, ok in self._direct.items() if not ok])
            self._index, report = rebuild(self.layout, clock(), _tqdm_progress if progress else None)
            self.stats.rebuild_kept, self.stats.rebuild_discarded = report.kept, report.discarded
            self.rebuild_report = report
            self.backend_name, sessions = _make_sessions(config, config.num_workers + 1)
        except BaseException:
            self._release_locks()
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

    # --- public API ----------------------------------------------------------------------------
    def submit_put(self, items: Sequence[tuple[str, object]]) -> IoBatch[PutResult]:
        """Queue writes of (key, array/tensor/buffer). Buffers are borrowed until the batch completes."""
        prepared = [self._prepare_put(key, data) for key, data in items]  # bad input raises before any I/O
        batch: IoBatch[PutResult] = IoBatch(len(prepared))
        for slot, (op_args, file_bytes) in enumerate(prepared):
            op = _Op(True, batch=batch, slot=slot, **op_args)
            self._admit_write(op, file_bytes, inline=False)
        return batch

    def _prepare_put(self, key: str, data: object) -> tuple[dict, int]:
        key = validate_key(key)
        src, dtype_name, shape = source_view(data)
        file_bytes = file_bytes_for(key, dtype_name, len(shape), src.size, self.config.chunk_bytes)
        return dict(key=key, src=src, dtype_name=dtype_name, shape=shape), file_bytes

    def submit_get(self, keys: Sequence[str], out: Sequence[object] | None = None) -> IoBatch[GetResult]:
        """Queue reads. `out[i]`, when given, is a caller buffer of exactly the stored payload size."""
        keys = [validate_key(k) for k in keys]
        outs = list(out) if out is not None else [None] * len(keys)
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} destinations for {len(keys)} keys")
        with self._lock:
            for key, dest in zip(keys, outs):
                entry = self._index.get(key)
                if dest is not None and entry is not None:
                    destination_view(dest, entry.header.payload_bytes)  # bad buffers fail here, loudly
        batch: IoBatch[GetResult] = IoBatch(len(keys))
        with self._lock:
            if self._closing:
                raise RuntimeError("store is closed")
            for slot, (key, dest) in enumerate(zip(keys, outs)):
                self._reads.append(_Op(False, key, batch, slot, out=dest))
            self._work.notify(len(keys))
        return batch

    def put(self, key: str, data: object) -> PutResult:
        """Synchronous put. Runs in the calling thread (no queue hand-off) when the inline session is
        free and no queued write could be overtaken; otherwise queues like submit_put and waits."""
        op_args, file_bytes = self._prepare_put(key, data)
        batch: IoBatch[PutResult] = IoBatch(1)
        op = _Op(True, batch=batch, slot=0, **op_args)
        if self._inline_lock.acquire(blocking=False):
            try:
                if self._admit_write(op, file_bytes, inline=True):
                    self._execute(self._inline_session, op)
            finally:
                self._inline_lock.release()
        else:
            self._admit_write(op, file_bytes, inline=False)
        return batch.wait()[0]

    def get(self, key: str, out: object = None) -> GetResult:
        """Synchronous get; runs in the calling thread when the inline session is free (reads have
        priority over queued writes anyway), else queues and waits."""
        if not self._inline_lock.acquire(blocking=False):
            return self.submit_get([key], None if out is None else [out]).wait()[0]
        try:
            if self._closing:
                raise RuntimeError("store is closed")
            key = validate_key(key)
            if out is not None:
                with self._lock:
                    entry = self._index.get(key)
                if entry is not None:
                    destination_view(out, entry.header.payload_bytes)  # bad buffers fail here, loudly
            batch: IoBatch[GetResult] = IoBatch(1)
            self._execute(self._inline_session, _Op(False, key, batch, 0, out=out))
            return batch.wait()[0]
        finally:
            self._inline_lock.release()

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def delete(self, key: str) -> bool:
        """Remove `key` (and cancel its queued puts). True if anything was stored or pending."""
        key = validate_key(key)
        with self._lock:
            pending = self._pending_puts.get(key, [])
            for op in pending:
                op.cancelled = True
            entry = self._unpublish(key, None)
        if entry is not None:
            self._emit(entry, "delete")
        return entry is not None or bool(pending)

    def keys(self) -> list[str]:
        """Published keys, oldest first (what a restarted owner can rebuild its view from)."""
        with self._lock:
            return self._index.keys()

    def payload_bytes(self, key: str) -> int | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None else entry.header.payload_bytes

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._index.used_bytes

    @property
    def direct_io(self) -> dict[str, bool]:
        return dict(self._direct)

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
        """Stop the workers (after draining queued puts when `flush`, else cancelling them)."""
        if flush and not self._closing:
            self.flush()
        with self._lock:
            if self._closing:
                return
            self._closing = True
            for op in self._writes:
                op.cancelled = True
            self._work.notify_all()
        for t in self._workers:
            t.join()
        with self._inline_lock:  # let a running inline call finish
            for s in [self._inline_session, *self._sessions]:
                s.shutdown()
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)
        self._release_locks()

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- admission: backlog bound and byte budget ------------------------------------------------
    def _admit_write(self, op: _Op, file_bytes: int, inline: bool) -> bool:
        """Backlog bound + byte budget. Queues the op (or, `inline`, leaves it to the caller to run)
        and returns True; on refusal completes the op with its fault and returns False. An inline
        put falls back to the queue when queued writes exist or the key has a put pending."""
        fault = self._admit(op, file_bytes)
        if fault is not None:
            with self._lock:
                self.stats.puts += 1
                self.stats.count(self.stats.put_failures, fault)
            op.batch._complete(op.slot, PutResult(op.key, fault))
            return False
        with self._lock:
            inline = inline and not self._writes and op.key not in self._pending_puts
            self._pending_puts.setdefault(op.key, []).append(op)
            if not inline:
                self._writes.append(op)
                self._work.notify()
        return inline

    def _admit(self, op: _Op, file_bytes: int) -> Fault | None:
        payload = op.src.size
        cfg = self.config
        with self._lock:
            if self._closing:
                return Fault.CANCELLED

            def room() -> bool:  # an oversized put is admitted alone rather than never
                return self._backlog_items == 0 or (
                    self._backlog_items < cfg.max_write_backlog_items
                    and self._backlog_bytes + payload <= cfg.max_write_backlog_bytes)

            if not room():
                if cfg.backlog_policy == "drop":
                    return Fault.BACKLOG_FULL
                self.stats.writes_delayed += 1
                self._room.wait_for(lambda: room() or self._closing)
                if self._closing:
                    return Fault.CANCELLED
            self._backlog_items += 1
            self._backlog_bytes += payload
        if not self._reserve(file_bytes):
            with self._lock:
                self._backlog_items -= 1
                self._backlog_bytes -= payload
                self._room.notify_all()
            return Fault.NO_CAPACITY
        op.reserved_bytes = file_bytes
        return None

    def _reserve(self, file_bytes: int) -> bool:
        capacity = self.config.capacity_bytes
        if file_bytes > capacity:
            return False
        with self._lock:
            need = self._index.used_bytes + self._reserved_bytes + file_bytes - capacity
            if need <= 0:
                self._reserved_bytes += file_bytes
                return True
            victims = None if self._on_capacity_needed else self._oldest_covering(need)
        if victims is None:
            victims = list(self._on_capacity_needed(need))
        for key in victims:
            with self._lock:
                entry = self._unpublish(key, None)
            if entry is not None:
                self._emit(entry, "capacity")
        with self._lock:
            if self._index.used_bytes + self._reserved_bytes + file_bytes <= capacity:
                self._reserved_bytes += file_bytes
                return True
        return False

    def _oldest_covering(self, need: int) -> list[str]:
        victims, freed = [], 0
        for entry in self._index.oldest_first():
            if freed >= need:
                break
            victims.append(entry.key)
            freed += entry.file_bytes
        return victims

    # --- removal -------------------------------------------------------------------------------
    def _unpublish(self, key: str, generation: int | None) -> Entry | None:
        """Drop from the index and unlink the file (lock held: renames happen under it too)."""
        entry = self._index.remove(key, generation)
        if entry is not None:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("histate.storage: cannot remove %s: %s", entry.path, exc)
            self.stats.evictions += 1
        return entry

    def _emit(self, entry: Entry, reason: str) -> None:
        if self._on_evict is not None:
            self._on_evict(EvictionEvent(entry.key, entry.file_bytes, self._clock() - entry.published_s, reason))

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

    def _execute(self, sess: IoSession, op: _Op) -> None:
        try:
            self._run_write(sess, op) if op.is_write else self._run_read(sess, op)
        except Exception:  # a bug must not leave a batch waiting forever
            log.exception("histate.storage: unexpected error on %r", op.key)
            if op.batch._results[op.slot] is None:
                if op.is_write:
                    self._finish_put(op, Fault.IO_ERROR)
                else:
                    op.batch._complete(op.slot, GetResult(op.key, Fault.IO_ERROR))

    def _direct_for(self, path: str) -> bool:
        return next(ok for root, ok in self._direct.items() if path.startswith(root + os.sep))

    def _run_read(self, sess: IoSession, op: _Op) -> None:
        with self._lock:
            entry = self._index.get(op.key)
            self.stats.gets += 1
        for _attempt in range(_READ_ATTEMPTS):
            if entry is None:
                self._finish_get(op, GetResult(op.key, Fault.NOT_FOUND), 0)
                return
            header = entry.header
            if op.out is not None:
                try:
                    flat = destination_view(op.out, header.payload_bytes)
                except ValueError:  # replaced by an object of another size since submit
                    self._finish_get(op, GetResult(op.key, Fault.NOT_FOUND), 0)
                    return
            else:
                flat = aligned_empty(header.payload_bytes)
            try:
                read_object(sess, entry.path, header, flat, self._direct_for(entry.path), self._pipe)
            except IoFault as fault:
                with self._lock:
                    current = self._index.get(op.key)
                if current is not None and current.generation != entry.generation:
                    entry = current  # a put replaced the file under us: read the new one, not a fault
                    continue
                if current is not None:
                    self._read_fault(entry, fault)
                self._finish_get(op, GetResult(op.key, fault.fault if current is not None else Fault.NOT_FOUND), 0)
                return
            self._finish_get(op, GetResult(op.key, None, flat, header.dtype_name, header.shape),
                             header.payload_bytes)
            return
        self._finish_get(op, GetResult(op.key, Fault.NOT_FOUND), 0)  # replaced on every attempt

    def _read_fault(self, entry: Entry, fault: IoFault) -> None:
        log.info("histate.storage: miss on %r: %s", entry.key, fault)
        with self._lock:
            removed = self._unpublish(entry.key, entry.generation)
            if removed is not None and fault.fault is not Fault.MISSING_FILE:
                self.stats.files_removed_on_fault += 1
        if removed is not None:
            self._emit(removed, "fault")

    def _finish_get(self, op: _Op, result: GetResult, num_bytes: int) -> None:
        with self._lock:
            if result.hit:
                self.stats.hits += 1
                self.stats.bytes_read += num_bytes
            else:
                self.stats.count(self.stats.misses, result.fault)
        op.batch._complete(op.slot, result)

    def _run_write(self, sess: IoSession, op: _Op) -> None:
        if op.cancelled:
            self._finish_put(op, Fault.CANCELLED)
            return
        final = self.layout.final_path(op.key)
        tmp = self.layout.temp_path(op.key)
        try:
            self.layout.ensure_dir(tmp)
            header = write_object(sess, tmp, op.src, op.key, op.dtype_name, op.shape,
                                  self._direct_for(tmp), self._pipe)
        except IoFault as fault:
            log.info("histate.storage: put %r failed: %s", op.key, fault)
            self._finish_put(op, fault.fault)
            return
        except OSError as exc:
            self._finish_put(op, fault_from_oserror(exc, f"mkdir for {tmp}").fault)
            return
        with self._lock:
            if op.cancelled:
                fault = Fault.CANCELLED
                _unlink_quietly(tmp)
            else:
                try:
                    os.rename(tmp, final)  # atomic publish: readers see the old file or the new one
                    fault = None
                except OSError as exc:
                    fault = fault_from_oserror(exc, f"rename {tmp}").fault
                    _unlink_quietly(tmp)
                if fault is None:
                    replaced = self._index.publish(new_entry(op.key, final, header, self._clock()))
                    if replaced is not None and replaced.path != final:
                        _unlink_quietly(replaced.path)
            self._finish_put_locked(op, fault, header.file_bytes)
        op.batch._complete(op.slot, PutResult(op.key, fault, header.file_bytes if fault is None else 0))

    def _finish_put(self, op: _Op, fault: Fault) -> None:
        with self._lock:
            self._finish_put_locked(op, fault, 0)
        op.batch._complete(op.slot, PutResult(op.key, fault))

    def _finish_put_locked(self, op: _Op, fault: Fault | None, file_bytes: int) -> None:
        self._reserved_bytes -= op.reserved_bytes
        self._backlog_items -= 1
        self._backlog_bytes -= op.src.size
        pending = self._pending_puts.get(op.key)
        if pending is not None:
            pending.remove(op)
            if not pending:
                del self._pending_puts[op.key]
        self.stats.puts += 1
        if fault is None:
            self.stats.puts_stored += 1
            self.stats.bytes_written += op.src.size
        else:
            self.stats.count(self.stats.put_failures, fault)
        self._room.notify_all()

    # --- directory ownership -----------------------------------------------------------------
    @staticmethod
    def _lock_root(root: str) -> int:
        os.makedirs(root, exist_ok=True)
        fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{root} is in use by another CheckpointStore (lock {LOCK_NAME} held)") from None
        return fd

    def _release_locks(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)
        self._lock_fds = []


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _tqdm_progress(it):
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc="histate.storage: indexing", unit="file", leave=False)
