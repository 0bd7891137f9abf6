"""Which planned checkpoints one prefill forward pass captures (HiState's in-pass capture rule).

A chunked Gated-DeltaNet prefill computes the recurrent state at every chunk boundary of the pass:
the kernel cuts the pass's own tokens into 64-token chunks starting at the pass's first token (the
cached prefix), so the states it materialises sit at `start + 64 k`, plus the pass's final state.
HiState plans checkpoint positions on the absolute state grid (eq. 5 intervals, the branch point,
the terminal) and captures, inside the one pass that computes them, every planned position that is
one of those states: no extra forward pass and no chunk cut.

A planned position p inside the pass (start < p <= end) is captured when (p - start) is a multiple of
the kernel chunk. It always is when the pass starts on the grid: a cached prefix ends at a
checkpoint (on the grid by induction), and HiState floors every chunked-prefill cut to the grid (the
SGLang plugin's `chunking.py`, the simulator's SGLang engine for policies that capture in-pass). A
position off the kernel's chunk grid is dropped, never snapped: a snapped state would sit off the
grid every other checkpoint and page boundary uses. It happens only where a cut could not be floored
without emptying the chunk (SGLang then leaves the cut alone), and is counted (`off_grid`).

Of the captured positions the deepest rides in the engine's own per-pass tracking slot (SGLang's
ping-pong track buffer); the others (`extra`) take one state slot each for the pass.

Pure: positions are integers in any unit, as long as `chunk` uses the same unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True, slots=True)
class PassCaptures:
    """The planned positions of one forward pass, split by how they are captured."""

    tracked: Optional[int]
    """The deepest capturable position: the engine's one tracked state of the pass (None: no state)."""
    extra: tuple
    """The other capturable positions, ascending: one extra state slot each."""
    off_grid: tuple
    """Planned positions inside the pass that no kernel chunk boundary of the pass hits: dropped."""

    @property
    def captured(self) -> tuple:
        """Every position the pass leaves a checkpoint at, ascending."""
        return self.extra + ((self.tracked,) if self.tracked is not None else ())


def split_pass(plan: Iterable[int], start: int, end: int, chunk: int) -> PassCaptures:
    """The planned positions in (start, end] of a pass that computes tokens [start, end)."""
    if chunk <= 0 or end < start:
        raise ValueError(f"split_pass: need chunk > 0 and end >= start (chunk={chunk}, start={start}, end={end})")
    inside = sorted({p for p in plan if start < p <= end})
    on_grid = [p for p in inside if (p - start) % chunk == 0]
    off_grid = tuple(p for p in inside if (p - start) % chunk)
    if not on_grid:
        return PassCaptures(None, (), off_grid)
    return PassCaptures(on_grid[-1], tuple(on_grid[:-1]), off_grid)


def captured_positions(plan: Sequence[int], start: int, pass_ends: Sequence[int], chunk: int) -> tuple:
    """(captured, off_grid) over a prefill split into passes that end at `pass_ends` (ascending),
    the first starting at `start`: what in-pass capture leaves of `plan` for one prompt."""
    captured: list = []
    off_grid: list = []
    for end in pass_ends:
        if end <= start:
            continue
        split = split_pass(plan, start, end, chunk)
        captured.extend(split.captured)
        off_grid.extend(split.off_grid)
        start = end
    return tuple(captured), tuple(off_grid)


def floor_cut(start: int, cut_end: int, grid: int) -> int:
    """Where a chunked-prefill cut ending at `cut_end` ends once floored to the absolute `grid`, so
    the next pass starts on the kernel's chunk grid; `cut_end` itself when flooring would leave the
    pass empty (SGLang's `floor_chunked_tokens` rule: no progress is worse than an off-grid start)."""
    floored = cut_end // grid * grid
    return floored if floored > start else cut_end
