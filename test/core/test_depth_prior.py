"""The depth half of the learned reuse-position prior (core/depth_prior.py) and how eq. 5 uses it
(interval.plan_positions): the lazy EMA against an eager one, the bins a segment sees, the greedy
against an eager re-implementation, and a cache whose sessions each diverge at the end of their own
system prompt."""
import dataclasses
import math

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from histate.core import make_cache
from histate.core.config import NEAR_END_WINDOW_PAGES
from histate.core.depth_prior import DepthPrior
from histate.core.interval import plan_positions, recompute_cost_pages
from histate.core.policies import make_policy
from histate.core.policy_state import PolicyState

from .helpers import serve, tiny_config

NS = 4.0  # helpers.tiny_config: one checkpoint = 4 pages of KV


@given(st.lists(st.one_of(st.none(), st.integers(1, 200)), max_size=300), st.sampled_from([0.02, 0.1, 0.5]))
def test_the_lazy_ema_is_the_eager_one(depths, alpha):
    """Every bin's mass is (1 - alpha) times its old mass after each interior hit, plus alpha for the
    bin the hit landed in; computed here bin by bin, eagerly."""
    prior = DepthPrior(bin_pages=8, alpha=alpha)
    eager: dict = {}
    for depth in depths:
        prior.observe(depth)
        eager = {b: m * (1 - alpha) for b, m in eager.items()}
        if depth is not None:
            eager[(depth - 1) // 8] = eager.get((depth - 1) // 8, 0.0) + alpha
    seen = {(first - 1) // 8: mass for first, _last, mass in prior.bins_in(0, 10_000)}
    for b, mass in eager.items():
        assert abs(seen.get(b, 0.0) - mass) < 1e-4  # pruning drops bins below 1e-4 only
    assert set(seen) <= set(eager)


def test_the_ema_survives_many_rescales():
    prior = DepthPrior(bin_pages=8, alpha=0.5)
    for _ in range(5000):  # the scale would underflow to 0 without the rescale
        prior.observe(17)
    ((first, last, mass),) = prior.bins_in(0, 100)
    assert (first, last) == (17, 24) and abs(mass - 1.0) < 1e-9


def test_a_bin_is_clipped_to_the_inside_of_the_segment_with_its_share_of_the_mass():
    prior = DepthPrior(bin_pages=8, alpha=0.5)
    prior.observe(22)  # bin 2: pages 17..24
    prior.observe(20)
    prior.observe(None)  # a near-end hit: decays, adds nothing
    mass = (0.5 * 0.5 + 0.5) * 0.5  # 0.375
    assert prior.bins_in(0, 100) == ((17, 24, mass),)
    assert prior.bins_in(21, 100) == ((22, 24, mass * 3 / 8),)  # hits strictly after the start
    assert prior.bins_in(0, 23) == ((17, 22, mass * 6 / 8),)  # and strictly before the terminal
    assert prior.bins_in(0, 18) == ((17, 17, mass / 8),)
    assert prior.bins_in(24, 100) == () and prior.bins_in(0, 17) == ()
    assert abs(sum(m for *_, m in prior.bins_in(0, 10_000)) - mass) < 1e-12
    prior.observe(9)
    assert [b[:2] for b in prior.bins_in(0, 100)] == [(9, 16), (17, 24)]


def test_a_likely_depth_buys_a_checkpoint_an_unlikely_one_does_not():
    supported = (256,)  # the grid alone never covers depth 241 of a 300-page segment
    assert 241 in plan_positions(0, 300, NS, 1.0, supported, (), ((241, 241, 0.5),))  # saves 120 > 4
    assert 241 not in plan_positions(0, 300, NS, 1.0, supported, (), ((241, 241, 0.01),))  # 2.4 < 4
    assert 241 not in plan_positions(0, 300, NS, 100.0, supported, (), ((241, 241, 0.5),))  # 120 < 400


def test_depth_mass_inside_the_segment_is_taken_from_the_uniform_share():
    """All interior mass at depth 50: the uniform share is 0, so no grid checkpoint pays for itself."""
    supported = (8, 16, 32, 64, 128)
    assert plan_positions(0, 100, NS, 1.0, supported, (), ((50, 50, 1.0),)) == [50]
    # the same mass outside the segment leaves the paper's rule (uniform share 1) in place
    paper = plan_positions(0, 100, NS, 1.0, supported)
    assert plan_positions(0, 100, NS, 1.0, supported, (), ()) == paper and paper


def _eager_plan(start, end, ns, ratio, supported, near, bins):
    """plan_positions re-implemented without prefix sums or a lazy heap: the full cost of every trial."""
    one = ratio * ns
    points = {}
    for k, p in enumerate(near, start=1):
        if p and end - k > start:
            points[end - k] = points.get(end - k, 0.0) + p
    for first, _last, m in bins:
        if m and start < first < end:
            points[first] = points.get(first, 0.0) + m
    uniform = max(0.0, 1 - sum(near) - sum(m for *_, m in bins))

    def learned_cost(chosen):
        return sum(m * (pos - max(c for c in chosen if c <= pos)) for pos, m in points.items())

    best = (math.inf, [])
    for interval in sorted(supported, reverse=True):
        chosen = [start] + list(range(start + interval, end, interval))
        cost = one * (len(chosen) - 1) + uniform * recompute_cost_pages(end - start, interval) + learned_cost(chosen)
        while True:
            trials = [(one + cost - learned_cost(chosen) + learned_cost(sorted(chosen + [c])), c)
                      for c in points if c not in chosen]
            if not trials or min(trials)[0] >= cost - 1e-12:
                break
            cost, c = min(trials)
            chosen = sorted(chosen + [c])
        if cost < best[0]:
            best = (cost, chosen[1:])
    return best[1]


@settings(max_examples=150)
@given(start=st.integers(0, 40), length=st.integers(2, 300), ratio=st.floats(0.05, 5.0),
       near=st.lists(st.floats(0.0, 0.1), max_size=NEAR_END_WINDOW_PAGES),
       depths=st.lists(st.tuples(st.integers(1, 340), st.floats(0.0, 0.1)), max_size=12))
def test_the_lazy_greedy_chooses_what_the_eager_greedy_chooses(start, length, ratio, near, depths):
    end = start + length
    bins = tuple(sorted({d: (d, d, m) for d, m in depths if start < d < end}.values()))
    supported = (4, 16, 64, 256)
    got = plan_positions(start, end, NS, ratio, supported, tuple(near), bins)
    want = _eager_plan(start, end, NS, ratio, supported, tuple(near), bins)
    assert got == want


@pytest.mark.parametrize("grid_tokens", [64, 256])
def test_policy_state_learns_depths_in_pages_whatever_its_node_unit(grid_tokens):
    """The SGLang plugin's tree counts tokens (node unit 1): a far interior hit 41 pages deep lands
    in the bin of page 41 there as in the page tree, on the 64-token grid and on the 256-token grid
    SGLang's `--page-size 256` makes (pages are grid steps, so the conversion divides by the grid)."""
    config = dataclasses.replace(tiny_config(gpu_pages=100), page_num_tokens=grid_tokens)
    policy = make_policy("histate")
    pages, tokens = PolicyState(policy, config), PolicyState(policy, config, node_unit_tokens=1)
    pages.observe_match(41, None)
    tokens.observe_match(41 * config.page_num_tokens + 5, None)  # mid-page: the floor is what is reusable
    assert pages.depth_prior.bins_in(0, 100) == tokens.depth_prior.bins_in(0, 100) == ((41, 48, 0.02),)
    tokens.observe_match(7 * config.page_num_tokens, 0)  # a terminal hit: no interior evidence
    assert tokens.depth_prior.bins_in(0, 100) == ((41, 48, 0.02),)
    assert PolicyState(make_policy("histate-paper"), config).depth_prior is None  # the paper's uniform prior


def _system_prompt_sessions(policy: str, num_sessions: int = 12) -> list:
    """Each session has its own 100-page system prompt (its own keys, one shared length); its first
    request adds 200 pages, its second keeps only the system prompt and adds 10 (a /clear, a compaction,
    a subagent brief). Returns the pages each second request reused."""
    cache = make_cache(policy, tiny_config(gpu_pages=4000))
    now, reused = 0.0, []
    for s in range(num_sessions):
        system = [(s, "sys", i) for i in range(100)]
        now += 1.0
        serve(cache, system + [(s, "a", i) for i in range(200)], now)
        now += 1.0
        reused.append(serve(cache, system + [(s, "b", i) for i in range(10)], now).num_reused_pages)
        cache.check_invariants()
    return reused


def test_sessions_that_diverge_at_their_system_prompts_end_resume_there_once_it_is_learned():
    """Eq. 5's grid of the 300-page first request is every 64 pages, so without the depth prior every
    second request resumes at page 64. With it, once enough sessions have diverged at page 100 (each
    adds 0.02 to its bin's share), the first request places a checkpoint at the bin's first page, 97,
    and every later second request resumes there."""
    learned = _system_prompt_sessions("histate")
    assert learned[0] == 64 and learned[-1] == 97
    assert set(learned) == {64, 97} and learned == sorted(learned)  # once learned, kept
    assert _system_prompt_sessions("histate-no-depth") == [64] * 12


def test_policy_state_plans_with_its_learned_depths():
    """PolicyState hands the planner the bins of the segment being planned: its plan is the eager
    greedy's on the masses computed here (k far hits at page 100: 1 - 0.98^k in the bin 97..104)."""
    config = tiny_config(gpu_pages=4000)
    state = PolicyState(make_policy("histate"), config)
    for k in range(1, 40):
        state.observe_match(100, None)
        mass = 1 - 0.98 ** k
        want = _eager_plan(0, 300, NS, 1.0, config.supported_intervals_pages, (0.0,) * NEAR_END_WINDOW_PAGES,
                           ((97, 104, mass),)) + [300]
        assert state.plan(0, 0, 300, now_s=0.0) == want
    assert 97 in want  # the mass grew enough to buy the checkpoint
