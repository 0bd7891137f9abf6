"""HiState's own client of a shared Mooncake Store: framed byte objects, placement hints, faults as misses.

Used by the reference worker (`histate serve --l3-master ...`). The SGLang plugin does not use it:
there, L3 is SGLang's own `MooncakeStore` object so that keys and bytes are exactly stock SGLang's
(see sglang_plugin/l3_tier.py).

Every object may vanish: the master evicts, a store service dies with its segment, a put can lose a
race with eviction. So nothing here raises on a store fault. A get of a missing, torn or corrupted
object returns None (counted), a failed put returns False, and the caller serves a miss. Objects are
framed (magic, length, BLAKE2b-128 of the payload) because a read that returns the wrong bytes must
also be a miss, never a wrong state.

A slow or dead store must not stall requests either. Measured on the loopback store (0.3.13.post1):
a get from a SIGSTOPped store service waits 30 s (the transfer engine's "no transfer progress within
30s"), and every get or put while the master is dead waits 4.3 s for its RPC to fail. So every store
call runs on one background thread and is waited for at most `op_timeout_s`; a call that times out,
or fails at the transfer/RPC level, marks the store *down* for `down_for_s`, during which calls are
not made (a miss, counted as `skipped_down`) -- nor while the timed-out call is still running, so
stuck calls never pile up. A request therefore waits at most about one `op_timeout_s` per
`down_for_s` for a sick store. A call that completes after its timeout is dropped: a late get's bytes
are never used, a late put leaves a whole object or none (Mooncake commits a put at PutEnd).
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional, Sequence

from histate.l3.services import LOOPBACK

logger = logging.getLogger(__name__)

_MAGIC = b"HSL3"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s")  # magic, version, reserved, payload size, digest
FRAME_HEADER_SIZE_BYTES = _HEADER.size
DEFAULT_LOCAL_BUFFER_BYTES = 64 * 2**20
NO_SPACE = -200
"""Mooncake's NO_AVAILABLE_HANDLE: the segment is full. The failed PutStart is what makes the master
evict (approximately LRU), so the same put succeeds a moment later; measured on loopback, a retry
after 10 ms succeeded 46 times out of 46 once a 16 MiB segment was full."""
PUT_RETRY_BACKOFF_S = (0.0, 0.01, 0.05)
"""Waits before the retries of a put refused for space. Only NO_SPACE is retried: TRANSFER_FAIL (-800,
a dead store service) fails the same way every time, and retrying it would only slow the request."""
TRANSFER_LEVEL_ERROR = -800
"""Mooncake's TRANSFER_FAIL; codes at or below it are transfer and RPC failures (RPC_FAIL -900): the
store, not the object, is at fault, so the client marks it down (OBJECT_NOT_FOUND is -704)."""
DEFAULT_OP_TIMEOUT_S = 1.0
"""Longest wait for one store call. Loopback calls take milliseconds (0.42 ms + size / 0.57 GB/s,
benchmark/l3_loopback.py); 1 s is far above a 64 MiB object's transfer and far below the 30 s and
4.3 s stalls above."""
DEFAULT_DOWN_FOR_S = 2.0
"""How long calls are skipped after a timeout or a transfer-level failure."""
FAILED_GET_SLOW_S = 0.2
"""A get that returns nothing after this long failed at the transfer level: the Python `get` returns
empty bytes for a missing object and for a failed transfer alike, but a missing object is answered
by the master in about a millisecond, while gets from a SIGKILLed store service took from 3 ms to
over 1 s each on loopback (the first ones until the transfer engine gives up on the peer)."""


def frame(payload: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, _VERSION, 0, len(payload), hashlib.blake2b(payload, digest_size=16).digest()) + payload


def unframe(blob: bytes) -> Optional[bytes]:
    """The payload, or None when `blob` is not one whole, intact object."""
    if len(blob) < _HEADER.size:
        return None
    magic, version, _, size_bytes, digest = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != _MAGIC or version != _VERSION or size_bytes != len(payload):
        return None
    if hashlib.blake2b(payload, digest_size=16).digest() != digest:
        return None
    return payload


@dataclass(frozen=True)
class PutHints:
    """Mooncake `ReplicateConfig` fields HiState sets (core/l3_policy.py decides them)."""

    replicas: int = 1
    soft_pin_ttl_s: Optional[float] = None
    group_id: Optional[str] = None


@dataclass
class L3Stats:
    puts: int = 0
    put_failures: int = 0
    put_retries: int = 0     # puts retried after the store was full (NO_SPACE): each made the master evict
    written_bytes: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0         # reads that failed the frame check (torn, truncated, garbage, foreign)
    corrupt_removed: int = 0
    read_bytes: int = 0
    timeouts: int = 0        # store calls abandoned after op_timeout_s
    down_events: int = 0     # times the store was marked down (a timeout or a transfer-level failure)
    skipped_down: int = 0    # calls not made because the store was down: each a miss or a failed put
    errors: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class StoreDown(Exception):
    """A store call was not made, or not waited for: the store is marked down (module doc)."""


def connect_store(master_address: str, local_hostname: str = LOOPBACK,
                  local_buffer_size_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES):
    """A raw `MooncakeDistributedStore` that contributes no segment, connected to `master_address`.
    Also what fault injectors use to write foreign bytes under HiState's keys (histate.cluster.faults)."""
    if local_hostname == LOOPBACK:
        # Without it the transfer engine advertises the NIC address and peers dial that.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(local_hostname, "P2PHANDSHAKE", 0, local_buffer_size_bytes, "tcp", "", master_address)
    if rc != 0:
        raise ConnectionError(f"Mooncake client setup against master {master_address} failed (code {rc})")
    return store


class L3Client:
    """One process's connection to the shared store. It contributes no memory segment: objects live in
    the store service's segment and outlive this process."""

    def __init__(self, master_address: str, key_prefix: str = "histate",
                 local_hostname: str = LOOPBACK, local_buffer_size_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
                 op_timeout_s: float = DEFAULT_OP_TIMEOUT_S, down_for_s: float = DEFAULT_DOWN_FOR_S) -> None:
        from mooncake.store import ReplicateConfig, SoftPinAction

        self._replicate_config = ReplicateConfig
        self._soft_pin_enable = SoftPinAction.ENABLE
        self.key_prefix = key_prefix
        self.op_timeout_s, self.down_for_s = op_timeout_s, down_for_s
        self.stats = L3Stats()
        self._store = connect_store(master_address, local_hostname, local_buffer_size_bytes)
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="histate-l3")
        self._pending: Optional[Future] = None
        self._down_until_s = 0.0

    def key(self, name: str) -> str:
        return f"{self.key_prefix}/{name}"

    # --- bounded store calls --------------------------------------------------------------------

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until_s or (self._pending is not None and not self._pending.done())

    def _mark_down(self, why: str) -> None:
        if time.monotonic() >= self._down_until_s:
            self.stats.down_events += 1
            logger.warning("HiState L3: %s; store calls skipped for %.1f s", why, self.down_for_s)
        self._down_until_s = time.monotonic() + self.down_for_s

    def _call(self, method: str, *args):
        """`self._store.<method>(*args)`, waited for at most op_timeout_s; StoreDown when it was not
        made (store down) or timed out (the store is then marked down)."""
        if self.down:
            self.stats.skipped_down += 1
            raise StoreDown(method)
        future = self._calls.submit(getattr(self._store, method), *args)
        try:
            return future.result(timeout=self.op_timeout_s)
        except FutureTimeout:
            self._pending = future
            self.stats.timeouts += 1
            self._mark_down(f"{method} took over {self.op_timeout_s:g} s")
            raise StoreDown(method) from None

    def _config(self, hints: PutHints):
        config = self._replicate_config()
        config.replica_num = hints.replicas
        if hints.soft_pin_ttl_s is not None:
            config.soft_pin_action = self._soft_pin_enable
            config.soft_pin_ttl_ms = int(hints.soft_pin_ttl_s * 1000)
        if hints.group_id is not None:
            config.group_ids = [hints.group_id]
        return config

    def _error(self, what: str, detail) -> None:
        self.stats.errors[what] = self.stats.errors.get(what, 0) + 1
        logger.debug("L3 %s failed: %s", what, detail)

    def put(self, name: str, payload: bytes, hints: PutHints = PutHints()) -> bool:
        """Write one object; True when the store accepted it (or already held it)."""
        blob = frame(payload)
        config = self._config(hints)
        for backoff_s in (None, *PUT_RETRY_BACKOFF_S):
            if backoff_s is not None:
                time.sleep(backoff_s)
                self.stats.put_retries += 1
            try:
                rc = self._call("put", self.key(name), blob, config)
            except StoreDown as exc:
                rc = exc
            except Exception as exc:  # a dead store service or master: the object is just not there
                rc = exc
            if rc != NO_SPACE:
                break
        if isinstance(rc, int) and rc <= TRANSFER_LEVEL_ERROR:
            self._mark_down(f"put failed with {rc}")
        if rc != 0:
            self.stats.put_failures += 1
            self._error("put", rc)
            return False
        self.stats.puts += 1
        self.stats.written_bytes += len(blob)
        return True

    def get(self, name: str) -> Optional[bytes]:
        """The payload, or None on any miss or fault."""
        self.stats.gets += 1
        started_s = time.monotonic()
        try:
            blob = self._call("get", self.key(name))
        except Exception as exc:
            self._error("get", exc)
            blob = b""
        if not blob:
            self.stats.misses += 1
            if time.monotonic() - started_s > FAILED_GET_SLOW_S and not self.down:
                self._mark_down(f"a get failed after {time.monotonic() - started_s:.2f} s")
            return None
        payload = unframe(bytes(blob))
        if payload is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            self._drop_corrupt(name)
            return None
        self.stats.hits += 1
        self.stats.read_bytes += len(blob)
        return payload

    def _drop_corrupt(self, name: str) -> None:
        """Remove an object that failed its frame check, so that the next writer of this key puts a
        whole one (a put of a key the master lists is a no-op). Forced: our own get just took a lease
        on it. Safe under races: Mooncake objects are immutable once put, so these bytes never heal."""
        try:
            if self._call("remove", self.key(name), True) == 0:
                self.stats.corrupt_removed += 1
        except Exception as exc:
            self._error("remove", exc)

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Which objects the master lists. A listed object can still fail to read (its segment just
        died): `get` is the authority, this only saves round trips."""
        if not names:
            return []
        try:
            found = self._call("batch_is_exist", [self.key(n) for n in names])
        except Exception as exc:
            self._error("exists", exc)
            return [False] * len(names)
        if any(flag < 0 for flag in found):  # -1: the master could not be asked
            self._mark_down("the master did not answer a presence query")
        return [flag == 1 for flag in found]

    def remove(self, name: str) -> bool:
        try:
            return self._call("remove", self.key(name)) == 0
        except Exception as exc:
            self._error("remove", exc)
            return False

    def close(self) -> None:
        if self.down and self._pending is not None:  # a call is stuck: do not wait for it
            self._calls.shutdown(wait=False)
            return
        self._calls.shutdown(wait=True)
        try:
            self._store.close()
        except Exception as exc:  # pragma: no cover - closing a dead connection
            self._error("close", exc)
