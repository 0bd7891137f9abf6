"""SGLang's own cache kit, as a peer check: one seeded fuzz on stock and on HiState, same contract.

For every FULL+MAMBA configuration of the kit (`config.CONFIGS`: page size 1, and 4/64/128 with the
extra buffer), `build_fixture` builds real pools and the cache (stock `UnifiedRadixCache` or
`HiStateRadixCache`, see _sglang_kit.py). A seeded sequence of scheduler-shaped operations runs on
it, and after every step:
  * SGLang's `sanity_check()` (tree, ledgers, leaf sets, LRU lists);
  * the ledger contract: evict(n) frees at least min(n, what `mamba_evictable_size()` /
    `full_evictable_size()` report), probed on a copy so the run itself is not perturbed;
  * HiState's invariant H4 (every eviction unit is offered to the victim heaps).

The operations are those of the kit's `insert_walk.SegmentLockFuzzFixtures._run_seed` (insert a
branch or a new sequence, lock a matched node with or without its Mamba lock, unlock, evict), built
from the kit's blocks (`_make_seq`, `_alloc`, `_lock_skips`, `match_prefix`). That driver itself is
SWA-only (`allocator.free_swa`, SWA lock receipts) and binds a request-pool row per insert, so the
FULL+MAMBA loop is written here. Two operations are added because the scheduler does them on every
admission: a request state slot taken through `MambaComponent._alloc_mamba_slot` (evicts on
shortage, mamba.py:527-553), and a copy-on-write match of a real `Req`
(`Req.init_next_round_input(cow_mamba=True)` -> `finalize_match_result_in_cache`: lock,
`evict_for_alloc(mamba_num=1)`, unlock; mamba.py:196-225).

Seeds: 40 per configuration and cache kind, 40 steps each (320 runs, 160 on HiState). Before the
R1 fix HiState failed the contract on 62 of its 160 seeds, at every page size (stock: none).
"""
from __future__ import annotations

import random
from array import array

import pytest

from ._sglang_kit import (
    CACHE_KINDS,
    FULL_MAMBA_CONFIGS,
    assert_evict_frees_what_the_ledger_reports,
    assert_histate_invariants,
    kit_on_cpu,
)

SEEDS_PER_CONFIG = 40
STEPS_PER_SEED = 40


def _fuzz_class(cfg):
    from sglang.test.kits.unified_radix_cache.insert_walk import SegmentLockFuzzFixtures

    class LedgerFuzz(SegmentLockFuzzFixtures):
        """The kit's fixture mixin bound to `cfg`, plus the FULL+MAMBA fuzz loop."""

        def run(self, seed: int, steps: int) -> None:
            from sglang.srt.managers.schedule_batch import Req
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
            from sglang.srt.mem_cache.radix_cache import RadixKey
            from sglang.srt.mem_cache.unified_cache.components import ComponentType
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix

            rng = random.Random(seed)
            cache, allocator, pool = build_fixture(self.cfg)
            mamba = cache.components[ComponentType.MAMBA]
            chains: list[list[int]] = []
            held: list[tuple] = []

            def check(step):
                try:
                    cache.sanity_check()
                    assert_evict_frees_what_the_ledger_reports(cache, allocator, pool)
                    assert_histate_invariants(cache)
                except AssertionError as e:
                    raise AssertionError(f"{self.cfg.label} seed {seed} step {step}: {e}") from e

            for step in range(steps):
                op = rng.random()
                if op < 0.35 or not chains:  # a request's prompt enters the tree with its state
                    if chains and rng.random() < 0.6:
                        base = rng.choice(chains)
                        seq = base[:rng.randrange(1, len(base) + 1)] + self._make_seq(
                            1000 * (step + 1), rng.randrange(2, 12))
                    else:
                        seq = self._make_seq(1000 * (step + 1), rng.randrange(4, 20))
                    if allocator.available_size() < len(seq):
                        cache.evict(EvictParams(num_tokens=len(seq) * 2))
                    if allocator.available_size() < len(seq):
                        continue
                    value = self._alloc(allocator, len(seq))
                    slot = mamba._alloc_mamba_slot()
                    result = cache.insert(InsertParams(key=RadixKey(array("q", seq)), value=value, mamba_value=slot))
                    if result.mamba_exist:
                        pool.mamba_allocator.free(slot)
                    chains.append(seq)
                elif op < 0.5:  # admission: copy-on-write of the matched state into a request slot
                    req = Req(rid=f"s{step}", origin_input_text="", origin_input_ids=array("q", rng.choice(chains) + [7]),
                              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
                    req.init_next_round_input(cache, cow_mamba=True)
                    if req.kv.holds_mamba:  # the request leaves (aborted before its forward pass)
                        pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(0))
                elif op < 0.65:  # a running request pins its prefix (decode may skip the Mamba lock)
                    node_id = match_prefix(cache, rng.choice(chains)).last_device_node
                    if cache.tree_core.is_root(node_id):
                        continue
                    held.append((node_id, cache.inc_lock_ref(node_id, skip_lock_components=self._lock_skips(rng))))
                elif op < 0.8 and held:
                    node_id, receipt = held.pop(rng.randrange(len(held)))
                    cache.dec_lock_ref(node_id, receipt.to_dec_params())
                else:
                    cache.evict(EvictParams(num_tokens=rng.randrange(0, 32), mamba_num=rng.randrange(0, 4)))
                check(step)
            for node_id, receipt in held:
                cache.dec_lock_ref(node_id, receipt.to_dec_params())
            check(steps)

    LedgerFuzz.cfg = cfg
    return LedgerFuzz()


@pytest.mark.parametrize("cfg", FULL_MAMBA_CONFIGS, ids=lambda cfg: cfg.label)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_kit_fuzz_keeps_the_ledger_contract(sglang_plugins, kind, cfg):
    fuzz = _fuzz_class(cfg)
    with kit_on_cpu(kind):
        for seed in range(SEEDS_PER_CONFIG):
            fuzz.run(seed, STEPS_PER_SEED)


def test_the_kit_covers_every_full_mamba_page_size():
    assert [(cfg.page_size, cfg.enable_mamba_extra_buffer) for cfg in FULL_MAMBA_CONFIGS] == [
        (1, False), (4, True), (64, True), (128, True)]
