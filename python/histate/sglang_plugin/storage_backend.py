"""HiState's SSD tier as an SGLang HiCache storage backend (`--hicache-storage-backend dynamic`).

SGLang loads this class through `StorageBackendFactory` from the extra config that
`--enable-histate --histate-ssd-dir ...` writes (`module_path`/`class_name`, plus a `histate`
section with the directories, the byte budget and the I/O engine). Bytes go through
`histate.storage.CheckpointStore` (NIXL POSIX, or plain files with the same on-disk format;
checksummed, atomically published, index rebuilt on restart); this module only maps SGLang's
calls onto it:

  * KV pages (generic page path): `batch_get` / `batch_set` / `batch_exists`; the pages of one
    `batch_set` go into one packed file, each still read, checked and evicted on its own;
  * extra pools, in particular the MAMBA pool (v2 path): `batch_get_v2` / `batch_set_v2` move one
    state per key between the host pool and the store;
  * `batch_exists_v2` reports every restorable prefix length: a prefix of p pages is restorable
    when KV pages [0, p) are stored and the state keyed by page p-1 is stored. Because SGLang keys a
    state by the last page hash of the node it ends, every checkpoint SGLang ever wrote (one per
    node end, and HiState creates a node end at every planned checkpoint) is a resume point, not
    only the end of the longest hit.

Ranks that share a --histate-ssd-dir each own a namespace (subdirectory) in it, with its own lock
and its own byte budget (`rank_namespace`, `rank_budget_bytes`). Store keys are `<pool>/<page
hash><rank suffix>` as before. KV pages of one `batch_set` are packed into one file. Faults never
raise: a failed read is a miss, a failed write is False.

With `--histate-l3 mooncake` a shared Mooncake Store sits under the SSD (`l3_tier.L3Tier`, SGLang's
own `MooncakeStore`, stock keys and bytes). The extra config then carries `interface_v1: 1`, so SGLang
moves KV pages through `batch_get_v1` / `batch_set_v1` with host indices (Mooncake reads and writes
the registered host pool zero-copy; the generic `batch_get` / `batch_set` stay SSD-only):
  * reads: the SSD first; a page or state the SSD lacks (or fails to read) is read from L3 into the
    same host index; a page whose L3 read fails in any way is reported not loaded;
  * presence (`batch_exists`, `batch_exists_v2`): a page counts when its KV is on SSD or in L3, a
    prefix is restorable when the state keyed by its last page is on SSD or in L3
    (`histate.core.l3_policy.restorable_pages`, SGLang's TRAILING_PAGES rule);
  * writes: the terminal bundle (`histate.core.l3_policy`): the KV pages up to the deepest
    checkpoint HiState holds on the request's path, and only that deepest state. What reaches
    `batch_set_v1` / `batch_set_v2` goes to the SSD as before; then every KV page of the backup goes to
    L3 (they are the path to the terminal state), and a state only if `l3_admits_state` (set by the
    SSD tier once attached, `SsdTier.l3_admits_state`) admits it: the node whose state it is held the
    deepest checkpoint on its path when its backup was queued (no node below it held one). Interior
    checkpoints stay on this server (their eq. 7 value is local). A state that was terminal at its
    backup and becomes interior later stays in L3 as written; the next request's terminal state is
    written with its own backup. Without the hook (the backend alone, e.g. under stock SGLang's
    HiCache) every state is written, as stock's Mooncake backend does: the backend itself cannot tell
    a terminal state from an interior one. Both minus what this server already put there
    (`plan_l3_writes`' already_written; forgotten when read back missing). L3 results never change
    what the SSD write reports.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from histate.core import L3WriteConfig, plan_l3_writes, restorable_pages

from .config import MIN_SSD_SIZE_BYTES, HiStateConfigError, parse_storage_section
from .server_settings import EXTRA_CONFIG_KEY

logger = logging.getLogger(__name__)

KV_POOL = "kv"
FREE_SPACE_FRACTION = 0.9  # budget when --histate-ssd-size is 0: this share of the free space
MAX_REPLICA_SLOTS = 64  # namespaces tried per rank identity (data-parallel replicas share one identity)
_SECTION_OPTION = "--hicache-storage-backend-extra-config"


def default_budget_bytes(dirs: list[str]) -> int:
    """90% of the free space of the given directories (each counted once per file system)."""
    seen: dict[int, int] = {}
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        seen[os.stat(d).st_dev] = shutil.disk_usage(d).free
    return int(sum(seen.values()) * FREE_SPACE_FRACTION)


def rank_budget_bytes(section: dict, num_ranks: int) -> int:
    """This rank's byte budget: --histate-ssd-size (per rank, like the `max_size` of SGLang's file
    backend, which each rank applies to the files it owns: sglang/srt/mem_cache/storage/file/
    lru_file_evictor.py:76-80, 145-146, 281-304), or, when 0, its share of 90% of the free space. Below one checkpoint it is a config error."""
    size = section.get("ssd_size_bytes") or 0
    budget = size or default_budget_bytes(section["ssd_dirs"]) // max(1, num_ranks)
    if budget < MIN_SSD_SIZE_BYTES:
        what = (f"{size} bytes" if size else
                f"0 (auto) leaves {budget // 2**20} MiB per rank ({num_ranks} ranks, 90% of the free space)")
        raise HiStateConfigError(f"--histate-ssd-size: {what} is below the minimum of {MIN_SSD_SIZE_BYTES // 2**20}MiB "
                                 f"per rank (one checkpoint must fit)")
    return budget


def rank_suffix(storage_config: HiCacheStorageConfig) -> str:
    """This rank's identity as SGLang's file backend appends it to every key: model, TP rank/size, PP,
    CP (sglang/srt/mem_cache/hicache_storage.py:738-760 build it, :822-826 suffix every key)."""
    model = "-".join((storage_config.model_name or "").split("/"))
    suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}"
    if storage_config.pp_size > 1:
        suffix += f"_{storage_config.pp_size}_{storage_config.pp_rank}"
    if storage_config.attn_cp_size > 1:
        suffix += f"_cp{storage_config.attn_cp_rank}_{storage_config.attn_cp_size}"
    return suffix


def rank_namespace(storage_config: HiCacheStorageConfig) -> str:
    """Subdirectory of every --histate-ssd-dir that this rank owns: its rank suffix plus the
    attention-DP rank (with DP attention tp_rank is group-local, hicache_storage.py:41-42; the file
    backend leaves it out), as one safe directory name."""
    name = "rank" + rank_suffix(storage_config)
    if getattr(storage_config, "dp_rank", 0):
        name += f"_dp{storage_config.dp_rank}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:180]


def open_store(section: dict, on_evict: Optional[Callable[[Any], None]] = None, *, namespace: str = "",
               num_ranks: int = 1, on_capacity_needed: Optional[Callable[[int], Any]] = None) -> Any:
    """A CheckpointStore from the `histate` section of the extra config, in `namespace` under each
    directory. A namespace held by a live store (a data-parallel replica with the same rank identity)
    makes it take the next free slot, `<namespace>.1`, `<namespace>.2`, ..."""
    from histate.storage import CheckpointStore, DirectoryInUse, StoreConfig

    section = parse_storage_section(section, option=_SECTION_OPTION)
    if not section.get("ssd_dirs"):
        raise HiStateConfigError(f"{_SECTION_OPTION}: no histate.ssd_dirs (give --histate-ssd-dir)")
    budget = rank_budget_bytes(section, num_ranks)
    for slot in range(MAX_REPLICA_SLOTS):
        name = f"{namespace}.{slot}" if slot else namespace
        config = StoreConfig(dirs=section["ssd_dirs"], capacity_bytes=budget,
                             backend=section.get("io_backend", "auto"), namespace=name)
        try:
            return CheckpointStore(config, on_evict=on_evict, on_capacity_needed=on_capacity_needed)
        except DirectoryInUse:
            logger.info("HiState storage: %s is in use; trying the next slot", name)
    raise HiStateConfigError(f"--histate-ssd-dir: all {MAX_REPLICA_SLOTS} slots of {namespace} are in use")


class IoWindow:
    """What SGLang's storage metrics read (`get_stats`, unified_radix_cache.py:3704-3710): pages and
    GB/s of every prefetch (read) and backup (write) operation since the last call, as SGLang's own
    backends keep them (mooncake_store.py:1405-1409, 1676-1686). Bytes are counted per thread, so a
    restore on another thread does not inflate a prefetch's bandwidth."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self._ops: dict = {"prefetch": ([], []), "backup": ([], [])}  # kind -> (pages, GB/s)

    def add_bytes(self, num_bytes: int) -> None:
        self._local.num_bytes = getattr(self._local, "num_bytes", 0) + num_bytes

    @contextlib.contextmanager
    def operation(self, kind: str, pages_done: Callable[[], int]) -> Iterator[None]:
        before, started = getattr(self._local, "num_bytes", 0), time.perf_counter()
        try:
            yield
        finally:
            seconds = max(time.perf_counter() - started, 1e-9)
            num_bytes = getattr(self._local, "num_bytes", 0) - before
            num_pages = pages_done()
            if num_pages:
                with self._lock:
                    pages, bandwidth = self._ops[kind]
                    pages.append(num_pages)
                    bandwidth.append(num_bytes / seconds / 1e9)

    def drain(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._lock:
            (prefetch_pgs, prefetch_bw), (backup_pgs, backup_bw) = self._ops["prefetch"], self._ops["backup"]
            metrics.prefetch_pgs.extend(prefetch_pgs)
            metrics.prefetch_bandwidth.extend(prefetch_bw)
            metrics.backup_pgs.extend(backup_pgs)
            metrics.backup_bandwidth.extend(backup_bw)
            self._ops = {"prefetch": ([], []), "backup": ([], [])}
        return metrics


def histate_backend(controller: Any) -> Optional["HiStateStorageBackend"]:
    """HiState's backend in HiCache's controller (under the wrapper SGLang's dynamic factory may put
    around it, `_backend`), or None: no storage tier, or another backend."""
    backend = getattr(controller, "storage_backend", None)
    backend = getattr(backend, "_backend", backend)
    return backend if isinstance(backend, HiStateStorageBackend) else None


def _num_true(flags: Any) -> int:
    """Pages an operation moved: its per-key flags (per pool for the v2 path)."""
    if isinstance(flags, dict):
        return sum(_num_true(v) for v in flags.values())
    return sum(1 for flag in flags if flag is True)


class HiStateStorageBackend(HiCacheStorage):
    """SGLang `HiCacheStorage` over `histate.storage.CheckpointStore` (see module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None, *,
                 store: Any = None, l3: Any = None):
        extra = storage_config.extra_config or {}
        section = extra.get(EXTRA_CONFIG_KEY)
        self.key_suffix = rank_suffix(storage_config)
        self.metrics: Any = None  # HiStateMetrics, set by the tree cache once attached
        # The SSD tier's `pick_ssd_victims` (ssd_tier.py), set by the tree cache once attached. Victims
        # come from HiState's ranking; until it is attached a put that does not fit fails.
        self.pick_victims: Optional[Callable[[int], list]] = None
        # The SSD tier's `admits_kv` (ssd_tier.py): which KV pages SGLang's write-through may store (the
        # SSD is the host's victim tier for KV); None (not attached) stores every page.
        self.admits_kv: Optional[Callable[[str], bool]] = None
        # The SSD tier's `l3_admits_state` (ssd_tier.py): which backed-up states also go to L3 (the
        # terminal bundle's: the deepest checkpoint on the node's path when its backup was queued).
        # None (not attached: the backend alone, e.g. under stock SGLang's HiCache) writes every state
        # to L3, as stock's Mooncake backend does: without HiState's tree the backend cannot tell a
        # terminal state from an interior one, and dropping states it cannot judge would leave L3
        # without any resume point.
        self.l3_admits_state: Optional[Callable[[str], bool]] = None
        self.num_ranks = storage_config.tp_size * storage_config.pp_size  # ranks writing this server's objects
        self.store = store if store is not None else open_store(
            section, on_evict=self._on_evict, namespace=rank_namespace(storage_config),
            num_ranks=self.num_ranks, on_capacity_needed=self._on_capacity_needed)
        self.registered_pools: dict = {}
        self.mem_pool_host: Any = None
        self.io_window = IoWindow()
        self.l3: Any = l3
        if self.l3 is None and (section or {}).get("l3", "off") == "mooncake":
            from .l3_tier import L3Tier

            try:
                self.l3 = L3Tier(storage_config, require_digests=section.get("l3_require_digests", False),
                                 fleet_budget_bytes=section.get("l3_budget_bytes", 0),
                                 num_servers=section.get("l3_servers", 0))
            except BaseException:
                self.store.close()
                raise
        if self.l3 is not None:
            self.l3.on_io = self._count_l3
        # Checkpoints on SSD (for the per-tier gauge); warm restarts start from the rebuilt index.
        self.num_states = sum(1 for k in self.store.keys() if not k.startswith(f"{KV_POOL}/")
                              and k.endswith(self.key_suffix))

    # --- keys and bookkeeping -------------------------------------------------------------------

    def store_key(self, pool: Any, page_hash: str) -> str:
        return f"{getattr(pool, 'value', pool)}/{page_hash}{self.key_suffix}"

    def _on_capacity_needed(self, bytes_needed: int) -> list:
        pick = self.pick_victims
        return list(pick(bytes_needed)) if pick is not None else []

    def _on_evict(self, event: Any) -> None:
        if event.key.startswith(f"{KV_POOL}/") or not event.key.endswith(self.key_suffix):
            return
        if event.reason != "replaced":
            self.num_states -= 1

    def _count_io(self, *, read_bytes: int = 0, written_bytes: int = 0) -> None:
        self.io_window.add_bytes(read_bytes + written_bytes)
        if self.metrics is not None:
            self.metrics.record_ssd_io(read_bytes=read_bytes, written_bytes=written_bytes)

    def _count_l3(self, **amounts: int) -> None:
        if self.metrics is not None:
            self.metrics.record_l3_io(**amounts)

    # --- host pools: the SSD copies through them, L3 registers them with Mooncake ---------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        if self.l3 is not None:
            self.l3.register_kv(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[host_pool_name] = host_pool
        if self.l3 is not None:
            self.l3.register_pool(host_pool, host_pool_name)

    def has_state(self, page_hash: str, pool: Any = "mamba") -> bool:
        """Whether the checkpoint keyed by the last page hash of a node is on SSD."""
        return self.store.exists(self.store_key(pool, page_hash))

    def read_state(self, page_hash: str, host_pool: Any, host_index: int, pool: Any = "mamba") -> bool:
        """Copy one stored checkpoint into `host_pool` slot `host_index`; False on any miss/fault."""
        from histate.storage import aligned_empty

        # A plain (unpinned), O_DIRECT-aligned bounce buffer: the pool's own dummy page would be
        # pinned memory allocated per call.
        page = torch.from_numpy(aligned_empty(host_pool.page_size * host_pool.size_per_token))
        result = self.store.get(self.store_key(pool, page_hash), out=page)
        if not result.hit:
            return False
        host_pool.set_from_flat_data_page(host_index, page)
        self._count_io(read_bytes=page.numel() * page.element_size())
        return True

    def write_state(self, key: str, host_pool: Any, host_index: int) -> bool:
        """Store `host_pool` slot `host_index` under store key `key`: the state-only write of write_back
        (state_writes.py), off SGLang's backup path. True once stored (or already there); a fault is
        False. The SSD alone: L3 takes a state with its bundle's KV (`batch_set_v2` after a host backup)."""
        stored = [False]
        with self.io_window.operation("backup", lambda: int(stored[0])):
            if self.store.exists(key):
                return True
            (stored[0],) = self._put_slots(host_pool, [(key, host_index)], counts_states=True)
        return stored[0]

    def _put_slots(self, host_pool: Any, slots: list, counts_states: bool) -> List[bool]:
        """Store host-pool slots, [(store key, host index)], in one put; whether each was stored. Counts the
        bytes written, and each stored state (`counts_states`)."""
        pages = [host_pool.get_data_page(index, flat=True) for _, index in slots]
        done = self.store.submit_put([(key, page) for (key, _), page in zip(slots, pages)]).wait() if slots else []
        for page, result in zip(pages, done):
            if result.stored:
                self._count_io(written_bytes=page.numel() * page.element_size())
                self.num_states += counts_states
        return [bool(result.stored) for result in done]

    # --- KV pages: the generic page path ---------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        values: list = []
        with self.io_window.operation("prefetch", lambda: sum(v is not None for v in values)):
            values = self._batch_get(keys, target_locations)
        return values

    def _batch_get(self, keys: List[str], target_locations: Any = None) -> list:
        outs = list(target_locations) if target_locations is not None else [None] * len(keys)
        store_keys = [self.store_key(KV_POOL, k) for k in keys]
        present = [self.store.payload_bytes(k) for k in store_keys]
        # A destination of the wrong size is a layout mismatch: report a miss, do not raise.
        usable = [out is None or (size is not None and out.numel() * out.element_size() == size)
                  for out, size in zip(outs, present)]
        results = self.store.get_many(
            [k for k, ok in zip(store_keys, usable) if ok],
            [o for o, ok in zip(outs, usable) if ok] if target_locations is not None else None)
        it = iter(results)
        values: list = []
        for ok, out in zip(usable, outs):
            result = next(it) if ok else None
            if result is None or not result.hit:
                values.append(None)
                continue
            tensor = out if out is not None else result.tensor()
            self._count_io(read_bytes=tensor.numel() * tensor.element_size())
            values.append(tensor)
        return values

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        stored: list = []
        with self.io_window.operation("backup", lambda: _num_true(stored)):
            stored = self._batch_set(keys, values)
        return all(stored)  # SGLang's generic page path takes one flag per batch (cache_controller.py:1403-1408)

    def _batch_set(self, keys: List[str], values: Any) -> List[bool]:
        """Store the pages not stored yet that the SSD tier admits; one flag per key, from the store's
        own per-key result (`PutResult.stored`: a page a packed write lost is False on its own). A page
        the tier does not admit is reported written (it stays on the host alone, which SGLang's
        write-through cannot express); the SSD tier counts a page as stored only once the store holds
        it on every rank (`SsdTier.confirm_backups`), never from these flags."""
        admits = self.admits_kv
        flags, items, slots = [True] * len(keys), [], []
        for i, (k, v) in enumerate(zip(keys, values)):
            store_key = self.store_key(KV_POOL, k)
            if (admits is None or admits(k)) and not self.store.exists(store_key):
                items.append((store_key, v.contiguous()))
                slots.append(i)
        results = self.store.put_many(items, pack=True) if items else []
        for i, (_, value), result in zip(slots, items, results):
            flags[i] = result.stored
            if result.stored:
                self._count_io(written_bytes=value.numel() * value.element_size())
        return flags

    def exists(self, key: str) -> bool:
        return self.store.exists(self.store_key(KV_POOL, key))

    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        present = self._kv_present(keys)
        return next((i for i, ok in enumerate(present) if not ok), len(keys))

    def _kv_present(self, keys: List[str]) -> List[bool]:
        """Per page: KV on SSD, or (with L3) in L3. L3 is asked for the pages the SSD lacks only."""
        present = []
        for key in keys:
            if not self.exists(key):
                break
            present.append(True)
        rest = keys[len(present):]
        if rest and self.l3 is not None and self.mem_pool_host is not None:
            ssd = [self.exists(k) for k in rest]
            l3 = iter(self.l3.kv_present([k for k, ok in zip(rest, ssd) if not ok]))
            present += [True if ok else next(l3) for ok in ssd]
        return present + [False] * (len(keys) - len(present))

    def _pool_present(self, keys: List[str], name: Any, upto: int) -> List[bool]:
        """Per page i < upto: the `name` state keyed by page i is on SSD, or (with L3) in L3."""
        ssd = [self.store.exists(self.store_key(name, keys[i])) for i in range(upto)]
        if self.l3 is not None and not all(ssd):
            l3 = iter(self.l3.pool_present([k for k, ok in zip(keys, ssd) if not ok], name))
            ssd = [True if ok else next(l3) for ok in ssd]
        return ssd

    # --- KV pages with host indices (interface_v1; SGLang uses it when L3 is on) ----------------

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        loaded: list = []
        with self.io_window.operation("prefetch", lambda: _num_true(loaded)):
            loaded = self._batch_get_v1(keys, host_indices)
        return loaded

    def _batch_get_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        pool = self.mem_pool_host
        if pool is None or not keys:
            return [False] * len(keys)
        page = pool.page_size
        loaded = [False] * len(keys)
        try:
            values = self._batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
            for i, value in enumerate(values):
                if value is not None:
                    pool.set_from_flat_data_page(int(host_indices[i * page]), value)
                    loaded[i] = True
        except Exception:
            logger.warning("HiState storage: SSD read of %d KV pages failed; trying L3", len(keys), exc_info=True)
        missing = [i for i, ok in enumerate(loaded) if not ok]
        if missing and self.l3 is not None:
            indices = torch.cat([host_indices[i * page:(i + 1) * page] for i in missing])
            for i, ok in zip(missing, self.l3.get_kv([keys[i] for i in missing], indices)):
                loaded[i] = bool(ok)
        return loaded

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        stored: list = []
        with self.io_window.operation("backup", lambda: _num_true(stored)):
            stored = self._batch_set_v1(keys, host_indices)
        return stored

    def _batch_set_v1(self, keys: List[str], host_indices: torch.Tensor) -> List[bool]:
        pool = self.mem_pool_host
        if pool is None or not keys:
            return [False] * len(keys)
        page = pool.page_size
        data = [pool.get_data_page(int(host_indices[i * page])) for i in range(len(keys))]
        stored = self._batch_set(keys, data)
        if self.l3 is not None:
            todo = self._l3_kv_to_write(keys)
            if todo:
                indices = torch.cat([host_indices[i * page:(i + 1) * page] for i in todo])
                self.l3.put_kv([keys[i] for i in todo], indices)
        return stored

    def _l3_kv_to_write(self, keys: List[str]) -> List[int]:
        """Pages of this backup that go to L3: `plan_l3_writes` over the batch (a prefix ending at its
        last page), skipping pages this server already put; the state is written by batch_set_v2."""
        puts = plan_l3_writes(len(keys), [len(keys)], lambda i: self.l3.kv_written(keys[i]), 0, L3WriteConfig(),
                              state_already_written=lambda i: True)
        return [p.page_index for p in puts]

    # --- extra pools (MAMBA): the v2 path --------------------------------------------------------

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        kv_present = self._kv_present(keys)
        kv_pages = next((i for i, ok in enumerate(kv_present) if not ok), len(keys))
        hit_count: dict = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            stored = self._pool_present(keys, transfer.name, kv_pages)
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_ok = {p for p in restorable if all(stored[i] for i in range(max(0, p - trailing), p))}
                if trailing == 1 and pool_ok:  # the MAMBA rule, shared with the simulator's cluster mode
                    hit_count[transfer.name] = restorable_pages(kv_present[:kv_pages], stored)
                    restorable &= pool_ok
                    continue
            elif transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i in range(kv_pages) if not stored[i]), kv_pages)
                pool_ok = set(range(1, boundary + 1))
            else:
                raise ValueError(f"HiState storage: unsupported pool hit policy {transfer.hit_policy}")
            if pool_ok:
                hit_count[transfer.name] = max(pool_ok)
            restorable &= pool_ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    def _pool_pages(self, transfer: PoolTransfer) -> Optional[tuple[Any, int, list]]:
        host_pool = self.registered_pools.get(transfer.name)
        keys = transfer.keys or []
        page_size = getattr(host_pool, "page_size", 1) or 1
        indices = transfer.host_indices
        if host_pool is None or indices is None or indices.numel() != len(keys) * page_size:
            logger.error("HiState storage: %s transfer has %s host indices for %d keys",
                         transfer.name, None if indices is None else indices.numel(), len(keys))
            return None
        return host_pool, page_size, keys

    def _per_pool(self, transfers: List[PoolTransfer], one_pool) -> dict:
        """`one_pool(transfer, host_pool, page_size, keys) -> [bool]` for every pool of the batch; a pool
        whose pages cannot be laid out answers False for each key (a miss, never an error)."""
        results: dict = {}
        for transfer in transfers:
            layout = self._pool_pages(transfer)
            results[transfer.name] = ([False] * len(transfer.keys or []) if layout is None
                                      else one_pool(transfer, *layout))
        return results

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        results: dict = {}
        with self.io_window.operation("prefetch", lambda: _num_true(results)):
            results = self._per_pool(transfers, self._get_pool)
        return results

    def _get_pool(self, transfer: PoolTransfer, host_pool, page_size: int, keys) -> list:
        loaded = [self.read_state(key, host_pool, int(transfer.host_indices[i * page_size]), pool=transfer.name)
                  for i, key in enumerate(keys)]
        missing = [i for i, ok in enumerate(loaded) if not ok]
        if missing and self.l3 is not None:
            sub = PoolTransfer(name=transfer.name, keys=[keys[i] for i in missing],
                               host_indices=torch.cat([transfer.host_indices[i * page_size:(i + 1) * page_size]
                                                       for i in missing]))
            for i, ok in zip(missing, self.l3.get_pool(sub)):
                loaded[i] = bool(ok)
        return loaded

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict:
        results: dict = {}
        with self.io_window.operation("backup", lambda: _num_true(results)):
            results = self._per_pool(transfers, self._set_pool)
        return results

    def _set_pool(self, transfer: PoolTransfer, host_pool, page_size: int, keys) -> list:
        flags, todo = [], []
        for i, key in enumerate(keys):
            store_key = self.store_key(transfer.name, key)
            flags.append(self.store.exists(store_key))
            if not flags[-1]:
                todo.append((i, store_key, int(transfer.host_indices[i * page_size])))
        stored = self._put_slots(host_pool, [(k, index) for _, k, index in todo], transfer.name != KV_POOL)
        for (i, _, _), ok in zip(todo, stored):
            flags[i] = ok
        if self.l3 is not None:
            self._put_pool_l3(transfer, page_size, keys)
        return flags

    def _put_pool_l3(self, transfer: PoolTransfer, page_size: int, keys) -> None:
        """The states of this backup that go to L3: those `l3_admits_state` admits (the terminal
        bundle's state; every state while no tree cache is attached), and of those what
        `plan_l3_writes` asks for (one page whose KV was written by batch_set_v1, skipping states this
        server already put)."""
        admits = self.l3_admits_state
        todo = [i for i, key in enumerate(keys)
                if (admits is None or admits(key))
                and plan_l3_writes(1, [1], lambda _: True, 0, L3WriteConfig(),
                                   state_already_written=lambda _, k=key: self.l3.state_written(k))]
        if todo:
            self.l3.put_pool(PoolTransfer(
                name=transfer.name, keys=[keys[i] for i in todo],
                host_indices=torch.cat([transfer.host_indices[i * page_size:(i + 1) * page_size] for i in todo])))

    # --- lifecycle -----------------------------------------------------------------------------------

    def clear(self) -> bool:
        self.store.delete_many([key for key in self.store.keys() if key.endswith(self.key_suffix)])
        return True

    def get_stats(self) -> Any:
        """SGLang's contract (`HiCacheStorage.get_stats`): a `StorageMetrics` of the operations since
        the last call. HiState's own counters are `histate_stats()`."""
        return self.io_window.drain()

    def histate_stats(self) -> dict:
        """The store's and L3's counters (bytes, objects, faults), for tests and benchmarks."""
        stats = self.store.stats_snapshot()
        if self.l3 is not None:
            stats.update(self.l3.stats.snapshot())
        return stats

    def close(self) -> None:
        self.store.close()
        if self.l3 is not None:
            self.l3.close()
