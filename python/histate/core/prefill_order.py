"""Short prefills before the next chunk of a long one, with aging (HiState's opt-in prefill order).

Why: on agent traces most of the slowest first tokens are not slow prefills of their own but waits
behind a long prefill already running. A chunked prefill of a 200K-token prompt holds the whole
chunk budget for ~25 passes, and a returning session whose context is cached (a few hundred tokens
to compute) waits all of them. Letting such short prefills take their tokens first, and the long one
the rest of the pass, costs the long request little (it keeps its progress between chunks) and takes
the short ones out of its shadow.

SGLang 0.5.23 ships the mechanism without a bound: under `--schedule-policy shortest-prefill-first`
`SchedulePolicy.shortest_prefill_chunk_limit` (managers/schedule_policy.py:418-437, called by
`Scheduler.get_new_batch_prefill`, managers/scheduler.py:4176-4183) caps the continuing chunk so the
leading run of shorter waiting requests fits in the pass, leaving the long request one page. A
stream of short requests can then hold a long one at a page per pass indefinitely. This rule differs
in two ways:

* Aging. A long prefill yields on at most `max_yields` passes in a row; the next pass it runs
  uncapped and its count restarts. Its progress is therefore at least a full budget every
  `max_yields + 1` passes (plus at least one page on every pass), so its own prefill takes at most
  `max_yields + 1` times its unshared number of passes: never starved.
* What "short" means. The work of a waiting request is what it will cost to bring it to its first
  token: the tokens it must compute after HiState's match across every tier, plus the restore of the
  tokens it hits below the GPU in recompute-token equivalents (`DEFAULT_RESTORE_COST_TOKENS`,
  eq. 2 over the prefill rate). A request is short when its work is below the long request's
  remaining tokens and at most `short_max_tokens` (default: one pass's budget).

The reservation itself is SGLang's: waiting requests in queue order while each is short and fits
(charged in whole pages), stopping at the first that is not (the queue is admitted in order after
the chunk, so budget reserved past a long waiting request would go unused), and never below one page
left for the long request. The same function serves the SGLang plugin's scheduler hook and the
simulator's SGLang engine, so both cap the same chunks on the same stream.

Pure and deterministic: every TP/PP rank computes the same limit from the same queue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .config import DEFAULT_RESTORE_COST_TOKENS

DEFAULT_MAX_YIELDS = 4
"""Passes in a row a long prefill may yield before it runs one pass uncapped (module docstring)."""


def prefill_work_tokens(num_compute_tokens: int, restored_tokens_by_tier: Optional[Mapping] = None,
                        restore_cost_tokens: Mapping = DEFAULT_RESTORE_COST_TOKENS) -> float:
    """Tokens of work to a request's first token: its compute after the match plus its restores
    below the GPU in recompute-token equivalents (a tier without a cost restores for free: GPU)."""
    work = float(max(1, num_compute_tokens))  # a full hit still computes its last token
    for tier, num_tokens in (restored_tokens_by_tier or {}).items():
        work += num_tokens * restore_cost_tokens.get(tier, 0.0)
    return work


@dataclass(frozen=True, slots=True)
class ShortPrefillFirst:
    """The chunk limit of a continuing long prefill (module docstring)."""

    max_yields: int = DEFAULT_MAX_YIELDS
    short_max_tokens: Optional[int] = None  # None: one pass's budget

    def __post_init__(self) -> None:
        if self.max_yields < 0:
            raise ValueError(f"max_yields must be >= 0, got {self.max_yields}")
        if self.short_max_tokens is not None and self.short_max_tokens < 1:
            raise ValueError(f"short_max_tokens must be >= 1, got {self.short_max_tokens}")

    def chunk_limit(self, remaining_tokens: int, waiting_work_tokens: Iterable[float], budget_tokens: int,
                    page_tokens: int, yields_in_row: int, min_tokens: Optional[int] = None) -> Optional[int]:
        """Tokens the continuing chunk may take this pass, or None when it is not capped (nothing short
        waits, it ages out, or what is left of it fits beside the short ones anyway).

        `remaining_tokens`: what the long prefill still has to compute; `waiting_work_tokens`: the
        work of the requests waiting behind it, in the order they will be admitted;
        `yields_in_row`: passes in a row it has been capped so far (see `next_yields`); `min_tokens`:
        the least a capped chunk keeps (HiState's grid alignment floors a chunk to the 64-token state
        grid, so a cap under one grid would floor to nothing)."""
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        if yields_in_row >= self.max_yields or budget_tokens < 2 * page_tokens:
            return None
        short_cap = budget_tokens if self.short_max_tokens is None else self.short_max_tokens
        reserved = 0
        for work in waiting_work_tokens:
            if work >= remaining_tokens or work > short_cap:
                break
            charge = math.ceil(work / page_tokens) * page_tokens
            if reserved + charge > budget_tokens - page_tokens:
                break
            reserved += charge
        limit = (budget_tokens - reserved) // page_tokens * page_tokens
        if min_tokens is not None:
            limit = max(limit, min_tokens)
        return limit if reserved and limit < remaining_tokens else None

    @staticmethod
    def next_yields(yields_in_row: int, capped: bool) -> int:
        """The count after a pass: one more when `chunk_limit` capped the chunk, else back to zero."""
        return yields_in_row + 1 if capped else 0
