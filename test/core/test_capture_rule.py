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


def _by_enumeration(plan, start, end, chunk):
    """The kernel's chunk boundaries, written out without `split_pass`: every `chunk` tokens counted
    from the pass's own first token (the pass end only when it is one of them); the planned positions
    among them are captured, the other planned positions inside the pass are dropped."""
    boundaries = set(range(start + chunk, end + 1, chunk))
    inside = [p for p in sorted(set(plan)) if start < p <= end]
    captured = [p for p in inside if p in boundaries]
    return captured, [p for p in inside if p not in captured]


@pytest.mark.parametrize("start", [0, 32, 64, 100, 130, 192, 200, 447])
@pytest.mark.parametrize("end", [500, 640, 704, 1000])
def test_split_pass_against_enumerated_kernel_states(start, end):
    """Every start, on and off the absolute 64-token grid: a pass starting at 32 captures 96, 160, ...,
    never 128 (an absolute-grid rule `p % chunk` would take 128 and drop 96)."""
    plan = list(range(32, 1024, 32))
    split = split_pass(plan, start, end, 64)
    captured, dropped = _by_enumeration(plan, start, end, 64)
    assert list(split.captured) == captured and list(split.off_grid) == dropped
    assert split.tracked == (captured[-1] if captured else None)


def test_a_pass_off_the_absolute_grid_by_hand():
    split = split_pass([96, 128, 160, 200, 224], 32, 224, 64)
    assert (split.tracked, split.extra, split.off_grid) == (224, (96, 160), (128, 200))
    assert captured_positions([96, 128, 160, 352], 32, [160, 352], 64) == ((96, 160, 352), (128,))
