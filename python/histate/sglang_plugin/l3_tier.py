"""The shared L3 tier under HiState's SSD backend: SGLang's own `MooncakeStore`, used as a library.

Tiers: device -> host -> this server's private SSD (`storage_backend.py`) -> a Mooncake Store shared
by the fleet (`--histate-l3 mooncake`). Why SGLang's `MooncakeStore` object and not HiState's own
client (`histate.l3.client`): a stock SGLang server on the same store must read what HiState wrote
and the other way round. So keys and bytes are exactly stock's, built by the same code: the object
keys `{prefix}_{page_hash}_{tp_rank}_k` / `_v` (KV, page-first host layout) and
`..._{tp_rank}_temporal` / `_conv_{i}` (MAMBA), prefix from `extra_backend_tag` and the model name,
zero-copy from and into the host pools it is registered on (`register_mem_pool_host` for KV,
`register_mem_host_pool_v2` for MAMBA), group ids when `enable_group_semantics` is set.

What goes in: the terminal bundle of each request (`histate.core.l3_policy`): the KV pages up to
the deepest checkpoint HiState holds on the request's path and only that deepest state. The choice is
the storage backend's (`storage_backend.py`): it hands this module every KV page of a backup and only
the states the SSD tier's `l3_admits_state` admits (terminal when the backup was queued); interior
checkpoints stay on the server's own tiers. Used without HiState's tree cache, the backend writes every
state, as stock's Mooncake backend does.

What this module adds to stock, and only that:
  * faults are misses: any exception, an error code, a dead store service (TRANSFER_FAIL) or a
    short read answers False for the page; SGLang never sees an exception from L3;
  * a read must return exactly the bytes of the destination (`batch_get_into` reports bytes read):
    an object of another size (a foreign layout, another model's page under the same key) is a
    miss, where stock `batch_get_v1` only checks `> 0`. An object of the right size with wrong
    bytes (a bit flip, a same-size foreign writer) is caught by a digest HiState writes beside each
    object it puts, under a key stock never reads (histate/l3/digests.py): a mismatch is a miss.
    Stock-written objects have no digest and are used unverified (counted), unless
    `require_digests` (a HiState-only fleet);
  * `written`: object groups this server put, so a re-backup skips them (`plan_l3_writes`'
    already_written); a page read back as missing is forgotten (the master evicted it);
  * a dead store service: its objects go, but the master keeps answering `batch_is_exist` = 1 for
    them until it notices (more than 10 s on the loopback store), while reads fail fast with
    TRANSFER_FAIL. So a read that fails with a transfer-level code (<= -800: TRANSFER_FAIL, RPC
    failures), or raises, marks L3 down for `RETRY_AFTER_S`: presence then answers False and reads
    are misses without a round trip, so `batch_exists` reports what the SSD has. Writes are still
    tried (stock's put skips objects the master says exist, so a put's success says nothing about
    the service: only time ends the down state). A missing object (-704, the master evicted it) or a
    wrong size does not mark L3 down.

Deletes (`remove_bundles`): with a fleet budget (`--histate-l3-budget-gb`, `--histate-l3-servers`) the
SSD tier ranks the bundles this server wrote or read by eq. 7 (`histate.core.l3_ledger`, fed agreed
events only, so every TP rank picks the same victims) and hands the victims here; each rank removes its
own rank's objects of them (KV `_k`/`_v`, state `_temporal`/`_conv_i`, and their digest objects) with
`MooncakeDistributedStore.batch_remove` (mooncake.store, `batch_remove(keys, force=False) -> list[int]`;
`MooncakeStore` itself exposes no remove besides `clear` -> `remove_all`, mooncake_store.py:1628). The
remove is an RPC to the master that blocks for its timeout when the master is gone, so it runs on a
daemon thread with at most `MAX_PENDING_REMOVE_BATCHES` batches waiting; more are dropped (counted,
left to the master's LRU) and the scheduler never waits. The removed keys are forgotten from
`written` at once and again after the remove (a backup batch may have re-put one meanwhile): the next
write re-puts them.

Placement hints: the installed Mooncake `ReplicateConfig` has `soft_pin_ttl_ms`, `soft_pin_action`,
`replica_num` and `group_ids`, but `MooncakeStore` builds its own `ReplicateConfig` inside
`_put_batch_zero_copy_impl` and sets only `group_ids` (with `enable_group_semantics`) and
`session_ids`: soft pins and replica counts cannot be passed through it, so they are not. Group
semantics (a page's KV objects and its state in one group, as `plan_l3_writes` asks) are passed by
turning on `enable_group_semantics` in the extra config, which stock servers read the same way.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from histate.l3 import digests

PUT_RETRY_BACKOFF_S = 0.01
"""Wait before retrying puts a full store refused (histate/l3/client.py, NO_SPACE)."""

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0
"""How long L3 is treated as absent after a transfer-level read failure (module doc)."""
TRANSFER_LEVEL_ERROR = -800
"""Mooncake's TRANSFER_FAIL; codes at or below it are transfer, RPC or system failures (-704 is
OBJECT_NOT_FOUND, -600 a buffer of the wrong size)."""


MAX_PENDING_REMOVE_BATCHES = 8
"""Remove batches that may wait for the remover thread (module doc); later ones are dropped."""
CLOSE_WAIT_S = 1.0
"""How long `close` waits for queued removes (a dead master would hold each for its RPC timeout)."""
OBJECT_NOT_FOUND = -704
"""Mooncake's code for a key the master does not hold: a remove of it leaves what was wanted."""


@dataclass
class L3Stats:
    hits: int = 0
    misses: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    write_failures: int = 0
    errors: int = 0
    digest_mismatches: int = 0   # objects read whose HiState digest differs: misses (histate/l3/digests.py)
    unverified: int = 0          # objects read without a digest (stock-written): used unless require_digests
    objects_removed: int = 0     # this rank's objects of the eq. 7 victims removed (digests included)
    remove_failures: int = 0     # removes the master refused (a reader's lease...): left to its LRU
    remove_batches_dropped: int = 0  # victims not removed: the remover was behind or L3 down (module doc)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **amounts: int) -> None:
        with self.lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict:
        with self.lock:
            return {f"l3_{k}": getattr(self, k) for k in
                    ("hits", "misses", "read_bytes", "written_bytes", "write_failures", "errors",
                     "digest_mismatches", "unverified", "objects_removed", "remove_failures",
                     "remove_batches_dropped")}


def open_mooncake_store(storage_config: Any, mem_pool_host: Any = None) -> Any:
    """SGLang's `MooncakeStore` with SGLang's configuration rules (extra config keys
    `master_server_address`..., else SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, else MOONCAKE_* env)."""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    return MooncakeStore(storage_config, mem_pool_host)


class L3Tier:
    """Reads, presence and writes of KV pages and pool states in the shared store (module doc)."""

    def __init__(self, storage_config: Any, mem_pool_host: Any = None, *, store: Any = None,
                 on_io: Optional[Callable[..., None]] = None, require_digests: bool = False,
                 fleet_budget_bytes: int = 0, num_servers: int = 0) -> None:
        self.store = store if store is not None else open_mooncake_store(storage_config, mem_pool_host)
        # upstream/series 0014: the store names and reads its own objects (`page_objects` and friends)
        self._public_objects = hasattr(self.store, "page_objects")
        self.stats = L3Stats()
        self.on_io = on_io  # metrics hook: on_io(read_bytes=..., written_bytes=..., hits=..., misses=...)
        self._written_kv: set = set()
        self._written_state: set = set()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.down_events = 0
        self.require_digests = require_digests  # a HiState-only fleet: an object without a digest is a miss
        # The fleet's L3 budget and its number of servers (--histate-l3-budget-gb, --histate-l3-servers):
        # the SSD tier's ledger keeps this server within budget / servers; 0: no deletes.
        self.fleet_budget_bytes = fleet_budget_bytes
        self.num_servers = num_servers
        self._removes: queue.Queue = queue.Queue(maxsize=MAX_PENDING_REMOVE_BATCHES)
        self._remover: Optional[threading.Thread] = None

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _mark_down(self) -> None:
        if self.available:
            self.down_events += 1
            logger.warning("HiState L3: a read failed at the transfer level (store service gone?); L3 is "
                           "treated as absent for %.0f s", RETRY_AFTER_S)
        self._down_until = time.monotonic() + RETRY_AFTER_S

    # --- registration (the same host pools as the SSD tier) --------------------------------------

    def register_kv(self, host_pool: Any) -> None:
        self.store.register_mem_pool_host(host_pool)

    def register_pool(self, host_pool: Any, name: Any) -> None:
        self.store.register_mem_host_pool_v2(host_pool, name)

    # --- bookkeeping ------------------------------------------------------------------------------

    def _count(self, *, hits: int = 0, misses: int = 0, read_bytes: int = 0, written_bytes: int = 0) -> None:
        self.stats.add(hits=hits, misses=misses, read_bytes=read_bytes, written_bytes=written_bytes)
        if self.on_io is not None:
            self.on_io(hits=hits, misses=misses, read_bytes=read_bytes, written_bytes=written_bytes)

    def _fault(self, what: str, *, down: bool = False) -> None:
        self.stats.add(errors=1)
        logger.warning("HiState L3: %s failed; treated as a miss", what, exc_info=True)
        if down:
            self._mark_down()

    def kv_written(self, key: str) -> bool:
        return key in self._written_kv

    def state_written(self, key: str) -> bool:
        return key in self._written_state

    def _forget(self, kv_keys: List[str] = (), state_keys: List[str] = ()) -> None:
        with self._lock:
            self._written_kv.difference_update(kv_keys)
            self._written_state.difference_update(state_keys)

    # --- object keys, as MooncakeStore builds them ------------------------------------------------
    # With upstream/series 0014 the store says so itself (`page_objects`, `pool_objects`, `objects_exist`,
    # `get_objects`); on stock 0.5.23 its private builders are called the same way its writes call them.

    def _kv_objects(self, keys: List[str], host_indices: Optional[torch.Tensor]) -> tuple:
        """(object keys, pointers, sizes, objects per page) of KV pages; pointers only with indices."""
        store = self.store
        if self._public_objects:
            objects = store.page_objects(keys, host_indices)
            return objects.keys, objects.ptrs, objects.sizes, objects.per_page
        tagged = store._tag_keys(keys)
        if host_indices is not None:
            objects, ptrs, sizes = store._batch_preprocess(tagged, host_indices)
            return objects, ptrs, sizes, len(objects) // max(1, len(keys))
        pool = store.mem_pool_host
        probe = torch.arange(pool.page_size, dtype=torch.int64)
        per_page = [name[len(""):] for name in store._batch_preprocess([""], probe)[0]]
        return [t + s for t in tagged for s in per_page], None, None, len(per_page)

    def _pool_objects(self, transfer: Any, with_buffers: bool) -> tuple:
        store = self.store
        if self._public_objects:
            objects = store.pool_objects(transfer, with_buffers)
            return objects.keys, objects.ptrs, objects.sizes, objects.per_page
        objects, per_page = store._get_hybrid_page_component_keys(list(transfer.keys), transfer)
        objects = store._tag_keys(objects)
        if not with_buffers:
            return objects, None, None, per_page
        host_pool = store.registered_pools[transfer.name]
        ptrs, sizes = store._build_pool_buffer_meta(host_pool=host_pool, host_indices=transfer.host_indices,
                                                    key_strs=objects, key_multiplier=per_page, exist_states=None)
        return objects, ptrs, sizes, per_page

    @staticmethod
    def _per_page(flags: List[bool], per_page: int) -> List[bool]:
        return [all(flags[i:i + per_page]) for i in range(0, len(flags), per_page)]

    # --- presence ---------------------------------------------------------------------------------

    def _exist(self, objects: List[str], per_page: int, what: str) -> List[bool]:
        if not self.available:
            return [False] * (len(objects) // max(1, per_page))
        try:
            exist = self.store.objects_exist if self._public_objects else self.store._batch_exist
            found = exist(objects) if objects else []
            return self._per_page([r == 1 for r in found], per_page)
        except Exception:
            self._fault(what)
            return [False] * (len(objects) // max(1, per_page))

    def kv_present(self, keys: List[str]) -> List[bool]:
        if not keys:
            return []
        try:
            objects, _, _, per_page = self._kv_objects(keys, None)
        except Exception:
            self._fault("KV presence")
            return [False] * len(keys)
        return self._exist(objects, per_page, "KV presence")

    def pool_present(self, keys: List[str], name: Any) -> List[bool]:
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        if not keys or name not in getattr(self.store, "registered_pools", {}):
            return [False] * len(keys)
        try:
            objects, _, _, per_page = self._pool_objects(PoolTransfer(name=name, keys=list(keys)), False)
        except Exception:
            self._fault(f"{name} presence")
            return [False] * len(keys)
        return self._exist(objects, per_page, f"{name} presence")

    # --- reads: exact sizes or a miss -------------------------------------------------------------

    def _read(self, objects: List[str], ptrs: list, sizes: list, per_page: int, what: str) -> List[bool]:
        if not self.available:
            return [False] * (len(objects) // max(1, per_page))
        try:
            read = self.store.get_objects if self._public_objects else self.store._get_batch_zero_copy_impl
            results = list(read(objects, ptrs, sizes))
        except Exception:
            self._fault(what, down=True)
            return [False] * (len(objects) // max(1, per_page))
        if any(isinstance(r, int) and r <= TRANSFER_LEVEL_ERROR for r in results):
            self._mark_down()
        exact = [res == (sum(size) if isinstance(size, (list, tuple)) else size)
                 for res, size in zip(results, sizes)]
        if len(exact) != len(objects):
            return [False] * (len(objects) // max(1, per_page))
        return self._per_page(self._verify(objects, ptrs, sizes, exact), per_page)

    def _verify(self, objects: List[str], ptrs: list, sizes: list, exact: List[bool]) -> List[bool]:
        """Same-size garbage is a miss: check what was read against HiState's digests."""
        try:
            verdicts, mismatches, unverified = digests.verify(self.store.store, objects, ptrs, sizes, exact,
                                                              self.require_digests)
        except Exception:
            self._fault("digest check")
            return [False] * len(objects)
        if mismatches or unverified:
            self.stats.add(digest_mismatches=mismatches, unverified=unverified)
        if mismatches:
            logger.warning("HiState L3: %d object(s) failed their digest; read as misses", mismatches)
        return verdicts

    def _guarded_digests(self, object_layout: Callable[[], tuple], done: List[bool]) -> None:
        """After a put: the digest of each object of each page written (histate/l3/digests.py). A
        digest that fails to go in leaves its object unverified, never a put failure."""
        if not any(done):
            return
        try:
            objects, ptrs, sizes, per_page = object_layout()
            digests.put_digests(self.store.store, objects, ptrs, sizes, [ok for ok in done for _ in range(per_page)])
        except Exception:
            self._fault("digest write")

    def get_kv(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        """Read KV pages into `host_indices` (page_size indices a page); False pages were not loaded."""
        if not keys:
            return []
        try:
            objects, ptrs, sizes, per_page = self._kv_objects(keys, host_indices)
        except Exception:
            self._fault("KV read setup")
            return [False] * len(keys)
        loaded = self._read(objects, ptrs, sizes, per_page, "KV read")
        page_bytes = sum(s if not isinstance(s, (list, tuple)) else sum(s) for s in sizes) // max(1, len(keys))
        hits = sum(loaded)
        self._count(hits=hits, misses=len(keys) - hits, read_bytes=hits * page_bytes)
        self._forget(kv_keys=[k for k, ok in zip(keys, loaded) if not ok])
        return loaded

    def get_pool(self, transfer: Any) -> List[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        try:
            objects, ptrs, sizes, per_page = self._pool_objects(transfer, True)
        except Exception:
            self._fault(f"{transfer.name} read setup")
            return [False] * len(keys)
        loaded = self._read(objects, ptrs, sizes, per_page, f"{transfer.name} read")
        page_bytes = sum(sizes) // max(1, len(keys))
        hits = sum(loaded)
        self._count(hits=hits, misses=len(keys) - hits, read_bytes=hits * page_bytes)
        self._forget(state_keys=[k for k, ok in zip(keys, loaded) if not ok])
        return loaded

    # --- writes: stock's puts (skipping what exists), skipping what this server wrote ------------

    def _retry_failed(self, done: List[bool], write_subset) -> List[bool]:
        """Retry, once and after PUT_RETRY_BACKOFF_S, the objects a batch put refused. A full store
        refuses a put and evicts because of it (Mooncake's PutStart failure triggers the master's
        eviction), so the retry usually lands; histate/l3/client.py measured this on loopback. This
        runs on SGLang's storage backup thread, never on a request's path."""
        failed = [i for i, ok in enumerate(done) if not ok]
        if not failed or len(failed) == len(done) and not self.available:
            return done
        time.sleep(PUT_RETRY_BACKOFF_S)
        try:
            again = list(write_subset(failed))
        except Exception:
            return done
        for i, ok in zip(failed, again):
            done[i] = bool(ok)
        return done

    def put_kv(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        """Write KV pages from `host_indices` with MooncakeStore.batch_set_v1 (stock bytes and keys)."""
        if not keys:
            return []
        try:
            done = list(self.store.batch_set_v1(keys, host_indices))
        except Exception:
            self._fault("KV write")
            done = [False] * len(keys)
        page = len(host_indices) // len(keys)
        done = self._retry_failed(done, lambda idx: self.store.batch_set_v1(
            [keys[i] for i in idx], torch.cat([host_indices[i * page:(i + 1) * page] for i in idx])))
        self._guarded_digests(lambda: self._kv_objects(keys, host_indices), done)
        self._after_put(keys, done, self._written_kv, self.store.mem_pool_host.get_ksize_per_token()
                        * self.store.mem_pool_host.page_size * 2 if done else 0)
        return done

    def put_pool(self, transfer: Any) -> List[bool]:
        keys = list(transfer.keys or [])
        if not keys:
            return []
        try:
            done = list(self.store.batch_set_v2([transfer]).get(transfer.name, [False] * len(keys)))
        except Exception:
            self._fault(f"{transfer.name} write")
            done = [False] * len(keys)
        done = self._retry_failed(done, lambda idx: self._put_pool_subset(transfer, idx))
        self._guarded_digests(lambda: self._pool_objects(transfer, True), done)
        host_pool = self.store.registered_pools.get(transfer.name)
        page_bytes = getattr(host_pool, "size_per_token", 0) * (getattr(host_pool, "page_size", 1) or 1)
        self._after_put(keys, done, self._written_state, page_bytes)
        return done

    def _put_pool_subset(self, transfer: Any, idx: List[int]) -> List[bool]:
        """batch_set_v2 of the pages `idx` of `transfer` (a retry of the ones refused)."""
        page = len(transfer.host_indices) // len(transfer.keys)
        subset = dataclasses.replace(transfer, keys=[transfer.keys[i] for i in idx], host_indices=torch.cat(
            [transfer.host_indices[i * page:(i + 1) * page] for i in idx]))
        return self.store.batch_set_v2([subset]).get(transfer.name, [False] * len(idx))

    def _after_put(self, keys: List[str], done: List[bool], written: set, page_bytes: int) -> None:
        ok = [k for k, d in zip(keys, done) if d]
        with self._lock:
            written.update(ok)
        self.stats.add(write_failures=len(keys) - len(ok))
        self._count(written_bytes=len(ok) * page_bytes)

    # --- deletes: the eq. 7 victims of this server's ledger (module doc) ---------------------------

    def object_names(self, kv_keys: List[str], state_keys: List[str]) -> List[str]:
        """This rank's object keys of KV pages `kv_keys` and of the states keyed by `state_keys` (every
        registered pool), as MooncakeStore names them, each followed by its digest object's key."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        objects = list(self._kv_objects(list(kv_keys), None)[0]) if kv_keys else []
        if state_keys:
            for name in getattr(self.store, "registered_pools", {}):
                objects += self._pool_objects(PoolTransfer(name=name, keys=list(state_keys)), False)[0]
        return [name for obj in objects for name in (obj, digests.digest_key(obj))]

    def remove_bundles(self, kv_keys: List[str], state_keys: List[str]) -> bool:
        """Remove this rank's objects of these KV pages and states, off the caller's thread (module
        doc). Returns False when the batch was dropped (L3 down or the remover behind: counted)."""
        kv_keys, state_keys = list(kv_keys), list(state_keys)
        if not kv_keys and not state_keys:
            return True
        self._forget(kv_keys, state_keys)
        if not self.available:
            self.stats.add(remove_batches_dropped=1)
            return False
        try:
            objects = self.object_names(kv_keys, state_keys)
        except Exception:
            self._fault("remove setup")
            return False
        if self._remover is None:
            self._remover = threading.Thread(target=self._remove_loop, name="histate-l3-remove", daemon=True)
            self._remover.start()
        try:
            self._removes.put_nowait((objects, kv_keys, state_keys))
        except queue.Full:
            self.stats.add(remove_batches_dropped=1)
            return False
        return True

    def _remove_loop(self) -> None:
        while True:
            batch = self._removes.get()
            try:
                if batch is None:
                    return
                self._remove_now(*batch)
            finally:
                self._removes.task_done()

    def _remove_now(self, objects: List[str], kv_keys: List[str], state_keys: List[str]) -> None:
        try:
            codes = list(self.store.store.batch_remove(objects, False))
        except Exception:
            self._fault("remove")
            codes = [None] * len(objects)
        removed = sum(1 for c in codes if c == 0)
        self.stats.add(objects_removed=removed,
                       remove_failures=sum(1 for c in codes if c not in (0, OBJECT_NOT_FOUND)))
        self._forget(kv_keys, state_keys)  # a backup batch may have put one since `remove_bundles`

    def wait_removes(self, timeout_s: float) -> bool:
        """Whether every queued remove finished within `timeout_s` (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._removes.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        if self._remover is not None:
            try:
                self._removes.put_nowait(None)  # the daemon thread ends after what is queued
            except queue.Full:
                pass
            self.wait_removes(CLOSE_WAIT_S)
        try:
            self.store.close()
        except Exception:
            pass
