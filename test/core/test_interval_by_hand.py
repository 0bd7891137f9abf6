"""Eq. 3-6 (paper §3.2) stated independently of `interval.py`: literal numbers worked out by hand, and a
few-line transcription of the paper's eq. 5 that the controller's argmin must agree with.

    eq. 3/4/5: I* = argmin_I [(T_KV / T_state) * (L / I) * N_s + C_recomp(I)],
               C_recomp(I) = (1 / L) * sum_{t=1}^{L-1} (t mod I)   (uniform hit position)
    eq. 6:     I ~ sqrt(2 * L * N_s * T_KV / T_state)

Why this file exists: a broken argmin (the ratio inverted, N_s dropped) must fail a test that does
not call the code it checks to get its expectation. With L = 800 pages and every divisor of 800
supported, C_recomp(I) = (I - 1) / 2 exactly, so eq. 5's cost is ratio * N_s * 800 / I + (I - 1) / 2,
minimised at I = sqrt(2 * 800 * N_s * ratio): eq. 6 lands on a supported interval and eq. 5 must pick it.
"""
import math
from fractions import Fraction

import pytest

from histate.core import (CacheConfig, IntervalController, Tier, choose_interval_pages, continuous_optimum_pages,
                          make_cache, recompute_cost_pages)

L_PAGES = 800
DIVISORS_OF_800 = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 80, 100, 160, 200, 400, 800)


def paper_eq5_argmin(num_pages: int, checkpoint_pages: int, ratio: Fraction, supported) -> int:
    """The paper's eq. 5 in exact arithmetic, ties to the larger (sparser) interval."""
    def cost(interval: int) -> Fraction:
        memory = ratio * Fraction(num_pages, interval) * checkpoint_pages
        recompute = Fraction(sum(t % interval for t in range(1, num_pages)), num_pages)
        return memory + recompute
    return min(sorted(supported, reverse=True), key=cost)


@pytest.mark.parametrize("num_pages, interval, expected", [
    (10, 3, 0.9),     # t mod 3 for t = 1..9: 1+2+0 three times = 9, / 10
    (64, 8, 3.5),     # 8 full runs of 0..7 = 8 * 28 = 224, / 64
    (100, 7, 2.95),   # 14 runs of 0..6 = 294, then t = 99: 99 mod 7 = 1 -> 295, / 100
    (5, 16, 2.0),     # 1+2+3+4 = 10, / 5 (the interval is longer than the segment)
])
def test_eq3_uniform_recompute_cost_by_hand(num_pages, interval, expected):
    assert recompute_cost_pages(num_pages, interval) == pytest.approx(expected)


@pytest.mark.parametrize("checkpoint_pages, ratio, expected", [
    (4, 1.0, 80),     # sqrt(2 * 800 * 4 * 1)    = 80 (dropping N_s would give 40)
    (1, 4.0, 80),     # sqrt(2 * 800 * 1 * 4)    = 80 (T_state / T_KV instead would give 20)
    (1, 0.25, 20),    # sqrt(2 * 800 * 1 / 4)    = 20 (the inverse ratio would give 80)
    (4, 4.0, 160),    # sqrt(2 * 800 * 4 * 4)    = 160
    (4, 0.25, 40),    # sqrt(2 * 800 * 4 / 4)    = 40
    (1, 1.0, 40),     # sqrt(2 * 800)            = 40
])
def test_eq5_picks_the_eq6_optimum_when_it_is_supported(checkpoint_pages, ratio, expected):
    """Eq. 5 at L = 800 over the divisors of 800: cost(I) = ratio * N_s * 800 / I + (I - 1) / 2, e.g.
    N_s = 4, ratio 1: I = 50 -> 64 + 24.5 = 88.5, I = 80 -> 40 + 39.5 = 79.5, I = 100 -> 32 + 49.5 = 81.5."""
    assert choose_interval_pages(L_PAGES, checkpoint_pages, ratio, DIVISORS_OF_800) == expected
    assert continuous_optimum_pages(L_PAGES, checkpoint_pages, ratio) == pytest.approx(expected)


def test_eq6_by_hand():
    assert continuous_optimum_pages(64, 4.0, 1.0) == pytest.approx(22.627416997969522)  # sqrt(512)
    assert continuous_optimum_pages(64, 4.0, 4.0) == pytest.approx(45.254833995939045)  # sqrt(2048)
    assert continuous_optimum_pages(800, 2.0, 0.5) == pytest.approx(40.0)  # sqrt(1600)


@pytest.mark.parametrize("num_pages", [16, 64, 256, 800])
@pytest.mark.parametrize("checkpoint_pages", [1, 4, 24])
@pytest.mark.parametrize("ratio", [Fraction(1, 8), Fraction(1, 2), Fraction(1), Fraction(4), Fraction(32)])
def test_eq5_agrees_with_the_papers_formula(num_pages, checkpoint_pages, ratio):
    """Over the intervals that divide L (there the paper's L / I and the controller's count of
    intermediate checkpoints, L / I - 1, differ by a constant, so the argmin is the same)."""
    supported = [i for i in range(1, num_pages + 1) if num_pages % i == 0]
    expected = paper_eq5_argmin(num_pages, checkpoint_pages, ratio, supported)
    assert choose_interval_pages(num_pages, checkpoint_pages, float(ratio), supported) == expected


def test_the_controller_uses_t_kv_over_t_state():
    """Observed residences T_KV = 400 s, T_state = 100 s: ratio 4, N_s = 1 page -> I = 80, so a segment
    of 800 pages gets checkpoints every 80 pages and the terminal. Swapped (T_KV = 100 s, T_state =
    400 s): ratio 1/4 -> I = 20, 40 checkpoints."""
    ctl = IntervalController(checkpoint_pages_equiv=1.0, supported=DIVISORS_OF_800, ema_alpha=0.5)
    ctl.kv_residence_s.observe(400.0)
    ctl.state_residence_s.observe(100.0)
    assert ctl.pressure_ratio() == 4.0
    assert ctl.plan(0, 800) == [80, 160, 240, 320, 400, 480, 560, 640, 720, 800]
    assert ctl.plan(1000, 1800) == [1080, 1160, 1240, 1320, 1400, 1480, 1560, 1640, 1720, 1800]
    swapped = IntervalController(checkpoint_pages_equiv=1.0, supported=DIVISORS_OF_800, ema_alpha=0.5)
    swapped.kv_residence_s.observe(100.0)
    swapped.state_residence_s.observe(400.0)
    assert swapped.pressure_ratio() == 0.25
    plan = swapped.plan(0, 800)
    assert len(plan) == 40 and plan[:3] == [20, 40, 60] and plan[-1] == 800


def test_histate_plans_the_eq5_interval_for_a_new_segment():
    """Through the cache: a checkpoint of 256 bytes is N_s = 4 pages of 64 one-byte tokens; with T_KV /
    T_state = 4, I = sqrt(2 * 800 * 4 * 4) = 160 pages for a fresh 800-page prompt."""
    cfg = CacheConfig(page_num_tokens=64, kv_bytes_per_token=1, checkpoint_size_bytes=256,
                      capacity_bytes={Tier.GPU: 10_000 * 64}, supported_intervals_pages=DIVISORS_OF_800)
    cache = make_cache("histate", cfg)
    controller = cache.evictor.state.controller
    controller.kv_residence_s.observe(400.0)
    controller.state_residence_s.observe(100.0)
    lease = cache.begin_request([("p", i) for i in range(800)], 0.0)
    positions = cache.plan_checkpoints(lease)
    cache.finish_request(lease, None, 0.0, positions)
    assert positions == [160, 320, 480, 640, 800]
    assert math.isclose(controller.pressure_ratio(), 4.0)
