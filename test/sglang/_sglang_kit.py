"""SGLang's UnifiedRadixCache test kit as a library, on CPU, for stock and HiState caches.

The 0.5.23 wheel ships the helpers SGLang's own cache tests are built on
(`sglang.test.kits.unified_radix_cache`): `config.CONFIGS`, `fixtures.build_fixture(cfg)` (real
pools, real cache), node accessors, and the request/sequence builders of `mixins`. Three swaps
make them serve here (research/sglang-test-kit.md):
  * `fixtures.get_device` answers "cpu" (SGLang's `get_device()` raises without an accelerator);
  * for HiState, `fixtures.UnifiedRadixCache` builds `HiStateRadixCache` (with a logical clock,
    so a seed replays exactly), `fixtures.resolve_tree_core_backend` names HiState's tree core,
    and that core is registered mixed with the kit's `UnifiedTreeCoreInspector` (read accessors
    the kit's assertions need; no behaviour).
The swaps are `unittest.mock` patches of the kit module's globals, undone on exit.

`snapshot` copies a cache with its allocators so a probe (an eviction) can run on the copy and
leave the cache under test untouched; see its docstring for what is shared and why that is sound.
"""
from __future__ import annotations

import contextlib
import copy
import copyreg
import io
import pickle
import types
from typing import Any, Iterator
from unittest import mock

import torch

from histate.sglang_plugin.tree_cache import HiStateRadixCache
from histate.sglang_plugin.tree_core import BACKEND_NAME as HISTATE_TREE_CORE
from histate.sglang_plugin.tree_core import HiStateTreeCore

from sglang.test.kits.unified_radix_cache import config as kit_config
from sglang.test.kits.unified_radix_cache import fixtures as kit_fixtures
from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import UnifiedTreeCoreInspector

FULL_MAMBA_CONFIGS = [cfg for cfg in kit_config.CONFIGS if cfg.has_mamba and not cfg.has_swa]
CACHE_KINDS = ("stock", "histate")


class InspectedHiStateTreeCore(HiStateTreeCore, UnifiedTreeCoreInspector):
    """HiState's tree core plus the kit's read-only inspection accessors."""


class TickClock:
    """A logical clock: every reading is one second after the previous one (deterministic runs)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


@contextlib.contextmanager
def kit_on_cpu(kind: str) -> Iterator[None]:
    """Within this block `kit_fixtures.build_fixture(cfg)` builds a `kind` cache on device "cpu"."""
    assert kind in CACHE_KINDS, kind
    from sglang.srt.mem_cache.unified_cache import tree_core_registry

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(kit_fixtures, "get_device", lambda: "cpu"))
        if kind == "histate":
            stack.enter_context(mock.patch.object(
                kit_fixtures, "UnifiedRadixCache", lambda params: HiStateRadixCache(params, clock=TickClock())))
            stack.enter_context(mock.patch.object(
                kit_fixtures, "resolve_tree_core_backend", lambda requested, params: HISTATE_TREE_CORE))
            stack.enter_context(mock.patch.dict(
                tree_core_registry._TREE_CORE_REGISTRY,
                {HISTATE_TREE_CORE: lambda params, components: InspectedHiStateTreeCore(params, components)}))
        yield


_SHARED: list = []
"""Objects the snapshot being built shares with its original, by index (see `snapshot`)."""


def _shared(index: int) -> Any:
    return _SHARED[index]


def _share(obj: Any) -> tuple:
    _SHARED.append(obj)
    return _shared, (len(_SHARED) - 1,)


@contextlib.contextmanager
def snapshot(cache: Any, allocator: Any, req_to_token_pool: Any, *, share_tensors: bool = True) -> Iterator[tuple]:
    """A copy of (cache, allocator, req_to_token_pool) for a destructive probe.

    With `share_tensors`, the object graph (tree, ledgers, victim heaps, allocators, pools) is copied
    by a pickle round trip (several times faster than `copy.deepcopy` on it; modules and the KV
    pool object are shared) and tensors are shared,
    not copied: on SGLang's separate KV and state pools eviction only moves slot-id tensors
    between the tree and the free lists, replacing them rather than writing into them. The
    block checks that claim through torch's in-place version counters and fails if the probe
    wrote a shared tensor. The unified device pool compacts on free (it moves bytes and rewrites
    its slot tables), so it is probed with `share_tensors=False`: a full deep copy.
    """
    graph = (cache, allocator, req_to_token_pool)
    if not share_tensors:  # torch's deepcopy keeps views on their (copied) storage
        with mock.patch.dict(copy._deepcopy_dispatch, {types.ModuleType: copy._deepcopy_atomic}):
            yield copy.deepcopy(graph)
        return
    kv_pool = allocator.get_kvcache()  # KV data and a lambda (memory_pool.py:4278); no allocation state
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _share, types.ModuleType: _share,
                              type(kv_pool): _share}
    _SHARED.clear()
    pickler.dump(graph)
    probe = pickle.loads(buffer.getvalue())
    kv_data = [*kv_pool.full_kv_pool.k_buffer, *kv_pool.full_kv_pool.v_buffer]
    shared = [(t, t._version) for t in [*_SHARED, *kv_data] if isinstance(t, torch.Tensor)]
    _SHARED.clear()
    yield probe
    written = [tuple(t.shape) for t, version in shared if t._version != version]
    assert not written, f"the probe wrote tensors it shares with the cache under test: shapes {written}"


def assert_evict_frees_what_the_ledger_reports(cache: Any, allocator: Any, req_to_token_pool: Any, *,
                                               share_tensors: bool = True) -> None:
    """SGLang's admission contract, probed on a copy: `evict(n)` frees at least
    min(n, `mamba_evictable_size()`) state slots, and then min(n, `full_evictable_size()`) KV
    tokens. PrefillAdder and `ensure_mamba_capacity` admit against these two numbers
    (schedule_policy.py:711-714, allocation.py:320-323); a cache whose walk frees less crashes the
    scheduler ("Can not alloc mamba cache", mamba.py:221/552) or over-admits."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    with snapshot(cache, allocator, req_to_token_pool, share_tensors=share_tensors) as (probe, probe_allocator, probe_pool):
        states = probe.mamba_evictable_size()
        free_before = probe_pool.mamba_allocator.available_size()
        probe.evict(EvictParams(num_tokens=0, mamba_num=states))
        freed = probe_pool.mamba_allocator.available_size() - free_before
        assert freed >= states, f"evict(mamba_num={states}) freed {freed} state slots; the ledger reported {states}"
        tokens = probe.full_evictable_size()
        free_before = probe_allocator.available_size()
        probe.evict(EvictParams(num_tokens=tokens))
        freed = probe_allocator.available_size() - free_before
        assert freed >= tokens, f"evict(num_tokens={tokens}) freed {freed} KV tokens; the ledger reported {tokens}"


def assert_histate_invariants(cache: Any) -> None:
    """HiState's own checks: every unit SGLang could evict is offered to the victim heaps (H4)."""
    if isinstance(cache, HiStateRadixCache):
        cache.histate.victims.check_offered()

