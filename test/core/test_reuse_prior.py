"""The learned reuse-position prior (HiState's departure from the paper's uniform p_t, docs/policies.md):
where hits are classified, what is learned, how eq. 5 and eq. 7 use it, and a trace where the paper's
uniform prior loses reuse that the learned one keeps."""
from hypothesis import given
from hypothesis import strategies as st

from histate.core import Tier, choose_interval_pages, make_cache
from histate.core.interval import plan_positions

from .helpers import KV_PAGE_BYTES, serve, tiny_config

NS = 4.0  # helpers.tiny_config: one checkpoint = 4 pages of KV


@given(start=st.integers(0, 50), length=st.integers(1, 400), ratio=st.floats(0.05, 20.0))
def test_without_learned_mass_the_plan_is_the_papers(start, length, ratio):
    supported = (2, 4, 8, 16, 32, 64)
    interval = choose_interval_pages(length, NS, ratio, supported)
    paper = list(range(start + interval, start + length, interval))
    assert plan_positions(start, start + length, NS, ratio, supported, ()) == paper
    assert plan_positions(start, start + length, NS, ratio, supported, (0.0,) * 8) == paper


def test_a_likely_near_end_hit_buys_a_checkpoint_an_unlikely_one_does_not():
    supported = (64,)  # one interval candidate: the grid cannot cover the end by itself
    assert 99 in plan_positions(0, 100, NS, 1.0, supported, (0.6,))  # 0.6 * 35 pages saved > 4 pages stored
    assert 99 not in plan_positions(0, 100, NS, 1.0, supported, (0.01,))  # 0.35 pages saved < 4 stored
    assert 99 not in plan_positions(0, 100, NS, 100.0, supported, (0.6,))  # SSD pressure: storage dear


def test_hits_are_classified_by_where_they_leave_the_trajectory():
    cache = make_cache("histate", tiny_config(gpu_pages=200))
    a = [("a", i) for i in range(20)]
    serve(cache, a, 1.0, checkpoint_pages=[10, 20])
    assert cache.match(a + [("x", 0)]).end_offset_pages == 0          # append: at the end
    assert cache.match(a[:19] + [("x", 0)]).end_offset_pages == 1     # one page before the end
    assert cache.match(a[:17]).end_offset_pages == 3
    assert cache.match(a[:5] + [("x", 0)]).end_offset_pages is None   # far inside: uniform part
    assert cache.match([("y", 0)]).end_offset_pages is None           # no KV hit at all


def test_policy_state_learns_the_near_end_share_of_interior_hits():
    cache = make_cache("histate", tiny_config(gpu_pages=2000))
    now = 0.0
    ctx = []
    for turn in range(30):  # each request rewrites the last page of the previous one, then appends
        ctx = ctx[:-1] + [("s", turn, i) for i in range(6)]
        now += 1.0
        serve(cache, ctx, now)
    probs = cache.state.near_end_probs
    assert probs[0] > 0.9 and sum(probs[1:]) < 0.05  # p'_1: interior hits land one page before the end
    assert make_cache("histate-paper", tiny_config(gpu_pages=10)).state.near_end_probs == ()


def _one_page_rewrites(policy: str) -> int:
    """Sessions whose next request rewrites the previous request's last page (the Weka pattern:
    docs/results.md), under checkpoint pressure. Returns the pages reused by the last request."""
    cache = make_cache(policy, tiny_config(gpu_pages=400, cpu_pages=0, ssd_pages=30))
    now, reused = 0.0, 0
    sessions = {s: [(s, "sys", i) for i in range(40)] for s in ("a", "b", "c")}
    for turn in range(12):
        for s, ctx in sessions.items():
            new = ctx[:-1] + [(s, turn, i) for i in range(3)]  # last page rewritten, 3 new pages
            now += 1.0
            reused = serve(cache, new, now).num_reused_pages
            sessions[s] = new
        cache.check_invariants()
    return reused


def test_learned_prior_keeps_the_checkpoint_that_one_page_rewrites_resume_from():
    """Under the paper's uniform prior the former terminal checkpoints (interior, tiny C with q near 1)
    are the first to go when the SSD is short, so a request that rewrites the previous request's last
    page recomputes the whole context; with the learned prior they are worth their near-end mass."""
    uniform, learned = _one_page_rewrites("histate-paper"), _one_page_rewrites("histate")
    assert learned > uniform
    assert learned >= 40  # resumed near the end of its context (the system prompt alone is 40 pages)


def test_eviction_is_charged_what_leaves_transfer_when_demoted_recompute_when_dropped():
    """Eq. 7's C with tiers (docs/policies.md, second departure): a GPU bundle that the CPU will take is
    worth its transfer (share x M x restore cost difference); the same bundle on the last tier is worth
    its recompute (share x gap); histate-paper charges the recompute everywhere."""
    from histate.core import CacheConfig, UnitKind

    def build(policy):
        config = CacheConfig(page_num_tokens=64, kv_bytes_per_token=1, checkpoint_size_bytes=4 * 64,
                             capacity_bytes={Tier.GPU: 400 * 64, Tier.CPU: 400 * 64, Tier.SSD: 400 * 64},
                             restore_cost_tokens={Tier.CPU: 0.02, Tier.SSD: 0.2})
        cache = make_cache(policy, config)
        serve(cache, [("a", i) for i in range(30)], 1.0, checkpoint_pages=[30])
        (leaf,) = cache.tree.root.children.values()
        return cache, leaf

    cache, leaf = build("histate")
    q = cache.state.terminal_prob
    m_tokens = (30 + 4) * 64  # the leaf's KV and its terminal checkpoint
    _, cost_gpu, reclaim, _ = cache.state.score_terms(leaf, UnitKind.BUNDLE, 1 << Tier.GPU)
    assert reclaim == m_tokens and abs(cost_gpu - q * m_tokens * 0.02) < 1e-6
    _, cost_ssd, _, _ = cache.state.score_terms(leaf, UnitKind.BUNDLE, 1 << Tier.SSD)  # last tier: dropped
    assert abs(cost_ssd - q * 30 * 64) < 1e-6
    paper, leaf = build("histate-paper")
    _, cost_paper, _, _ = paper.state.score_terms(leaf, UnitKind.BUNDLE, 1 << Tier.GPU)
    assert abs(cost_paper - paper.state.terminal_prob * 30 * 64) < 1e-6
