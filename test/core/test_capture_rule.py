"""The in-pass capture rule (core/capture.py), on hand-worked cases (the simulator's use of it:
test/sim/test_admission.py).

A pass over tokens [start, end) computes the state after start + 64 k tokens (k >= 1) and after end. A
planned position p in (start, end] is captured iff (p - start) is a multiple of 64; the deepest rides
in the engine's track slot, the others take a slot each; the rest are dropped (off the chunk grid).
"""
import pytest

from histate.core import captured_positions, floor_cut, split_pass

PLAN = [128, 256, 384, 512, 576]


@pytest.mark.parametrize("start, end, tracked, extra, off_grid", [
    (0, 600, 576, (128, 256, 384, 512), ()),   # one pass holds the whole plan
    (0, 576, 576, (128, 256, 384, 512), ()),   # the pass ends on the deepest: its final state
    (0, 300, 256, (128,), ()),                 # positions after the pass belong to later passes
    (256, 600, 576, (384, 512), ()),           # 256 is the prefix: not inside the pass
    (64, 300, 256, (128,), ()),                # (128 - 64) and (256 - 64) are whole chunks
    (100, 600, None, (), (128, 256, 384, 512, 576)),  # an off-grid start reaches none of them
    (0, 100, None, (), ()),                    # nothing planned inside
])
def test_split_pass(start, end, tracked, extra, off_grid):
    split = split_pass(PLAN, start, end, 64)
    assert (split.tracked, split.extra, split.off_grid) == (tracked, extra, off_grid)
    assert split.captured == extra + ((tracked,) if tracked is not None else ())


def test_captured_positions_over_passes():
    plan = [128, 256, 384, 512, 640, 768, 896, 960]
    assert captured_positions(plan, 0, [256, 512, 768, 1000], 64) == (tuple(plan), ())
    # a cut left at 300 (not floored): the next pass starts off the grid and loses what it holds
    assert captured_positions(plan, 0, [300, 1000], 64) == ((128, 256), (384, 512, 640, 768, 896, 960))


@pytest.mark.parametrize("start, cut_end, expected", [
    (0, 992, 960),     # floored to the grid
    (960, 1960, 1920),
    (960, 1000, 1000),  # flooring would leave the pass empty: the cut stays (SGLang's rule)
    (0, 960, 960),     # already on the grid
])
def test_floor_cut(start, cut_end, expected):
    assert floor_cut(start, cut_end, 64) == expected
