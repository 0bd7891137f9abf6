"""Under `--hicache-write-policy write_back`: each new device checkpoint goes to the SSD at creation, through
one host state slot that stages it and is freed once the write is agreed (issue 28, item 1; the
simulator's `histate-writeback`).

Why: write_back copies nothing to the host at insert, and SGLang 0.5.23 writes a state to storage only as
part of its node's host backup (`build_storage_backup_spec` returns None for a node not backed up,
unified_tree_core.py:2528-2553). So a checkpoint used to reach the SSD only once the device evicted its
node; until then asymmetric tiering (`SsdTier.home_historical`) could not retire a historical checkpoint's
device copy, and eq. 4 had to price every checkpoint by its stay on the device. Writing each one at
creation takes no host mirror slot: the host keeps KV (what write_back is for), states pass through it.

One write, scheduler thread unless said:
  1. queued when an insert lands the state on the device (`note_new_checkpoint`), in insert order, the
     same on every rank;
  2. started by `start` (once per step, at most `max_in_flight` at once, oldest first, while the host has a
     free state slot: staging never evicts a host state): the D->H copy into that slot goes through SGLang's
     own write steps (`start_writing`, cache_controller.py:884-910: the index placement of
     `_move_write_operation`, the transfer `_l2_transfers` builds, the write fence, the device->host stream,
     the allocator's transfer-done event), and the scheduler thread waits for it to finish before it goes
     on. So no lock is needed and nothing can free, reuse or move the device slot while the copy reads it
     (SGLang's own write_back backups wait the same way, `writing_check(write_back=True)`); the asynchronous
     form would need SGLang's move gate (`has_inflight_device_transfers`) to see the copy. Then the store
     write is queued on an I/O thread;
  3. agreed: each write's (done, stored) rides on the per-step MIN all-reduce (storage_policy.py), in
     start order. `stored` is whether the store holds the object after the write, not what the write
     reported (`SsdTier.confirm_backups` counts the same way). Once every rank is done the staging slot is
     freed; stored on every rank: the SSD bit is set (`SsdTier.on_state_written`); otherwise the object is
     deleted where a rank holds it, and the state keeps its device copy (the write_back eviction path still
     backs it up to the host before it leaves the device).
A write is never retried: a failing disk would take a write per step. Nothing here reads the tree off the
scheduler thread: the I/O thread gets the key, the host pool and the slot.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

from .core_nodes import MAMBA, CoreNode
from .hook_points import parameter_names

logger = logging.getLogger(__name__)

MAX_IN_FLIGHT = 4  # staging slots one cache uses at once (the host's state slots are few: host_stack.py)

POOL_SLOT_BACKUP_BY_SGLANG = hasattr(HybridCacheController, "backup_pool_slots")
"""upstream/series 0017 applied: SGLang's controller copies a pool's device slots into host slots the caller
owns (`backup_pool_slots`), and the writer uses no private part of it."""

# What `_copy_to_host` uses of SGLang's HiCache controller on stock 0.5.23 (`start_writing`'s steps,
# cache_controller.py:884-910, hybrid_cache_controller.py:850-905), checked when the writer is built, so an
# SGLang that moved them is refused at start rather than failing in the scheduler loop: name -> the
# parameters HiState was written against (() = an attribute).
_CONTROLLER_API = {} if POOL_SLOT_BACKUP_BY_SGLANG else {
    "_move_write_operation": ("op",),
    "_l2_transfers": ("host_indices", "device_indices", "pool_transfers"),
    "l2_transfer_engine": (), "write_fence_stream": (), "mem_pool_device_allocator": ()}


@dataclass
class _Write:
    node: CoreNode
    page_hash: str
    key: str
    slot: Any  # the host MAMBA slot staging the state
    write: Future
    agreed: Optional[tuple] = None  # (done, stored) on every rank, from the last step's all-reduce


def eligible(node: CoreNode) -> bool:
    """A checkpoint the SSD lacks, on the device only: its node is alive, holds a device state and a page
    hash to key it by, and no host or SSD copy (agreed inputs only)."""
    data = node.sg.component_data[MAMBA]
    return (node.is_alive and not node.ssd_state and data.value is not None and data.host_value is None
            and bool(node.sg.hash_value))


class StateWriter:
    """The state-only SSD writes of one cache (see the module docstring)."""

    def __init__(self, cache: Any, tier: Any, max_in_flight: int = MAX_IN_FLIGHT):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        controller = cache.cache_controller
        missing = [name for name, params in _CONTROLLER_API.items()
                   if not hasattr(controller, name) or (params and parameter_names(getattr(controller, name)) != params)]
        if missing:
            raise RuntimeError("HiState cannot write states to the SSD under --hicache-write-policy write_back on this "
                               f"SGLang: its cache controller's {', '.join(missing)} differ from SGLang 0.5.23's")
        self.cache = cache
        self.tier = tier  # the SsdTier: keys, SSD bits, orphans
        self.host_pool = cache.host_pool_group.get_pool(PoolName.MAMBA)
        self.max_in_flight = max(1, min(max_in_flight, self.host_pool.size // 2))
        self.queued: OrderedDict = OrderedDict()  # id -> CoreNode, insert order
        self.writes: list = []  # _Write, start order
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="histate-state-write")
        self.num_started = self.num_stored = self.num_failed = 0

    # --- queue ---------------------------------------------------------------------------------------

    def note_new_checkpoint(self, node: CoreNode) -> None:
        self.queued[id(node)] = node

    def forget(self, node: CoreNode) -> None:
        """SGLang removed `node`: a queued write of it is moot (a started one ends as an orphan)."""
        self.queued.pop(id(node), None)

    def in_flight(self) -> bool:
        return bool(self.writes)

    # --- start ---------------------------------------------------------------------------------------

    def start(self) -> int:
        """Start queued writes, oldest first, while staging slots allow. Returns how many started."""
        started = 0
        while self.queued and len(self.writes) < self.max_in_flight:
            key, node = next(iter(self.queued.items()))
            if not eligible(node):
                del self.queued[key]
                continue
            slot = self.host_pool.alloc(1)
            if slot is None:
                break  # no free host state slot to stage through now; the queue waits (nothing is evicted for it)
            del self.queued[key]
            self.writes.append(self._submit(node, slot))
            started += 1
        self.num_started += started
        return started

    def _submit(self, node: CoreNode, slot: Any) -> _Write:
        sg = node.sg
        page_hash = sg.hash_value[-1]
        key = self.tier.state_key(page_hash)
        try:
            self._copy_to_host(slot, sg.component_data[MAMBA].value)
        except BaseException:
            self.host_pool.free(slot)
            raise
        self.tier.orphans.claim((key,))  # an orphan's object under this key is this node's now: no trim takes it
        write = self._io.submit(self.tier.backend.write_state, key, self.host_pool, int(slot[0]))
        return _Write(node, page_hash, key, slot, write)

    def _copy_to_host(self, host_slot: Any, device_slot: Any) -> None:
        """Copy one state into its staging slot and wait for the copy. Under upstream/series 0017 through
        SGLang's `backup_pool_slots`; on stock 0.5.23 `start_writing`'s steps by hand (module docstring)."""
        from sglang.srt.managers.cache_controller import CacheOperation
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        controller = self.cache.cache_controller
        if POOL_SLOT_BACKUP_BY_SGLANG:
            controller.backup_pool_slots(PoolName.MAMBA, host_slot, device_slot)
            return
        transfer = PoolTransfer(name=PoolName.MAMBA, host_indices=host_slot, device_indices=device_slot)
        op = CacheOperation(host_slot.new_empty((0,)), device_slot.new_empty((0,)), -1, pool_transfers=[transfer])
        host_indices, device_indices, pool_transfers = controller._move_write_operation(op)
        engine = controller.l2_transfer_engine
        if controller.write_fence_stream is not None:  # under overlap a forward may still write the slot
            engine.device_to_host_stream.wait_stream(controller.write_fence_stream)
        finish = engine.submit_device_to_host(
            controller._l2_transfers(host_indices, device_indices, pool_transfers)).finish_event
        controller.mem_pool_device_allocator.set_hicache_transfer_done_event((id(self), "state_write"), finish)
        finish.synchronize()

    # --- agreement (storage_policy.py's per-step all-reduce) -----------------------------------------

    def flags(self) -> list:
        """This rank's (done, stored) of every write in flight, in start order (the same writes on every
        rank: they start on agreed inputs)."""
        out = []
        for job in self.writes:
            done = job.write.done()
            ok = done and job.write.exception() is None and bool(job.write.result())
            out += [int(done), int(ok and self.tier.backend.store.exists(job.key))]
        return out

    def adopt_flags(self, flags: list) -> None:
        for job, done, stored in zip(self.writes, flags[0::2], flags[1::2]):
            job.agreed = (bool(done), bool(stored))

    # --- per step ------------------------------------------------------------------------------------

    def finish(self) -> int:
        """End the writes every rank finished (agreed at this step's all-reduce): free their staging slots
        and set the SSD bit of those stored on every rank. Returns how many states reached the SSD."""
        running, stored, failed = [], 0, 0
        for job in self.writes:
            if job.agreed is None or not job.agreed[0]:
                running.append(job)
                continue
            self.host_pool.free(job.slot)
            if job.agreed[1]:
                stored += 1
                self.tier.on_state_written(job.node, job.page_hash, job.key)
            else:
                failed += 1
                self.tier.backend.store.delete(job.key)  # only agreed objects stay on the SSD
        self.writes = running
        self.num_stored += stored
        self.num_failed += failed
        self.tier.runtime.metrics.record_state_writes(stored=stored, failed=failed)
        if failed:
            logger.warning("HiState SSD: %d checkpoint writes were not stored on every rank; they keep their "
                           "device copies (%d failed so far)", failed, self.num_failed)
        return stored

    def check_invariants(self) -> None:
        """S4 (docs/invariants.md): each staging slot is allocated while its write is in flight, is no
        node's host value, and its node has no SSD bit yet (the write has not been agreed)."""
        free = set(self.host_pool.free_slots.tolist())
        for released in getattr(self.host_pool, "release_slots", ()):  # freed, not yet merged back
            free |= set(released.tolist())
        for job in self.writes:
            slot = int(job.slot[0])
            assert slot not in free, f"S4: the staging slot {slot} of a write in flight is free"
            assert not job.node.is_alive or not job.node.ssd_state, "S4: a node with a write in flight has its SSD bit"
            host_value = job.node.sg.component_data[MAMBA].host_value if job.node.is_alive else None
            assert host_value is None or int(host_value[0]) != slot, f"S4: staging slot {slot} is a node's host value"

    def close(self, reopen: bool = False) -> None:
        """Detach (or, with `reopen`, a flush of the whole tree): wait for the writes in flight and
        delete what they stored, which nothing confirmed. Their staging slots go back to the host pool,
        except at a flush, which hands the whole pool back itself."""
        for job in self.writes:
            try:
                job.write.result()
            except Exception:  # the object is deleted below either way
                pass
            if not reopen:
                self.host_pool.free(job.slot)
            self.tier.backend.store.delete(job.key)
        self.writes, self.queued = [], OrderedDict()
        if not reopen:
            self._io.shutdown(wait=True)
