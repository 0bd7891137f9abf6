"""HiState's own client of a shared Mooncake Store: framed byte objects, placement hints, faults as misses.

Used by the reference worker (`histate serve --l3-master ...`). The SGLang plugin does not use it:
there, L3 is SGLang's own `MooncakeStore` object so that keys and bytes are exactly stock SGLang's
(see sglang_plugin/l3_tier.py).

Every object may vanish: the master evicts, a store service dies with its segment, a put can lose a
race with eviction. So nothing here raises on a store fault. A get of a missing, torn or corrupted
object returns None (counted), a failed put returns False, and the caller serves a miss. Objects are
framed (magic, length, BLAKE2b-128 of the payload) because a read that returns the wrong bytes must
also be a miss, never a wrong state.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from histate.l3.services import LOOPBACK

logger = logging.getLogger(__name__)

_MAGIC = b"HSL3"
_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16s")  # magic, version, reserved, payload size, digest
DEFAULT_LOCAL_BUFFER_BYTES = 64 * 2**20
NO_SPACE = -200
"""Mooncake's NO_AVAILABLE_HANDLE: the segment is full. The failed PutStart is what makes the master
evict (approximately LRU), so the same put succeeds a moment later; measured on loopback, a retry
after 10 ms succeeded 46 times out of 46 once a 16 MiB segment was full."""
PUT_RETRY_BACKOFF_S = (0.0, 0.01, 0.05)
"""Waits before the retries of a put refused for space. Only NO_SPACE is retried: TRANSFER_FAIL (-800,
a dead store service) fails the same way every time, and retrying it would only slow the request."""


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
    corrupt: int = 0
    read_bytes: int = 0
    errors: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


class L3Client:
    """One process's connection to the shared store. It contributes no memory segment: objects live in
    the store service's segment and outlive this process."""

    def __init__(self, master_address: str, key_prefix: str = "histate",
                 local_hostname: str = LOOPBACK, local_buffer_size_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES) -> None:
        if local_hostname == LOOPBACK:
            # Without it the transfer engine advertises the NIC address and peers dial that.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

        self._replicate_config = ReplicateConfig
        self._soft_pin_enable = SoftPinAction.ENABLE
        self.key_prefix = key_prefix
        self.stats = L3Stats()
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, "P2PHANDSHAKE", 0, local_buffer_size_bytes, "tcp", "", master_address)
        if rc != 0:
            raise ConnectionError(f"Mooncake client setup against master {master_address} failed (code {rc})")

    def key(self, name: str) -> str:
        return f"{self.key_prefix}/{name}"

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
                rc = self._store.put(self.key(name), blob, config)
            except Exception as exc:  # a dead store service or master: the object is just not there
                rc = exc
            if rc != NO_SPACE:
                break
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
        try:
            blob = self._store.get(self.key(name))
        except Exception as exc:
            self._error("get", exc)
            blob = b""
        if not blob:
            self.stats.misses += 1
            return None
        payload = unframe(bytes(blob))
        if payload is None:
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.stats.read_bytes += len(blob)
        return payload

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Which objects the master lists. A listed object can still fail to read (its segment just
        died): `get` is the authority, this only saves round trips."""
        if not names:
            return []
        try:
            found = self._store.batch_is_exist([self.key(n) for n in names])
        except Exception as exc:
            self._error("exists", exc)
            return [False] * len(names)
        return [flag == 1 for flag in found]

    def remove(self, name: str) -> bool:
        try:
            return self._store.remove(self.key(name)) == 0
        except Exception as exc:
            self._error("remove", exc)
            return False

    def close(self) -> None:
        try:
            self._store.close()
        except Exception as exc:  # pragma: no cover - closing a dead connection
            self._error("close", exc)
