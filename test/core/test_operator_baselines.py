"""The operator-tuned baselines of issue 17, pinned behaviour by behaviour on hand-sized examples:
`sglang-tuned` (SGLang 0.5.23 with unified memory, session references, its eviction strategies and
the per-path state cap) and `vllm-current` (vLLM main: partial-block hits, retention interval,
Marconi junctions, no CPU tier). Expected values are worked out by hand in each test from the sizes
of helpers.tiny_config (1 byte of KV per token, 64-token pages, a state = 4 pages of KV).
Upstream sources: the policy modules' docstrings and docs/policies.md."""
from dataclasses import replace

import pytest

from histate.core import GPU_BIT, HybridPrefixCache, ItemKind, Tier, make_cache, make_policy
from histate.core.policies.sglang_tuned import SglangTuned
from histate.core.policies.vllm_current import VllmCurrent
from histate.core.scoring import ScoringContext
from histate.core.types import UnitKind

from .helpers import CKPT_BYTES, KV_PAGE_BYTES, tiny_config

A = [("a", i) for i in range(60)]
B = [("b", i) for i in range(60)]
C = [("c", i) for i in range(60)]
X = [("x", i) for i in range(60)]
CPU_BIT = 1 << Tier.CPU


def finish(cache, keys, now_s, positions, session=None, out_keys=()):
    lease = cache.begin_request(keys, now_s)
    cache.finish_request(lease, list(keys) + list(out_keys), now_s, positions, session)
    cache.check_invariants()
    return lease.match


def node_at(cache, keys, depth):
    path, pos, partial = cache.tree.walk(list(keys[:depth]))
    assert pos == depth and partial is None and path[-1].depth_pages == depth
    return path[-1]


def with_options(**attrs):
    """A sglang-tuned instance with other option values (the candidates of baseline_options.py)."""
    return type("Variant", (SglangTuned,), {"name": "variant", **attrs})()


# --- sglang-tuned: --enable-unified-memory -----------------------------------------------------------

def test_sglang_tuned_pools_the_device_and_keeps_the_host_split():
    """100 device pages: one pool of 6,400 B for KV and states (sglang-hicache: 47% = 3,008 B of states
    and 3,392 B of KV). The host keeps the static split: int(6,400 x 0.47) = 3,008 B of states. So an
    80-page request (5,120 B) can be promised on the device, which the split's KV pool refuses."""
    tuned = make_cache("sglang-tuned", tiny_config(100, cpu_pages=100, ssd_pages=200))
    ledger = tuned.ledger
    assert ledger.pool_of(Tier.GPU, ItemKind.KV) == ledger.pool_of(Tier.GPU, ItemKind.CHECKPOINT)
    assert ledger.capacity_bytes[ledger.pool_of(Tier.GPU, ItemKind.KV)] == 6400
    assert ledger.capacity_bytes[ledger.pool_of(Tier.CPU, ItemKind.CHECKPOINT)] == 3008
    assert ledger.capacity_bytes[ledger.pool_of(Tier.CPU, ItemKind.KV)] == 3392
    assert ledger.pool_of(Tier.SSD, ItemKind.KV) == ledger.pool_of(Tier.SSD, ItemKind.CHECKPOINT)
    assert tuned.reserve(80 * KV_PAGE_BYTES, 0.0, Tier.GPU, ItemKind.KV)
    stock = make_cache("sglang-hicache", tiny_config(100, cpu_pages=100, ssd_pages=200))
    assert not stock.reserve(80 * KV_PAGE_BYTES, 0.0, Tier.GPU, ItemKind.KV)


def test_on_a_unified_device_kv_pressure_evicts_kv_before_an_older_state_and_kv_takes_its_node_state():
    """GPU 40 pages. A[:20] with states at 8 and 20 (20 + 2 x 4 = 28 pages) at t=0, used again at
    t=0.5 (KV path and the state at 20 refreshed, the interior state at 8 not: SGLang refreshes the
    matched state only), then B[:8] with its state (12 pages): 40, full. C[:8] + state needs 12 more.
    One LRU over everything would take the interior state at 8 (t=0) first; unified SGLang evicts KV
    leaves only, oldest first: A's leaf [8, 20) with its state (16 pages freed). Then A[:8] is a device
    leaf (t=0.5); evicting 12 more pages takes its 8 pages of KV and, with them, its state."""
    cache = make_cache("sglang-tuned", tiny_config(40, cpu_pages=200, ssd_pages=400))
    finish(cache, A[:20], 0.0, [8, 20])
    cache.abort_request(cache.begin_request(A[:20], 0.5))
    finish(cache, B[:8], 1.0, [8])
    finish(cache, C[:8], 2.0, [8])
    head, leaf = node_at(cache, A, 8), node_at(cache, A, 20)
    assert head.ckpt_access_s == 0.0 < leaf.kv_access_s
    assert head.ckpt_mask & GPU_BIT and head.kv_mask & GPU_BIT  # the older interior state stayed
    assert not leaf.kv_mask & GPU_BIT and not leaf.ckpt_mask & GPU_BIT
    assert cache.evict(Tier.GPU, 12 * KV_PAGE_BYTES, 3.0)  # 4 pages free: A[:8] (8 + 4) goes
    assert not head.kv_mask & GPU_BIT and not head.ckpt_mask & GPU_BIT
    assert head.ckpt_mask & CPU_BIT  # written through to the host at insert: still a hit from there
    assert node_at(cache, B, 8).kv_mask & GPU_BIT


# --- sglang-tuned: --enable-session-radix-cache -----------------------------------------------------

def test_session_referenced_kv_outlives_an_unreferenced_newer_one():
    """GPU 30 pages: A[:10] + state (14 pages, session "a", t=0), B[:10] + state (14, no session, t=1).
    C[:10] + state needs 14 of the 2 free: one leaf must go. LRU takes A (older); with A referenced by
    its live session, B goes. Once "a" closes, A is an ordinary LRU candidate again."""
    cache = make_cache("sglang-tuned", tiny_config(30, cpu_pages=200, ssd_pages=400))
    finish(cache, A[:10], 0.0, [10], session="a")
    finish(cache, B[:10], 1.0, [10])
    finish(cache, C[:10], 2.0, [10])
    assert node_at(cache, A, 10).kv_mask & GPU_BIT
    assert not node_at(cache, B, 10).kv_mask & GPU_BIT
    control = HybridPrefixCache(tiny_config(30, cpu_pages=200, ssd_pages=400), with_options(session_refs=False))
    finish(control, A[:10], 0.0, [10], session="a")
    finish(control, B[:10], 1.0, [10])
    finish(control, C[:10], 2.0, [10])
    assert not node_at(control, A, 10).kv_mask & GPU_BIT and node_at(control, B, 10).kv_mask & GPU_BIT
    cache.close_session("a", 3.0)
    assert node_at(cache, A, 10).session_ref == 0
    finish(cache, X[:10], 4.0, [10])  # A (t=0) is now older than C (t=2)
    assert not node_at(cache, A, 10).kv_mask & GPU_BIT and node_at(cache, C, 10).kv_mask & GPU_BIT


def test_session_references_follow_sglangs_coverage_rules():
    """A session's next leaf below its old one replaces it (the shared path counts once); a leaf on
    another branch (a rewind) is added, so the shared prefix counts twice; the state reference sits on
    the leaf alone. Closing the session releases everything."""
    cache = make_cache("sglang-tuned", tiny_config(400, cpu_pages=400, ssd_pages=800))
    finish(cache, A[:10], 0.0, [10], session="s")
    finish(cache, A[:20], 1.0, [20], session="s")  # appends: the leaf moves from 10 to 20
    n10, n20 = node_at(cache, A, 10), node_at(cache, A, 20)
    assert (n10.session_ref, n20.session_ref) == (1, 1)
    assert (n10.state_session_ref, n20.state_session_ref) == (0, 1)
    finish(cache, A[:6] + X[:6], 2.0, [12], session="s")  # rewinds to page 6: a second leaf
    n6, nx = node_at(cache, A, 6), node_at(cache, A[:6] + X, 12)
    assert (n6.session_ref, n10.session_ref, n20.session_ref, nx.session_ref) == (2, 1, 1, 1)
    assert (n20.state_session_ref, nx.state_session_ref) == (1, 1)
    cache.close_session("s", 3.0)
    assert all(n.session_ref == 0 and n.state_session_ref == 0 for n in cache.tree.iter_nodes())
    finish(cache, B[:10], 4.0, [10], session="s")  # a closed session tags nothing
    assert node_at(cache, B, 10).session_ref == 0


# --- histate under --enable-session-radix-cache (the plugin's ranking, sglang_plugin/eviction.py) ----

@pytest.mark.parametrize("policy, evicted", [("histate", "A"), ("histate-sessions", "B")])
def test_histate_with_session_references_ranks_referenced_units_last_on_the_device(policy, evicted):
    """GPU 30 pages: A[:10] + its state (14 pages, session "a", t=0), B[:10] + state (14, no session, t=1).
    C[:10] + state needs 14 of the 2 free: one bundle leaves the device (its KV stays on the host, written
    through). A and B cost the same to recompute per byte, so eq. 7 takes the older, A; with A referenced
    by its live session, histate-sessions takes B."""
    cache = make_cache(policy, tiny_config(30, cpu_pages=200, ssd_pages=400))
    finish(cache, A[:10], 0.0, [10], session="a")
    finish(cache, B[:10], 1.0, [10])
    finish(cache, C[:10], 2.0, [10])
    on_device = {name: bool(node_at(cache, keys, 10).kv_mask & GPU_BIT) for name, keys in (("A", A), ("B", B))}
    assert on_device == {"A": evicted != "A", "B": evicted != "B"}
    assert node_at(cache, C, 10).kv_mask & GPU_BIT


def test_histate_sessions_ranks_a_live_paths_units_last_on_every_tier():
    """Session "a" finished A[:10] then A[:20] (its leaf moved to 20): A[:10]'s node is on the live path
    (FULL coverage 1) with no frontier state there (MAMBA 0), yet its checkpoint is referenced as its KV
    is, on the device, the host and the SSD alike (2^40 s above histate's score); B[:10], no session, is
    scored exactly as histate scores it. Once "a" closes, both score as histate."""
    from histate.core import SESSION_RANK_OFFSET_S
    from histate.core.types import SSD_BIT

    cache = make_cache("histate-sessions", tiny_config(400, cpu_pages=400, ssd_pages=800))
    finish(cache, A[:10], 0.0, [10], session="a")
    finish(cache, A[:20], 1.0, [20], session="a")
    finish(cache, B[:10], 2.0, [10])
    interior, other = node_at(cache, A, 10), node_at(cache, B, 10)
    assert (interior.session_ref, interior.state_session_ref, other.session_ref) == (1, 0, 0)
    from histate.core.units import expected_cost_tokens, last_access_s, reclaim_tokens

    ctx = cache.state.scoring

    def eq7(node, unit, bit):  # histate's score written out, with no reference term
        reclaim = reclaim_tokens(node, unit, bit, ctx.page_num_tokens, ctx.checkpoint_token_equiv)
        return last_access_s(node, unit, bit) + ctx.tau_s * expected_cost_tokens(node, unit, bit, ctx) / reclaim

    for bit in (GPU_BIT, CPU_BIT, SSD_BIT):
        for unit in (UnitKind.BUNDLE, UnitKind.CHECKPOINT):
            assert cache.policy.score(ctx, interior, unit, bit) == eq7(interior, unit, bit) + SESSION_RANK_OFFSET_S
            assert cache.policy.score(ctx, other, unit, bit) == eq7(other, unit, bit)
    cache.close_session("a", 3.0)
    assert cache.policy.score(ctx, interior, UnitKind.CHECKPOINT, SSD_BIT) == eq7(interior, UnitKind.CHECKPOINT, SSD_BIT)


# --- sglang-tuned: --mamba-max-states-per-path -------------------------------------------------------

def test_path_cap_drops_the_shallowest_device_states_and_keeps_kv_and_host_copies():
    """One prefill in passes ending at pages 8, 16, 24 and 30 leaves states there; with a cap of 2 the
    two shallowest (8, 16) lose their device copy after the insert, their host copies and all KV stay."""
    cache = HybridPrefixCache(tiny_config(400, cpu_pages=400, ssd_pages=800), with_options(max_states_per_path=2))
    lease = cache.begin_request(A[:30], 0.0)
    positions = cache.plan_checkpoints(lease, step_end_pages=(8, 16, 24, 30))
    assert positions == [8, 16, 24, 30]
    cache.finish_request(lease, None, 0.0, positions)
    cache.check_invariants()
    device = sorted(n.depth_pages for n in cache.tree.iter_nodes() if n.ckpt_mask & GPU_BIT)
    host = sorted(n.depth_pages for n in cache.tree.iter_nodes() if n.ckpt_mask & CPU_BIT)
    assert device == [24, 30] and host == [8, 16, 24, 30]
    assert all(n.kv_mask & GPU_BIT for n in cache.tree.iter_nodes())
    assert cache.match(A[:17]).num_reused_pages == 16  # still a hit, from the host copy


def test_path_cap_spares_forks():
    """Cap 1. A[:20] is cached; A[:8] + X[:4] splits it at page 8 and leaves states at 8 and 12. The
    path to 12 holds 2 device states, but the one at 8 sits on a fork (two children): spared."""
    cache = HybridPrefixCache(tiny_config(400, cpu_pages=400, ssd_pages=800), with_options(max_states_per_path=1))
    finish(cache, A[:20], 0.0, [20])
    finish(cache, A[:8] + X[:4], 1.0, [8, 12])
    assert len(node_at(cache, A, 8).children) == 2
    assert node_at(cache, A, 8).ckpt_mask & GPU_BIT
    finish(cache, B[:8] + X[:4], 2.0, [8, 12])  # the same shape without a fork: 8 loses its device copy
    assert not node_at(cache, B, 8).ckpt_mask & GPU_BIT


# --- sglang-tuned: --radix-eviction-policy slru / tlru (KV victims only) -------------------------------

def test_slru_and_tlru_classes_by_hand():
    """slru: a node with hit_count >= 2 is protected (+1e7 s). tlru with threshold 640 tokens (10 pages)
    and no next-prompt estimate: budget = history 40 pages x 64 - 640 = 1,920 tokens; a node whose
    parent ends at page 35 (2,240 >= 1,920) is TEL-safe (class 0), one whose parent ends at page 20
    (1,280) is not (+1e7 s). Recency alone decides within a class; states are untouched by both."""
    ctx = ScoringContext(60.0, 64, 4.0, 0.9)

    class N:  # the read-only node shape a score reads
        children, ckpt_mask, kv_mask = {}, 0, GPU_BIT
        kv_access_s = ckpt_access_s = 5.0
        session_ref = state_session_ref = 0

        def __init__(self, start, depth, history, hits):
            self.keys, self.depth_pages = [0] * (depth - start), depth
            self.history_pages, self.hit_count = history, hits

    slru = with_options(eviction_strategy="slru", slru_protected_threshold=2)
    assert slru.score(ctx, N(35, 40, 40, 2), UnitKind.BUNDLE, GPU_BIT) == 5.0 + 1e7
    assert slru.score(ctx, N(35, 40, 40, 1), UnitKind.BUNDLE, GPU_BIT) == 5.0
    tlru = with_options(eviction_strategy="tlru", tlru_threshold_tokens=640)
    assert tlru.score(ctx, N(35, 40, 40, 1), UnitKind.BUNDLE, GPU_BIT) == 5.0
    assert tlru.score(ctx, N(20, 40, 40, 1), UnitKind.BUNDLE, GPU_BIT) == 5.0 + 1e7
    assert tlru.score(ctx, N(30, 40, 40, 1), UnitKind.BUNDLE, GPU_BIT) == 5.0  # 1,920 >= 1,920: TEL-safe
    assert with_options(eviction_strategy="lru").score(ctx, N(20, 40, 40, 9), UnitKind.BUNDLE, GPU_BIT) == 5.0
    assert make_policy("sglang-tuned").eviction_strategy == "slru"  # the choice (docs/policies.md)


def test_tlru_history_is_the_deepest_depth_ever_below_a_node():
    cache = HybridPrefixCache(tiny_config(400, cpu_pages=400, ssd_pages=800),
                              with_options(eviction_strategy="tlru", tlru_threshold_tokens=640))
    finish(cache, A[:10], 0.0, [10])
    finish(cache, A[:30], 1.0, [30])
    finish(cache, A[:10] + X[:5], 2.0, [15])
    n10 = node_at(cache, A, 10)
    assert (n10.history_pages, n10.hit_count) == (30, 3)  # inserted by all three requests
    assert node_at(cache, A[:10] + X, 15).history_pages == 15


# --- vllm-current -----------------------------------------------------------------------------------

def vllm_current(policy="vllm-current", gpu_pages=400, **kw):
    return make_cache(policy, replace(tiny_config(gpu_pages, **kw), block_pages=9))


def test_vllm_current_keeps_the_replay_boundary_and_block_aligned_junctions_only():
    """Retention interval 0: a 30-page prompt (block = 9 pages) computed in passes ending at 18 and 30
    keeps one state, at its last page (not floored to 27, partial-block hits); the decode state past it
    is not kept (#50551 open). The next request leaves the cached path at page 22: its state hit is 0,
    its KV hit 22, so it caches the junction at the last block boundary, 18, plus its own end, 32."""
    cache = vllm_current()
    lease = cache.begin_request(A[:30], 0.0)
    positions = cache.plan_checkpoints(lease, step_end_pages=(18, 30), output_end_pages=47)
    cache.finish_request(lease, A[:30] + X[:17], 0.0, positions)
    assert positions == [30]
    lease = cache.begin_request(A[:22] + B[:10], 1.0)
    assert (lease.match.num_kv_pages, lease.match.num_reused_pages) == (22, 0)
    assert cache.plan_checkpoints(lease, step_end_pages=(32,)) == [18, 32]


@pytest.mark.parametrize("interval, expected", [(18, [18, 30, 36]), (None, [9, 18, 27, 30, 36, 45])])
def test_vllm_current_retention_interval_keeps_step_ends_and_decode_crossings_on_its_grid(interval, expected):
    """Interval 18 pages (2 blocks): of the step ends 9, 18, 27 only 18, of the decode block crossings
    36 and 45 only 36, plus the replay boundary 30. Dense (None): every block-aligned one."""
    policy = type("V", (VllmCurrent,), {"name": "v", "retention_interval_pages": interval})()
    cache = HybridPrefixCache(replace(tiny_config(400), block_pages=9), policy)
    lease = cache.begin_request(A[:30], 0.0)
    assert cache.plan_checkpoints(lease, step_end_pages=(9, 18, 27, 30), output_end_pages=47) == expected


def test_vllm_current_credits_partial_block_hits():
    """After A[:30] with its state at 30: A[:30] + more reuses 30 pages (vllm-marconi: 27, the last
    whole block, where it keeps its state); A[:25] + other pages hits 25 pages of KV (vllm-marconi: 18)
    but no state at or below 25, so nothing is reused."""
    current, marconi = vllm_current(), vllm_current("vllm-marconi")
    for cache in (current, marconi):
        lease = cache.begin_request(A[:30], 0.0)
        cache.finish_request(lease, None, 0.0, cache.plan_checkpoints(lease, step_end_pages=(27, 30)))
    assert current.match(A[:30] + X[:5]).num_reused_pages == 30
    assert marconi.match(A[:30] + X[:5]).num_reused_pages == 27
    assert (current.match(A[:25] + X[:5]).num_kv_pages, current.match(A[:25] + X[:5]).num_reused_pages) == (25, 0)
    assert marconi.match(A[:25] + X[:5]).num_kv_pages == 18


def test_vllm_current_serves_no_cpu_tier_hit_the_what_if_does():
    """#57216: the offloading connector yields no CPU-tier hit for a hybrid prompt longer than one
    full-attention chunk, so vllm-current runs without one even where the host has room. GPU 30 pages:
    A (20 pages + a 4-page state) is evicted by B; asking for A again hits nothing on vllm-current and
    all 20 pages from the host on the what-if vllm-current-cpu (1,280 B of KV restored from the CPU)."""
    current = vllm_current(gpu_pages=30, cpu_pages=400)
    what_if = vllm_current("vllm-current-cpu", gpu_pages=30, cpu_pages=400)
    assert current.policy.tiers == (Tier.GPU,)
    for cache in (current, what_if):
        finish(cache, A[:20], 0.0, [20])
        finish(cache, B[:20], 1.0, [20])
    assert current.match(A[:20]).num_reused_pages == 0
    hit = what_if.match(A[:20])
    assert hit.num_reused_pages == 20 and hit.kv_bytes_by_tier == {Tier.CPU: 20 * KV_PAGE_BYTES}
    assert hit.checkpoint_tier == Tier.CPU and hit.checkpoint_size_bytes == CKPT_BYTES
