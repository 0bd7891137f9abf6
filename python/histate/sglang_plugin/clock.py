"""Time every TP/PP rank agrees on, for scores and EMAs (R2).

SGLang runs one tree per rank and needs every rank to take the same decisions (`@rank_consensus` on
match and evict; storage hits MIN-all-reduced). Eq. 7 and the interval controller read time, so each
rank reading its own `time.monotonic()` makes ranks diverge within a few thousand steps. The server
clock is therefore wall time sampled once per scheduler step and agreed: each rank contributes its
sample to the MIN all-reduce SGLang already runs every step (`_sync_hicache_ready_counts`,
unified_radix_cache.py:3412-3470, called from `check_hicache_events`), and every rank adopts the
reduced value. Between two steps the clock stands still, so every decision of a step sees the same
time on every rank. No extra collective is issued.
"""
from __future__ import annotations

import time
from typing import Callable

MS_PER_S = 1000


class AgreedClock:
    """Seconds since the first agreement; advanced only by `adopt` (the reduced sample of all ranks)."""

    def __init__(self, local_clock: Callable[[], float] = time.monotonic):
        self._local = local_clock
        self._origin_ms = None
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def sample_ms(self) -> int:
        """This rank's contribution to the agreement (integer ms: the reduction runs on int64)."""
        return int(self._local() * MS_PER_S)

    def adopt(self, agreed_ms: int) -> None:
        if self._origin_ms is None:
            self._origin_ms = agreed_ms
        self.now_s = max(self.now_s, (agreed_ms - self._origin_ms) / MS_PER_S)
