"""SGLang's write_back host: host pressure frees host copies of KV the device also holds before anything else.

Under `--hicache-write-policy write_back` a segment loaded back from the host keeps its host copy while the
device holds it. SGLang 0.5.23 frees those copies first when the host pool is short
(`UnifiedTreeCore.drive_host_eviction` -> `_reclaim_full_host_duplicates`, unified_tree_core.py:1941-2035):
oldest first, sparing evictable device leaves in a first pass; only then does the ranked walk (HiState's
eq. 7 in the plugin) evict sole host copies. The simulator's `histate-writeback-via-host` models the plugin,
so it must do the same (`Evictor.reclaim_host_duplicates`); without it a cpu48-like host keeps copies of
what the device holds and sends sole copies to the SSD (docs/results.md, "write_back and SGLang's host
duplicate reclaim"). Expectations below are worked out by hand from that rule, not read from the code.
"""
from histate.core import CPU_BIT, GPU_BIT, SSD_BIT, HybridPrefixCache, ItemKind, Tier, make_policy

from .helpers import KV_PAGE_BYTES, serve, tiny_config


def _keys(session: str, num_pages: int) -> list:
    return [(session, i) for i in range(num_pages)]


def _kv_masks(cache, session: str, num_pages: int) -> list:
    path, _, _ = cache.tree.walk(_keys(session, num_pages))
    return [node.kv_mask for node in path]


def _cache(reclaims: bool) -> HybridPrefixCache:
    policy = make_policy("histate-writeback-via-host")
    assert policy.host_reclaims_duplicates  # what the plugin runs under (SGLang's write_back path)
    policy.host_reclaims_duplicates = reclaims
    # 20-page device, 16-page host: each request is 4 pages of KV and a 4-page terminal state
    return HybridPrefixCache(tiny_config(20, 16, 100), policy)


def _run_until(cache, last: str) -> None:
    t = 0
    serve(cache, _keys("x", 4), t := t + 1, [4])
    serve(cache, _keys("x", 8), t := t + 1, [8])  # x: two nodes, [0, 4) and [4, 8)
    for session in "bcd":
        serve(cache, _keys(session, 4), t := t + 1, [4])
    # the device wrote x's leaf and b back to the host (write_back: no copy before that)
    assert _kv_masks(cache, "x", 8) == [GPU_BIT, CPU_BIT] and _kv_masks(cache, "b", 4) == [CPU_BIT]
    serve(cache, _keys("x", 8), t := t + 1, [8])
    # the hit loaded x's leaf back from the host, which keeps its copy: a host duplicate
    assert _kv_masks(cache, "x", 8) == [GPU_BIT, GPU_BIT | CPU_BIT]
    for session in "ef":
        serve(cache, _keys(session, 4), t := t + 1, [4])
        if session == last:
            break
    cache.check_invariants()


def test_a_full_host_frees_the_loaded_back_copy_before_any_sole_copy():
    cache = _cache(reclaims=True)
    _run_until(cache, "e")
    # host: x's leaf (duplicate), b, c, d = 16 pages, full; nothing reclaimed yet
    assert _kv_masks(cache, "x", 8) == [GPU_BIT, GPU_BIT | CPU_BIT]
    assert [_kv_masks(cache, s, 4) for s in "bcd"] == [[CPU_BIT]] * 3
    cache = _cache(reclaims=True)
    _run_until(cache, "f")
    # f's insert wrote e back to the full host: x's host copy went, every sole host copy stayed
    assert _kv_masks(cache, "x", 8) == [GPU_BIT, GPU_BIT]
    assert [_kv_masks(cache, s, 4) for s in "bcde"] == [[CPU_BIT]] * 4
    assert cache.stats.evictions[("bundle", "CPU", "reclaim")] == 1
    assert cache.evictor.host_duplicates == {}


def test_without_the_reclaim_eq7_sends_a_sole_copy_to_the_ssd_instead():
    """The same stream with the rule switched off: the ranked walk keeps the duplicate and demotes b, the
    only copy of its KV, to the SSD (what the simulator modelled before; the server never did this)."""
    cache = _cache(reclaims=False)
    _run_until(cache, "f")
    assert _kv_masks(cache, "x", 8) == [GPU_BIT, GPU_BIT | CPU_BIT]
    assert _kv_masks(cache, "b", 4) == [SSD_BIT]
    assert ("bundle", "CPU", "reclaim") not in cache.stats.evictions


def _x_on_the_device():
    """`histate-writeback-via-host` with a 40-page device and an 8-page host holding x = [0, 4) -> [4, 8) on
    the device alone. Returns (cache, inner node, leaf)."""
    cache = HybridPrefixCache(tiny_config(40, 8, 100), make_policy("histate-writeback-via-host"))
    serve(cache, _keys("x", 4), 1.0, [4])
    serve(cache, _keys("x", 8), 2.0, [8])
    path, _, _ = cache.tree.walk(_keys("x", 8))
    inner, leaf = path
    assert inner.kv_mask == leaf.kv_mask == GPU_BIT
    return cache, inner, leaf


def _two_duplicates(lock_leaf: bool):
    """x both copied to the host by hand and registered leaf first (SGLang's load-back ack walks from the
    anchor up): the leaf is the older duplicate."""
    cache, inner, leaf = _x_on_the_device()
    for node in (leaf, inner):
        cache.book.put(node, ItemKind.KV, Tier.CPU, "copy", Tier.GPU)
        cache.evictor.note_duplicate(node)
    if lock_leaf:
        cache.book.pin(leaf)  # a running request holds it: not an evictable device leaf
    return cache, inner, leaf


def test_the_first_pass_spares_an_evictable_device_leaf_even_when_it_is_older():
    cache, inner, leaf = _two_duplicates(lock_leaf=False)
    pool = cache.ledger.pool_of(Tier.CPU, ItemKind.KV)
    assert cache.evictor.make_room(pool, 4 * KV_PAGE_BYTES, 3.0)
    assert (inner.kv_mask, leaf.kv_mask) == (GPU_BIT, GPU_BIT | CPU_BIT)
    # the second pass takes the device leaf once no other duplicate is left
    assert cache.evictor.make_room(pool, 8 * KV_PAGE_BYTES, 3.0)
    assert (inner.kv_mask, leaf.kv_mask) == (GPU_BIT, GPU_BIT)
    cache.check_invariants()


def test_a_held_leaf_is_no_evictable_device_leaf_so_the_oldest_goes_first():
    cache, inner, leaf = _two_duplicates(lock_leaf=True)
    pool = cache.ledger.pool_of(Tier.CPU, ItemKind.KV)
    assert cache.evictor.make_room(pool, 4 * KV_PAGE_BYTES, 3.0)
    assert (inner.kv_mask, leaf.kv_mask) == (GPU_BIT | CPU_BIT, GPU_BIT)
    cache.book.unpin(leaf)
    cache.check_invariants()


def test_write_through_policies_keep_eq7_alone():
    """`histate` (write-through, the default) has no such path in SGLang: nothing is registered."""
    cache = HybridPrefixCache(tiny_config(20, 16, 100), make_policy("histate"))
    serve(cache, _keys("x", 8), 1.0, [8])
    assert cache.evictor.host_duplicates is None


def test_one_load_back_registers_its_nodes_from_the_anchor_up():
    """SGLang's load-back ack registers the loaded nodes from the request's anchor up to the root
    (`finish_load_back`, unified_tree_core.py:2735-2751), so within one load-back the deepest is oldest."""
    cache, inner, leaf = _x_on_the_device()
    for node in (leaf, inner):  # written back by hand, leaf first: both on the host alone
        cache.book.move(node, ItemKind.KV, Tier.GPU, Tier.CPU)
        cache.evictor.touch(node)
    lease = cache.begin_request(_keys("x", 8), 3.0)  # loads both back; the request holds them
    assert lease.match.num_reused_pages == 8
    assert inner.kv_mask == leaf.kv_mask == GPU_BIT | CPU_BIT
    pool = cache.ledger.pool_of(Tier.CPU, ItemKind.KV)
    assert cache.evictor.make_room(pool, 4 * KV_PAGE_BYTES, 3.0)
    assert (inner.kv_mask, leaf.kv_mask) == (GPU_BIT | CPU_BIT, GPU_BIT)
    cache.finish_request(lease, None, 3.0, [8])
    cache.check_invariants()
