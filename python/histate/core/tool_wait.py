"""Tool-wait residency (issue 31 item 2): keep what an agent's next turn needs through its tool wait.

Why: in a coding-agent session every turn after the first follows a gap (a tool runs, the model's
caller thinks), and the next turn resumes from where the last one ended. Eq. 7 ranks a unit by when
it was last used; during the gap the session's path ages like any other, and under pressure it goes
one cheap unit at a time while the session is about to come back (docs/results.md, the ssd75
cascade). A cache that knows the session is still coming back can keep that path until it does.

What it does, session-less (no client session ids; the same in the simulator and in SGLang's server):
  * a finished request marks the node its insert ended on as a turn end (`TurnEnd`: when it ended,
    its chain of turns and the waits that chain has shown so far);
  * a request's match looks for the nearest turn end at or a few nodes above where it ended
    (`on_resume`, a lookup only: an admission that is refused and retried looks again, and the
    latest match counts, as for miss reasons);
  * when the request finishes (`on_turn_end`) it continues that chain: the time from that turn's end
    to its match is one observed wait, for the chain and for the cache-wide prior; the turn end is
    consumed, so a second request from the same point (a branch) starts a chain of its own (with the
    waits seen so far). A request that continued no turn starts a chain;
  * the finished chain is *waiting*: it holds the path root -> its turn end the way a client session
    holds its path (core/sessions.py, SGLang's `--enable-session-radix-cache` references) until a
    deadline: the HOLD_QUANTILE of the recent waits of all chains, or CHAIN_HOLD_FACTOR times the
    chain's own longest recent wait if that is longer. A chain that has not come back by then has most
    likely ended and lets go of its path; if it comes back later it holds again as a new hold.
The executor turns holds into eviction order: a held unit ranks after every unheld one, eq. 7 ordering
each class (`HiState.score`), so a waiting turn's path goes last while anything else can go, and by
eq. 7 among waiting turns once memory is that short. An order, never a pin.

Why a deadline at a high quantile: what eq. 7 cannot know is which sessions have ended, and past a
wait longer than nearly all observed ones a chain most likely has. Measured alternatives, worse
(docs/results.md, "Tool-wait residency"): ranking a waiting path as if used at its expected return
(all sessions of the traces come back, so the order of returns is roughly the order of last use
already, and the bonus only delayed the eviction of sessions that had ended), and deadlines a few
median waits long (a live chain released early is one of the few unheld, and takes every eviction).

Pure: no clock, no I/O; time is whatever the executor passes (simulated or the agreed step clock).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Optional

CHAIN_GAPS_KEPT = 3
"""A chain remembers its last few waits (an agent's tool waits change over a session)."""

PRIOR_GAPS_KEPT = 1024
"""Recent gaps across all chains, whose high quantile bounds how long a returning turn waits."""

HOLD_QUANTILE = 0.99
"""A waiting chain holds its path until it has waited longer than this share of observed waits: past
that, it has most likely ended. Releasing a live chain is what costs (the unheld are few, so every
eviction lands on its path: measured in docs/results.md), holding an ended one for a while is cheap."""

CHAIN_HOLD_FACTOR = 2.0
"""... or, for a chain that has shown longer waits itself, this many times its longest recent one."""

HOLD_KEY = "tool-wait"
"""A waiting chain holds its path as the session reference (HOLD_KEY, chain id): never a client's
session id, so the two kinds of holder share `SessionRefs` without colliding."""

TURN_END_SEARCH_NODES = 8
"""How many nodes above a match's end are searched for the turn end it resumes. A resume lands at or
just below the previous turn's end (the next prompt appends a tool result); a match that ends far
above any turn end is a rewind or a new branch, not the same wait."""


@dataclass(slots=True)
class TurnEnd:
    """Where a finished request's insert ended, waiting for the turn that resumes it."""

    finish_s: float
    chain_id: int
    chain_gaps_s: tuple  # the waits this chain of turns showed, oldest first (at most CHAIN_GAPS_KEPT)
    is_held: bool = False  # the chain holds its path from here (it got a deadline)
    deadline_s: float = math.inf  # when a held turn lets go of its path
    is_consumed: bool = False  # a finished request continued it (a later one from here is a branch)


@dataclass(frozen=True, slots=True)
class Chain:
    """What a request carries from its match to its finish: the turn end it resumes (None: none)."""

    turn: Optional[TurnEnd]
    matched_s: float


class GapPredictor:
    """How long a waiting chain holds its path: the observed waits' HOLD_QUANTILE, or longer for a
    chain whose own waits were longer."""

    __slots__ = ("_recent_s", "_bound_s", "_num_new")

    def __init__(self) -> None:
        self._recent_s: deque = deque(maxlen=PRIOR_GAPS_KEPT)
        self._bound_s = 0.0
        self._num_new = 0

    def observe(self, gap_s: float) -> None:
        self._recent_s.append(max(0.0, gap_s))
        self._num_new += 1

    @property
    def bound_s(self) -> float:
        """HOLD_QUANTILE of the recent waits (0 before any: nothing is held without evidence);
        recomputed after every 1/64 of the window, as a sort per turn would cost more than the rest."""
        if self._num_new and (self._num_new >= PRIOR_GAPS_KEPT // 64 or not self._bound_s):
            ordered = sorted(self._recent_s)
            self._bound_s = ordered[max(0, math.ceil(HOLD_QUANTILE * len(ordered)) - 1)]  # the smallest with >= q at or below
            self._num_new = 0
        return self._bound_s

    def hold_s(self, chain_gaps_s: tuple) -> float:
        return max(self.bound_s, CHAIN_HOLD_FACTOR * max(chain_gaps_s, default=0.0))


class ToolWait:
    """The rule above over the core node shape (`parent`, `turn_end`). The executor registers a
    waiting chain's path as a session reference under the key `on_turn_end` returns, and releases the
    keys `expired` returns."""

    __slots__ = ("gaps", "_next_id", "_deadline_s", "_deadlines", "num_resumes", "num_turn_ends", "num_held",
                 "num_expired", "num_back_in_time", "num_back_late")

    def __init__(self) -> None:
        self.gaps = GapPredictor()
        self._next_id = 0
        self._deadline_s: dict = {}  # holding chain id -> its deadline
        self._deadlines: list = []   # heap of (deadline, chain id); stale entries are skipped
        self.num_resumes = 0  # finished requests that continued a turn
        self.num_turn_ends = 0
        self.num_held = 0  # turn ends that held their path
        self.num_expired = 0  # holds let go at their deadline (the chain did not come back in time)
        self.num_back_in_time = 0  # continuations of a held turn matched before its deadline
        self.num_back_late = 0  # ... after it (a hold let go too early)

    @staticmethod
    def on_resume(match_end, now_s: float) -> Chain:
        """A request's match ended at `match_end` (None: nothing matched): the turn end it would
        continue. Changes nothing."""
        node = match_end
        for _ in range(TURN_END_SEARCH_NODES):
            if node is None or node.parent is None:
                break
            if node.turn_end is not None:
                return Chain(node.turn_end, now_s)
            node = node.parent
        return Chain(None, now_s)

    def on_turn_end(self, tail, chain: Chain, now_s: float) -> Optional[tuple]:
        """A request of `chain` finished with its insert ending at `tail`: it continues the turn it
        resumed (or branches from it, or starts a chain), and the chain waits at `tail` until its
        deadline. Returns the key to hold the path with (None: nothing to hold yet)."""
        chain_id, gaps_s = self._continue(chain)
        if tail is None or tail.parent is None:
            return None
        turn = tail.turn_end = TurnEnd(now_s, chain_id, gaps_s)
        self.num_turn_ends += 1
        hold_s = self.gaps.hold_s(gaps_s)
        if hold_s <= 0.0:
            return None  # no wait observed yet: nothing predicted, nothing held
        turn.is_held = True
        self.num_held += 1
        deadline_s = turn.deadline_s = now_s + hold_s
        self._deadline_s[chain_id] = deadline_s
        heapq.heappush(self._deadlines, (deadline_s, chain_id))
        return (HOLD_KEY, chain_id)

    def _continue(self, chain: Chain) -> tuple:
        """(chain id, its waits) for a finished request of `chain`."""
        turn = chain.turn
        if turn is None or turn.is_consumed:  # a new chain, or a branch from a turn another continued
            self._next_id += 1
            return self._next_id, (turn.chain_gaps_s if turn is not None else ())
        turn.is_consumed = True
        gap_s = max(0.0, chain.matched_s - turn.finish_s)
        self.gaps.observe(gap_s)
        self.num_resumes += 1
        gaps_s = (turn.chain_gaps_s + (gap_s,))[-CHAIN_GAPS_KEPT:]
        if turn.is_held:
            if chain.matched_s <= turn.deadline_s:
                self.num_back_in_time += 1
            else:
                self.num_back_late += 1
            if turn.chain_id not in self._deadline_s:  # let go at its deadline: a hold again is a new one
                self._next_id += 1
                return self._next_id, gaps_s
        return turn.chain_id, gaps_s

    def expired(self, now_s: float) -> list:
        """Hold keys of the chains whose deadline passed without a finished next turn: release them."""
        gone = []
        heap = self._deadlines
        while heap and heap[0][0] <= now_s:
            deadline_s, chain_id = heapq.heappop(heap)
            if self._deadline_s.get(chain_id) == deadline_s:
                del self._deadline_s[chain_id]
                gone.append((HOLD_KEY, chain_id))
        self.num_expired += len(gone)
        return gone

    def is_waiting(self, hold_key: tuple) -> bool:
        return hold_key[1] in self._deadline_s

    def counts(self) -> dict:
        """What the holds did: `held` turn ends, continuations `back_in_time` (before the deadline) and
        `back_late` (after a hold was let go: the deadline was too short), `expired` holds (also those
        that came back late), `resumes` in all."""
        return {"held": self.num_held, "back_in_time": self.num_back_in_time, "back_late": self.num_back_late,
                "expired": self.num_expired, "resumes": self.num_resumes, "turn_ends": self.num_turn_ends}
