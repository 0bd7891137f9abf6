"""Seeded multi-turn agent workloads whose hits exercise every kind of reuse.

Each request is labeled with the operation that produced it:

  cold         first turn of a session (nothing to reuse beyond a shared system prompt)
  append       previous input + a response + a new message (hit at the previous terminal checkpoint)
  fork         a new session sharing an earlier turn of another one (hit on a shared prefix)
  truncate     an earlier input cut inside one of its messages, then a new message (hit lands inside a
               cached segment: KV matches further than the deepest checkpoint, c < m)
  rewind-edit  an earlier turn with one token of an earlier message edited, then a new message (the
               page keys diverge at the edit; reuse must stop at a checkpoint before it)
  flood        long unrelated sessions that push everyone else's KV and checkpoints down the tiers
  return       a session coming back after the flood (hits served from CPU / SSD)

Token ids are random (the model has random weights, so content does not matter; positions do).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    label: str
    session: str
    token_ids: tuple[int, ...]
    now_s: float


class _Builder:
    def __init__(self, seed: int, vocab_size: int):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.requests: list[Request] = []
        self.now_s = 0.0

    def message(self, num_tokens: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(num_tokens)]

    def emit(self, label: str, session: str, token_ids: list[int], gap_s: float = 1.0) -> list[int]:
        self.now_s += gap_s
        self.requests.append(Request(label, session, tuple(token_ids), self.now_s))
        return token_ids


def agent_mutation_workload(seed: int = 0, vocab_size: int = 512, scale: float = 1.0) -> list[Request]:
    """One timeline of 18 requests covering every label above; `scale` stretches lengths."""
    b = _Builder(seed, vocab_size)

    def n(tokens: int) -> int:
        return max(8, int(tokens * scale))

    system = b.message(n(150))
    u1, r1, u2, r2, u3 = b.message(n(260)), b.message(n(90)), b.message(n(330)), b.message(n(70)), b.message(n(240))
    a1 = b.emit("cold", "A", system + u1)
    a2 = b.emit("append", "A", a1 + r1 + u2)
    a3 = b.emit("append", "A", a2 + r2 + u3)
    b1 = b.emit("fork", "B", a1 + b.message(n(60)) + b.message(n(200)))
    # Truncate inside u2 (an earlier message), off any page boundary, then continue.
    cut = len(a1) + len(r1) + len(u2) * 3 // 5 + 1
    b.emit("truncate", "A", a3[:cut] + b.message(n(180)))
    # Rewind to turn 2 and edit one token early in u2 (behind the turn-1 checkpoint, in a different page
    # than the truncation above), then continue.
    edited = list(a2)
    edit_at = len(a1) + len(r1) + len(u2) // 4 + 3
    edited[edit_at] = (edited[edit_at] + 1) % vocab_size
    b.emit("rewind-edit", "A", edited + b.message(n(120)))
    b1b = b.emit("append", "B", b1 + b.message(n(50)) + b.message(n(150)))
    # Flood: long unrelated sessions, two turns each.
    flood = {}
    for name in ("C", "D", "E"):
        first = b.emit("cold", name, b.message(n(700)), gap_s=5.0)
        flood[name] = b.emit("append", name, first + b.message(n(60)) + b.message(n(400)), gap_s=5.0)
    # Truncate a long turn deep inside its new segment: the hit lands on an intermediate checkpoint
    # that was captured inside that turn's single prefill.
    c2 = flood["C"]
    b.emit("truncate", "C", c2[: len(c2) - n(130)] + b.message(n(50)), gap_s=5.0)
    # Returns after the flood: appends and mutations served from lower tiers.
    a6 = b.emit("return", "A", a3 + b.message(n(80)) + b.message(n(160)), gap_s=300.0)
    b.emit("return", "B", b1b + b.message(n(40)) + b.message(n(120)), gap_s=5.0)
    b.emit("truncate", "A", a6[: len(a2) + len(r2) + len(u3) // 2 + 5] + b.message(n(100)), gap_s=5.0)
    b.emit("fork", "F", a2 + b.message(n(30)) + b.message(n(90)), gap_s=5.0)
    return b.requests
