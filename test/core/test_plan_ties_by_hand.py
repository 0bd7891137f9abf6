"""Eq. 5 with learned hit positions (`interval.plan_positions`): ties go to the larger interval, on a
case worked by hand (the closed-form planner's tie rule is in test_interval_by_hand.py).

A 3-page segment from 0, N_s = 1 page, T_KV / T_state = 1 (one checkpoint costs 1), intervals {2, 4},
and a learned near-end prior p'_1 = 0.25 (a quarter of the interior hits land 1 page before the end,
at page 2); the uniform share is 0.75, spread as eq. 3's p_t = 1/L.
  * interval 4: no interior checkpoint. Uniform recompute (3 mod 4 terms: 0 + 1 + 2) / 3 = 1, times
    0.75 = 0.75; the learned hit at page 2 recomputes 2 pages, times 0.25 = 0.5. Total 1.25.
  * interval 2: a checkpoint at page 2 costs 1. Uniform recompute (0 + 1 + 0) / 3 = 1/3, times 0.75 =
    0.25; the learned hit sits on the checkpoint: 0. Total 1.25.
  * adding page 2 to the interval-4 plan saves (2 - 0) * 0.25 = 0.5 < 1: the greedy adds nothing.
Equal costs: the sparser plan (interval 4, no interior checkpoint) wins.
"""
from histate.core.interval import plan_positions, recompute_cost_pages


def test_equal_costs_keep_the_sparser_plan():
    assert recompute_cost_pages(3, 4) == 1.0 and abs(recompute_cost_pages(3, 2) - 1 / 3) < 1e-15
    assert plan_positions(0, 3, 1.0, 1.0, [2, 4], near_end_probs=[0.25]) == []
    assert plan_positions(0, 3, 1.0, 1.0, [4, 2], near_end_probs=[0.25]) == []  # whatever the order given


def test_a_cheaper_denser_plan_still_wins():
    """The same segment with N_s = 0.5: interval 2 costs 0.5 + 0.25 = 0.75 < 1.25."""
    assert plan_positions(0, 3, 0.5, 1.0, [2, 4], near_end_probs=[0.25]) == [2]


def test_a_tie_reached_only_after_the_learned_part_keeps_the_sparser_plan():
    """A tie the grid alone does not show (so the pruning of intervals whose grid cost cannot win lets
    the denser one through): a 4-page segment, one checkpoint costs 1.25 (N_s = 1.25 pages, ratio 1),
    intervals {2, 4}, p'_1 = 0.25 (page 3), uniform share 0.75.
      * interval 4: uniform (0 + 1 + 2 + 3) / 4 = 1.5, times 0.75 = 1.125; the hit at page 3 recomputes
        3 pages, times 0.25 = 0.75 (adding page 3 would save 0.75 < 1.25). Total 1.875.
      * interval 2: the checkpoint at 2 costs 1.25; uniform (0 + 1 + 0 + 1) / 4 = 0.5, times 0.75 =
        0.375 (grid alone 1.625 < 1.875: not pruned); the hit at 3 recomputes 1 page, 0.25. Total 1.875.
    Equal: the sparser plan wins."""
    assert plan_positions(0, 4, 1.25, 1.0, [2, 4], near_end_probs=[0.25]) == []
    assert plan_positions(0, 4, 1.2, 1.0, [2, 4], near_end_probs=[0.25]) == [2]  # a hair cheaper: denser
