"""Adaptive interval control (eq. 3-6): exact costs and the argmin on hand-computed cases."""
import math

import pytest

from histate.core import IntervalController, choose_interval_pages, continuous_optimum_pages, recompute_cost_pages
from histate.core.interval import num_intermediate


def brute_recompute(num_pages, interval):
    return sum(t - interval * (t // interval) for t in range(1, num_pages)) / num_pages


@pytest.mark.parametrize("num_pages, interval", [(1, 1), (10, 3), (64, 8), (100, 7), (5, 16)])
def test_recompute_cost_closed_form_equals_eq3(num_pages, interval):
    assert recompute_cost_pages(num_pages, interval) == pytest.approx(brute_recompute(num_pages, interval))


def test_num_intermediate_counts_checkpoints_before_the_terminal():
    assert [num_intermediate(64, i) for i in (8, 16, 64, 100)] == [7, 3, 0, 0]


def test_choice_matches_hand_computed_argmin():
    # L = 64 pages, N_s = 4 pages, ratio 1: cost(I) = 4 * (64/I - 1) + (I - 1) / 2 for I | 64
    # I=8: 28 + 3.5 = 31.5; I=16: 12 + 7.5 = 19.5; I=32: 4 + 15.5 = 19.5; I=64: 0 + 31.5
    # tie between 16 and 32 goes to the sparser 32
    assert choose_interval_pages(64, 4.0, 1.0, (8, 16, 32, 64)) == 32
    # SSD pressure (T_KV / T_state = 4) makes states dearer: I=32 costs 16 + 15.5, I=64 costs 0 + 31.5: tie -> 64
    assert choose_interval_pages(64, 4.0, 4.0, (8, 16, 32, 64)) == 64
    # long-lived states (ratio 1/8) favour density: I=8 costs 3.5 + 3.5 = 7, I=16 costs 1.5 + 7.5 = 9
    assert choose_interval_pages(64, 4.0, 0.125, (8, 16, 32, 64)) == 8


def test_discrete_choice_tracks_continuous_optimum():
    supported = tuple(2 ** k for k in range(0, 12))
    for num_pages in (256, 1024, 2048):
        chosen = choose_interval_pages(num_pages, 24.5, 1.0, supported)
        optimum = continuous_optimum_pages(num_pages, 24.5, 1.0)
        assert optimum / 2 <= chosen <= optimum * 2


def test_controller_learns_pressure_and_always_plans_the_terminal():
    ctl = IntervalController(checkpoint_pages_equiv=4.0, supported=(8, 16, 32, 64), ema_alpha=0.5)
    assert ctl.pressure_ratio() == 1.0
    assert ctl.plan(10, 74) == [42, 74]  # I = 32 from the segment start, terminal 74
    ctl.kv_residence_s.observe(400.0)
    ctl.state_residence_s.observe(100.0)
    assert ctl.pressure_ratio() == 4.0
    assert ctl.plan(10, 74) == [74]
    assert ctl.plan(5, 5) == []
    assert math.isclose(continuous_optimum_pages(64, 4.0, 1.0), math.sqrt(512))


def test_state_residence_is_censored_until_a_checkpoint_leaves_the_ssd():
    ctl = IntervalController(checkpoint_pages_equiv=4.0, supported=(8, 16, 32, 64), ema_alpha=0.5)
    ctl.kv_residence_s.observe(100.0)
    assert ctl.pressure_ratio(now_s=50.0) == 1.0  # no checkpoint written yet: nothing known
    ctl.note_state_written(0.0)
    ctl.note_state_written(30.0)  # only the first write dates the censored bound
    assert ctl.pressure_ratio(now_s=400.0) == 0.25  # every state survived 400 s: T_state >= 400
    assert ctl.plan(10, 74, now_s=400.0) == [26, 42, 58, 74]  # ratio 1/4: I=8 and I=16 both cost 10.5; tie -> 16
    ctl.state_residence_s.observe(50.0)
    assert ctl.pressure_ratio(now_s=400.0) == 2.0  # observed evictions replace the bound


def test_littles_law_estimates_residence_before_any_eviction():
    """Before anything left a tier, T = capacity / insertion rate (a full FIFO tier's mean residence):
    a GPU filling at 1 GiB/s out of 45 GiB keeps KV ~45 s; an SSD filling at 0.1 GiB/s out of 150 GiB
    keeps checkpoints ~1500 s, so storing checkpoints is cheap (ratio 0.03) and eq. 5 plans densely."""
    from histate.core.interval import TierFlow

    gib = 2**30
    kv, st = TierFlow(45 * gib), TierFlow(150 * gib)
    ctl = IntervalController(24.5, (2, 4, 8, 16, 32, 64, 128, 256), 0.1, kv, st)
    assert ctl.pressure_ratio(0.0) == 1.0  # nothing known yet: the paper's neutral ratio
    kv.note(0.0, 0)
    st.note(0.0, 0)
    kv.note(10.0, 10 * gib)
    st.note(10.0, gib)
    assert abs(kv.residence_s(10.0) - 45.0) < 1e-9 and abs(st.residence_s(10.0) - 1500.0) < 1e-9
    assert abs(ctl.pressure_ratio(10.0) - 45.0 / 1500.0) < 1e-9
    dense = ctl.plan(0, 132, 10.0)
    ctl.kv_residence_s.observe(1500.0)  # observed residences replace the estimates
    ctl.state_residence_s.observe(300.0)
    assert abs(ctl.pressure_ratio(10.0) - 5.0) < 1e-9
    assert len(ctl.plan(0, 132, 10.0)) < len(dense)


def test_censored_state_age_bounds_the_littles_law_estimate_from_below():
    from histate.core.interval import TierFlow

    st = TierFlow(100)
    ctl = IntervalController(4.0, (2, 4), 0.1, TierFlow(100), st)
    ctl.kv_flow.note(0.0, 100)
    st.note(0.0, 1000)  # a fast writer: Little says checkpoints live 10 s at t = 100
    ctl.note_state_written(0.0)  # yet the first checkpoint is still there at t = 100
    assert abs(ctl.pressure_ratio(100.0) - 100.0 / 100.0) < 1e-9
