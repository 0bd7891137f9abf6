"""Where interior hits land, by absolute depth: the second half of the learned reuse-position prior.

The near-end prior (policy_state.py) learns hits that leave a trajectory a few pages before its end.
The other interior hits leave it far from the end, and on agent traffic they are not uniform: they pile
up where many prompts stop sharing -- the end of a shared system prompt and tool list, the preamble
a compacted conversation keeps, a subagent's brief. Those depths differ from one deployment to another
(each tool set has its own length) but recur within one. On the Weka sessions 127 of 816 far interior
hits land between 8K and 16K tokens (pages 128-255) and 122 in the first 2K; a checkpoint grid of 8K
(eq. 5's interval there) loses up to 8K tokens on each.

`DepthPrior` is an exponential moving average over bins of `bin_pages` absolute pages: after each
interior hit, bin b holds (1 - alpha) * its old mass plus alpha when that hit was a far hit in b. The
masses are shares of interior hits, like the near-end p'_k, so the two parts and the uniform rest sum
to one (interval.py `plan_positions`). The EMA is lazy -- one scale factor instead of touching every
bin -- so an observation costs O(1) amortised, whatever the number of bins.

Pure: integers and floats, no clock.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Optional

_RENORMALISE_BELOW = 1e-9  # rescale the lazy weights before the scale underflows
_PRUNE_BELOW = 1e-4  # a bin's mass below this is dropped at a rescale: it cannot buy a checkpoint


class DepthPrior:
    """Lazy EMA of the share of interior hits landing in each `bin_pages`-wide depth bin."""

    __slots__ = ("bin_pages", "alpha", "_weights", "_scale", "_bins")

    def __init__(self, bin_pages: int, alpha: float):
        if bin_pages <= 0 or not 0.0 < alpha <= 1.0:
            raise ValueError(f"DepthPrior: need bin_pages > 0 and alpha in (0, 1] (got {bin_pages}, {alpha})")
        self.bin_pages = bin_pages
        self.alpha = alpha
        self._weights: dict = {}  # bin index -> weight; mass = weight * scale
        self._scale = 1.0
        self._bins: Optional[tuple] = None  # cached (sorted bin indices, masses), None after a change

    def observe(self, depth_pages: Optional[int]) -> None:
        """One interior hit: a far one at `depth_pages`, or None for one the near-end prior explains
        (it still counts in the denominator: every bin's share decays)."""
        self._scale *= 1.0 - self.alpha
        if self._scale < _RENORMALISE_BELOW:
            self._rescale()
        if depth_pages is not None and depth_pages > 0:
            b = (depth_pages - 1) // self.bin_pages  # the hit resumes at depth_pages: bin of its last page
            self._weights[b] = self._weights.get(b, 0.0) + self.alpha / self._scale
        self._bins = None

    def _rescale(self) -> None:
        scale = self._scale
        self._weights = {b: w * scale for b, w in self._weights.items() if w * scale >= _PRUNE_BELOW}
        self._scale = 1.0

    def _sorted(self) -> tuple:
        if self._bins is None:
            order = sorted(self._weights)
            self._bins = (order, [self._weights[b] * self._scale for b in order])
        return self._bins

    def bins_in(self, start_pages: int, end_pages: int) -> tuple:
        """((first_page, last_page, mass), ...) for the bins with hit depths in (start, end), ascending,
        clipped to it; a clipped bin keeps the mass of its pages inside (hits are taken as uniform over
        the bin). A checkpoint at a bin's first page serves every hit in it, at most a bin late: a bin
        mixes the depths of many sessions, so its shallowest page, not one session's depth, is the
        position to plan (measured against the shallowest observed depth: docs/results.md, "Depth prior")."""
        order, masses = self._sorted()
        if end_pages - start_pages < 2 or not order:
            return ()
        width = self.bin_pages
        lo = bisect_left(order, start_pages // width)
        hi = bisect_right(order, (end_pages - 2) // width)
        out = []
        for i in range(lo, hi):
            b = order[i]
            first, last = max(b * width + 1, start_pages + 1), min((b + 1) * width, end_pages - 1)
            if first <= last:
                out.append((first, last, masses[i] * (last - first + 1) / width))
        return tuple(out)
