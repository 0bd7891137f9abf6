"""The reference worker's shared L3 tier: Mooncake objects beside the core, below SSD.

The pure core knows three tiers (GPU/CPU/SSD). L3 is not one of them: no server places or evicts in
it (the master does), so it sits *beside* the core. A request still goes through the core as usual;
this module only

  * reads: beyond the local resume point c, the longest L3 prefix p that is whole (KV pages [c, p)
    and the state at p, core/l3_policy.py `restorable_pages`), re-checked on what `get` really
    returned, because a listed object can still be gone, torn or foreign;
  * writes: after a request, the terminal bundle the server now holds (`plan_l3_writes`), as framed
    objects (l3/client.py) with the placement hints the policy picks.

Objects are named by the reference's prefix-chained page keys (page_keys.py), so any worker with the
same model reads what another wrote. Payloads carry a format tag (dtype, shape, checkpoint layout):
a worker with other numerics reads them as misses, never as wrong tensors.

Every fault is a shorter hit or a miss: the client never raises, and a payload that does not decode
is treated like a missing object.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from histate_kernels import CheckpointLayout

from histate.core import L3Deletes, L3Ledger, L3Put, L3WriteConfig, plan_l3_writes, restorable_pages
from histate.l3.client import L3Client, PutHints
from histate.reference.hybrid_cache import Checkpoint
from histate.reference.model import StateGeometry
from histate.reference.page_keys import PageKey, key_name
from histate.reference.tier_stores import checkpoint_from_packed

_TAG_LENGTH = struct.Struct("<H")


def kv_object_name(key: PageKey) -> str:
    return f"kv-{key_name(key)}"


def state_object_name(key: PageKey) -> str:
    """The state after the page `key` ends (the resume point of the prefix `key` names)."""
    return f"state-{key_name(key)}"


class L3Codec:
    """Tensors <-> L3 payloads: a format tag, then the tensor's raw bytes (deterministic: equal
    tensors give equal payloads). The tag pins dtype, shape and the checkpoint layout, so a payload
    of another format decodes to None."""

    def __init__(self, geometry: StateGeometry, layout: CheckpointLayout):
        self.geometry = geometry
        self.layout = layout
        self.kv_tag = f"kv|{geometry.kv_dtype}|{tuple(geometry.kv_page_shape)}".encode()
        regions = ";".join(f"{r.name}:{r.dtype}:{r.num_layers}x{r.row_shape}@{r.offset_bytes}" for r in layout.regions)
        self.state_tag = f"state|{regions}|{layout.size_bytes}".encode()

    def encode_kv_page(self, page: torch.Tensor) -> bytes:
        return _encode(self.kv_tag, page.detach().to("cpu", self.geometry.kv_dtype).contiguous())

    def decode_kv_page(self, payload: Optional[bytes]) -> Optional[torch.Tensor]:
        raw = _decode(self.kv_tag, payload, self.geometry.kv_page_size_bytes)
        return None if raw is None else raw.view(self.geometry.kv_dtype).reshape(self.geometry.kv_page_shape)

    def encode_state(self, packed: torch.Tensor) -> bytes:
        self.layout.check_buffer(packed)
        return _encode(self.state_tag, packed.detach().to("cpu"))

    def decode_state(self, payload: Optional[bytes], position: int) -> Optional[Checkpoint]:
        raw = _decode(self.state_tag, payload, self.layout.size_bytes)
        return None if raw is None else checkpoint_from_packed(raw, self.layout, position)


def _encode(tag: bytes, tensor: torch.Tensor) -> bytes:
    return _TAG_LENGTH.pack(len(tag)) + tag + tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _decode(tag: bytes, payload: Optional[bytes], size_bytes: int) -> Optional[torch.Tensor]:
    """The raw bytes as a flat uint8 tensor, or None when `payload` is absent or of another format."""
    head = _TAG_LENGTH.size + len(tag)
    if payload is None or len(payload) != head + size_bytes or payload[_TAG_LENGTH.size:head] != tag \
            or _TAG_LENGTH.unpack_from(payload)[0] != len(tag):
        return None
    return torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8)


@dataclass(frozen=True)
class L3Hit:
    """A whole L3 prefix beyond the local resume point: KV pages [first_page, end_page) and the
    state at end_page."""

    first_page: int
    end_page: int
    kv_pages: list
    checkpoint: Checkpoint

    @property
    def num_pages(self) -> int:
        return self.end_page - self.first_page


@dataclass
class L3TierStats:
    """Per-worker L3 counters (the client's own byte and fault counts are in `L3Client.stats`)."""

    lookups: int = 0
    hits: int = 0
    hit_pages: int = 0
    listed_pages: int = 0          # pages a lookup found restorable by listing, before reading
    shortened_hits: int = 0        # lookups whose reads came back shorter than the listing
    paths_written: int = 0
    states_skipped: int = 0        # the terminal state could not be read locally (lost SSD object): its KV only
    objects_put: int = 0
    object_put_failures: int = 0
    objects_deleted: int = 0       # removed by this worker's eq. 7 ledger (core/l3_ledger.py)
    object_delete_failures: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class L3Tier:
    """One worker's view of the shared store: what it read and wrote, and the hints it writes with.

    `known_kv` / `known_state`: page keys whose objects this worker put, or read back whole in a hit
    (so a turn resumed from another worker's bundle re-puts only its own new pages). They only save
    puts (plan_l3_writes' `already_written`), and are forgotten as soon as the store no longer lists
    them.
    """

    client: L3Client
    write_config: L3WriteConfig = L3WriteConfig()
    stats: L3TierStats = field(default_factory=L3TierStats)
    known_kv: set = field(default_factory=set)
    known_state: set = field(default_factory=set)
    ledger: Optional[L3Ledger] = None
    """This worker's bundles in L3, ranked by eq. 7 (core/l3_ledger.py): after each write it removes the
    lowest-ranked ones beyond its budget share, so the master's LRU rarely has to. None: the master alone."""

    # --- read path -------------------------------------------------------------------------------

    def read(self, keys: Sequence[PageKey], local_pages: int, codec: L3Codec, now_s: float = 0.0) -> Optional[L3Hit]:
        """The longest whole prefix L3 extends the local resume point `local_pages` to, or None."""
        self.stats.lookups += 1
        beyond = list(keys[local_pages:])
        if not beyond:
            return None
        flags = self.client.exists_many([kv_object_name(k) for k in beyond] + [state_object_name(k) for k in beyond])
        kv_listed, state_listed = flags[:len(beyond)], flags[len(beyond):]
        self._forget_unlisted(beyond, kv_listed, state_listed)
        listed_end = restorable_pages([True] * local_pages + kv_listed, [False] * local_pages + state_listed)
        if listed_end <= local_pages:
            return None
        self.stats.listed_pages += listed_end - local_pages
        hit = self._read_whole_prefix(keys, local_pages, listed_end, state_listed, codec)
        if hit is None or hit.end_page < listed_end:
            self.stats.shortened_hits += 1
        if hit is not None:
            self.stats.hits += 1
            self.stats.hit_pages += hit.num_pages
            self.known_kv.update(keys[hit.first_page:hit.end_page])
            self.known_state.add(keys[hit.end_page - 1])
            if self.ledger is not None:  # the bundle read is this worker's now (as in sim/cluster.py)
                self.ledger.record(keys[:hit.end_page], now_s)
        return hit

    def _read_whole_prefix(self, keys, local_pages: int, listed_end: int, state_listed: list,
                           codec: L3Codec) -> Optional[L3Hit]:
        """Get KV pages up to the first one that does not read, then the deepest listed state within
        them that reads; `restorable_pages` over what was actually read decides the hit."""
        kv_pages = []
        for key in keys[local_pages:listed_end]:
            page = codec.decode_kv_page(self.client.get(kv_object_name(key)))
            if page is None:
                self.known_kv.discard(key)  # gone, torn or foreign (the client removed a torn one): re-put it
                break
            kv_pages.append(page)
        kv_read = [True] * (local_pages + len(kv_pages))
        for depth in range(len(kv_read), local_pages, -1):
            if not state_listed[depth - 1 - local_pages]:
                continue
            checkpoint = codec.decode_state(self.client.get(state_object_name(keys[depth - 1])),
                                            depth * codec.geometry.page_num_tokens)
            if checkpoint is None:
                self.known_state.discard(keys[depth - 1])
                continue
            end_page = restorable_pages(kv_read, [False] * (depth - 1) + [True])
            return L3Hit(local_pages, end_page, kv_pages[:end_page - local_pages], checkpoint)
        return None

    def _forget_unlisted(self, keys: Sequence[PageKey], kv_listed: list, state_listed: list) -> None:
        for key, kv, state in zip(keys, kv_listed, state_listed):
            if not kv:
                self.known_kv.discard(key)
            if not state:
                self.known_state.discard(key)

    # --- write path ------------------------------------------------------------------------------

    def write_bundle(self, keys: Sequence[PageKey], state_depths: Sequence[int], shared_pages: int,
                     kv_pages_of: Callable[[int], list], packed_state_at: Callable[[int], Optional[torch.Tensor]],
                     codec: L3Codec, now_s: float = 0.0) -> list[L3Put]:
        """Put this request's terminal bundle as core/l3_policy.py plans it (the pages and state not already
        in L3 from this worker) and return the puts planned. Synchronous: the reference worker serves
        one request at a time, and a put finishing before the next request is simplest to reason about.

        `kv_pages_of(n)`: KV pages [0, n) of the request; `packed_state_at(d)`: the packed state the
        server holds at depth d, or None when it cannot be read (then that page goes without its state:
        the read rule makes a prefix end only where a state is)."""
        self._confirm_written(keys, state_depths)
        puts = plan_l3_writes(len(keys), state_depths, lambda i: keys[i] in self.known_kv, shared_pages,
                              self.write_config, state_already_written=lambda i: keys[i] in self.known_state)
        self._rank_and_delete(keys, state_depths, now_s)
        if not puts:
            return puts
        pages = kv_pages_of(max(put.page_index for put in puts) + 1)
        for put in puts:
            packed = packed_state_at(put.page_index + 1) if put.with_state else None
            if put.with_state and packed is None:
                self.stats.states_skipped += 1
                put = replace(put, with_state=False)
            self._put_page(keys, put, pages, packed, codec)
        self.stats.paths_written += 1
        return puts

    def _rank_and_delete(self, keys: Sequence[PageKey], state_depths: Sequence[int], now_s: float) -> None:
        """Record this request's bundle in the ledger and remove what eq. 7 ranks lowest beyond the
        budget, before the puts (they take the room). `now_s`: the request's own time, the clock every
        rank of this worker agrees on."""
        depth = max([d for d in state_depths if 0 < d <= len(keys)], default=0)
        if self.ledger is None or not depth:
            return
        self.ledger.record(keys[:depth], now_s)
        self._delete(self.ledger.plan_deletes(protect=keys[depth - 1]))

    def _delete(self, deletes: L3Deletes) -> None:
        """Remove the ledger's victims (Mooncake `remove`); a refused remove (a reader's lease) leaves the
        object to the master's LRU, and either way this worker no longer claims it."""
        for keys, known, name_of in ((deletes.state_keys, self.known_state, state_object_name),
                                     (deletes.kv_keys, self.known_kv, kv_object_name)):
            for key in keys:
                known.discard(key)
                if self.client.remove(name_of(key)):
                    self.stats.objects_deleted += 1
                else:
                    self.stats.object_delete_failures += 1

    def _confirm_written(self, keys: Sequence[PageKey], state_depths: Sequence[int]) -> None:
        """Forget the pages of this path we wrote that the store no longer lists (evicted, or lost
        with a store service): skipping them would leave the bundle unrestorable."""
        depth = max([d for d in state_depths if 0 < d <= len(keys)], default=0)
        claimed = [k for k in keys[:depth] if k in self.known_kv or k in self.known_state]
        if not claimed:
            return
        flags = self.client.exists_many([kv_object_name(k) for k in claimed] + [state_object_name(k) for k in claimed])
        self._forget_unlisted(claimed, flags[:len(claimed)], flags[len(claimed):])

    def _put_page(self, keys, put: L3Put, pages: list, packed: Optional[torch.Tensor], codec: L3Codec) -> None:
        key = keys[put.page_index]
        hints = PutHints(replicas=put.replicas, group_id=key_name(keys[put.group_id_page]),
                         soft_pin_ttl_s=self.write_config.pin_ttl_s if put.soft_pin else None)
        if key not in self.known_kv:
            self._put(self.known_kv, key, kv_object_name(key), codec.encode_kv_page(pages[put.page_index]), hints)
        if put.with_state:  # after its KV: a reader that lists the state finds the KV already there
            self._put(self.known_state, key, state_object_name(key), codec.encode_state(packed), hints)

    def _put(self, written: set, key: PageKey, name: str, payload: bytes, hints: PutHints) -> None:
        if self.client.put(name, payload, hints):
            written.add(key)
            self.stats.objects_put += 1
        else:
            self.stats.object_put_failures += 1

    def stats_dict(self) -> dict:
        return {**self.stats.as_dict(), "client": self.client.stats.as_dict()}

