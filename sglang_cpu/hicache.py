"""SGLang's HiCache (host tier, and storage with HiState's backend) on a CPU-only machine.

SGLang builds its host pools and controller on CPU once pinning is mocked (research/sglang-0.5.23.md
§5.3); what needs CUDA is the data plane: `L2TransferEngine` runs the D->H / H->D copies with the
sgl-kernel transfer ops on CUDA streams. `FakeL2TransferEngine` stands in for it: every transfer
completes at once; recurrent states are copied with torch (slot for slot, the host pool's page-first
layout), KV pages are not moved. Everything else is SGLang's: the controller's queues and acks, the
tree's backup / demote / load-back bookkeeping, the storage backup and prefetch threads, and HiState's
storage backend underneath. So a state's bytes can be followed device -> host -> SSD -> host ->
device on CPU; HiCache's KV copies stay a GPU-only check.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator, Optional
from unittest import mock

from .pools import Driver, Pools, build_cache, cache_params, publish_server_args

HICACHE_ARGS = dict(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_mem_layout="page_first",
                    hicache_io_backend="kernel", hicache_write_policy="write_through")


class _Done:
    """A CUDA event / stream that is always complete."""

    def record(self, *args: Any) -> None:
        pass

    def wait(self, *args: Any) -> None:
        pass

    def wait_stream(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class FakeL2TransferEngine:
    """`sglang.srt.mem_cache.l2_transfer.L2TransferEngine`'s interface; transfers complete at once."""

    def __init__(self, io_backend: str = "kernel"):
        self.io_backend = io_backend
        self.device_to_host_stream = _Done()
        self.host_to_device_stream = _Done()
        self.num_device_to_host = self.num_host_to_device = 0

    def _completion(self) -> Any:
        from sglang.srt.mem_cache.l2_transfer import TransferCompletion

        return TransferCompletion(_Done(), _Done(), False)

    def submit_device_to_host(self, transfers: list) -> Any:
        self.num_device_to_host += len(transfers)
        for transfer in transfers:
            for device, host in state_slot_pairs(transfer):
                host.copy_(device)
        return self._completion()

    def submit_host_to_device(self, transfers: list, *, transfer_layer_id_max: int, start_event: Any = None,
                              on_layer_done: Any = None) -> Any:
        self.num_host_to_device += len(transfers)
        for transfer in transfers:
            for device, host in state_slot_pairs(transfer):
                device.copy_(host)
        for layer_id in range(transfer_layer_id_max):
            if on_layer_done is not None:
                on_layer_done(layer_id)
        return self._completion()


def state_slot_pairs(transfer: Any) -> Iterator[tuple]:
    """(device view, host view) of every recurrent-state tensor of a MAMBA transfer (none for KV):
    device buffers are [layers, slots, ...], the host pool's page-first buffers [slots, layers, 1, ...]."""
    host_pool, device_pool = transfer.host_pool, transfer.device_pool
    if not hasattr(host_pool, "temporal_buffer"):
        return
    cache = device_pool.mamba_cache
    for device_slot, host_slot in zip(transfer.device_indices.tolist(), transfer.host_indices.tolist()):
        yield cache.temporal[:, device_slot], host_pool.temporal_buffer[host_slot][:, 0]
        for device, host in zip(cache.conv, host_pool.conv_buffer):
            yield device[:, device_slot], host[host_slot][:, 0]


@contextlib.contextmanager
def _cpu_hicache() -> Iterator[None]:
    import sglang.srt.mem_cache.pool_host.common as host_common
    from sglang.srt.runtime_context import get_parallel

    with (mock.patch.object(host_common, "_cuda_host_register", lambda *a, **k: None),
          mock.patch("sglang.srt.managers.cache_controller.L2TransferEngine", FakeL2TransferEngine),
          get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)):
        yield


def hicache_server_args(page_size: int, chunk_tokens: int, *, storage_extra: Optional[dict] = None,
                        hicache_ratio: float = 2.0, **fields: Any) -> Any:
    """Publish ServerArgs with SGLang's host tier on (`HICACHE_ARGS`; `fields` override them, e.g.
    `hicache_write_policy="write_back"`; "auto": the flag not given on the command line) and, with
    `storage_extra` (a `dynamic` backend extra config, e.g. HiState's), its storage tier."""
    from histate.sglang_plugin.write_policy import AUTO_ATTR

    storage = {} if storage_extra is None else dict(
        hicache_storage_backend="dynamic", hicache_storage_backend_extra_config=json.dumps(storage_extra),
        hicache_storage_prefetch_policy="wait_complete")
    auto = fields.get("hicache_write_policy") == "auto"  # not given: SGLang's default, HiState may choose
    if auto:
        fields["hicache_write_policy"] = "write_through"
    server_args = publish_server_args(page_size=page_size, chunk_tokens=chunk_tokens,
                                      **{**HICACHE_ARGS, "hicache_ratio": hicache_ratio, **storage, **fields})
    if auto:
        setattr(server_args, AUTO_ATTR, True)  # what HiState's from_cli_args hook stashes (write_policy.py)
    return server_args


def attach_hicache(cache: Any, pools: Pools, server_args: Any, histate_config: Any = None,
                   write_through_threshold: int = 1) -> Any:
    """SGLang's `init_hicache` on CPU (host pools, controller, storage threads), with HiState's host
    sizing while `histate_config` is given, as `histate_cache_factory` builds it."""
    from histate.sglang_plugin.host_stack import histate_build_scope, install_host_policy

    install_host_policy()
    with _cpu_hicache(), histate_build_scope(histate_config):
        cache.init_hicache(server_args, cache_params(pools))
    if cache.host_pool_group is not None:
        for entry in cache.host_pool_group.entry_map.values():
            entry.host_pool.pin_memory = False  # staging pages of the L3 prefetch (no pinned allocator on CPU)
    cache.write_through_threshold = write_through_threshold
    return cache


def build_hicache(kind: str, pools: Pools, *, histate_config: Any = None, storage_extra: Optional[dict] = None,
                  write_through_threshold: int = 1, hicache_ratio: float = 2.0, params_fields: Optional[dict] = None,
                  write_policy: str = "write_through", **histate_kwargs: Any) -> Any:
    """A `kind` cache ('histate' or 'stock') with SGLang's host tier attached (`write_policy`: its
    --hicache-write-policy), and with `storage_extra` (a `dynamic` backend extra config, e.g. HiState's) its
    storage tier too; `params_fields`: further CacheInitParams fields."""
    from histate.sglang_plugin.config import resolve_config

    server_args = hicache_server_args(pools.page_size, max(16, pools.page_size), storage_extra=storage_extra,
                                      hicache_ratio=hicache_ratio, hicache_write_policy=write_policy)
    if kind == "histate":
        histate_config = histate_config or resolve_config({"enable": True}, {})
        histate_kwargs["histate_config"] = histate_config
    cache = build_cache(kind, pools, params_fields=params_fields, **histate_kwargs)
    return attach_hicache(cache, pools, server_args, histate_config if kind == "histate" else None,
                          write_through_threshold)


def drain_backups(cache: Any, timeout_s: float = 10.0) -> None:
    """Scheduler steps until SGLang's host and storage backups are acknowledged (its backup thread
    writes the storage tier), and HiState's state-only writes are agreed."""
    import time

    deadline = time.monotonic() + timeout_s
    cache.check_hicache_events()
    while cache.ongoing_backup or cache.ongoing_write_through or _state_writes_in_flight(cache):
        if time.monotonic() > deadline:
            raise TimeoutError("storage backups did not finish")
        if cache.ongoing_backup or cache.ongoing_write_through:
            time.sleep(0.002)
        else:  # only HiState's state writes: wait for their I/O, then the next step agrees them
            for job in _state_writes(cache).writes:
                job.write.result(timeout=max(0.0, deadline - time.monotonic()))
        cache.check_hicache_events()


def _state_writes(cache: Any) -> Any:
    """HiState's state-only SSD writes under write_back (sglang_plugin/state_writes.py), or None."""
    return getattr(getattr(getattr(cache, "histate", None), "ssd_tier", None), "state_writes", None)


def _state_writes_in_flight(cache: Any) -> bool:
    writes = _state_writes(cache)
    return writes is not None and writes.in_flight()


def request(rid: str, tokens: list) -> Any:
    """A real SGLang `Req` for `tokens`."""
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=1))


class TieredDriver(Driver):
    """`Driver` with the scheduler's tier steps around each request: the enqueue-time match, the
    admission check that holds a request while its storage data is fetched (`check_prefetch_progress`,
    scheduler.py:4240-4246), the admission match, load-back of host hits (schedule_policy.py:1517 and
    the batch's `ready_to_load_host_cache`), and a scheduler step (`check_hicache_events`) after each
    forward pass, which here waits until the backups it started are acknowledged."""

    admission_lock: Any = None  # the prefix an admitted request holds until its pass ran

    def admit(self, tokens: list) -> int:
        """Bring `tokens`' reusable prefix to the device and hold it, as the admitted request does
        (`PrefillAdder._commit_prefill_admission` locks `req.last_node`); returns its length."""
        import time

        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        self.num_requests += 1
        req = request(f"t{self.num_requests}", tokens)
        self.enqueue(req)
        while not self.cache.check_prefetch_progress(req.cache_request_handle):
            time.sleep(0.001)
            self.cache.check_hicache_events()  # the scheduler's steps go on while the request waits
        req.init_next_round_input(self.cache)  # admission
        if req.host_hit_length > 0 or req.mamba_host_hit_length > 0:
            self.cache.init_load_back(InitLoadBackParams(best_match_node=req.best_match_node,
                                                         host_hit_length=req.host_hit_length, req=req))
        self.admission_lock = self.cache.lock(req.best_match_node)
        self.cache.ready_to_load_host_cache()
        self.cache.check_hicache_events()
        if req.kv.holds_mamba:  # the request's own state slot: it never runs here
            self.pools.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
            req.kv.mamba_pool_idx = None
        return self.match(tokens).device_prefix_len

    def enqueue(self, req: Any) -> None:
        """The scheduler's enqueue-time match and, with a storage tier, its L3 prefetch of what follows
        the host hit (`Scheduler._prefetch_kvcache`, run as is on a stand-in with its three fields)."""
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler import Scheduler

        if not self.cache.enable_storage:
            req.init_next_round_input(self.cache)
            return
        scheduler = SimpleNamespace(enable_hicache_storage=True, enable_lmcache=False, tree_cache=self.cache)
        Scheduler._prefetch_kvcache(scheduler, req)

    def step(self) -> None:
        """A scheduler step; it waits for SGLang's backup threads, so a replay is deterministic."""
        drain_backups(self.cache)

    def serve(self, tokens: list, checkpoints: Optional[list] = None, plan: Any = None,
              state_fill: Any = None) -> Any:
        self.admit(tokens)
        outcome = super().serve(tokens, checkpoints, plan, state_fill)
        self.cache.unlock(self.admission_lock)
        self.admission_lock = None
        self.step()
        return outcome
