"""Token ids of a workload's prompts, made from its page keys.

A request's prompt is the concatenation of one 64-token block per page key, then a tail for the
trailing partial page. A block's tokens are a pure function of (salt, page key): two requests carry
the same block exactly when they carry the same key, and since keys are prefix-chained
(`histate.sim.request`) they share a prompt prefix exactly when the workload says they do -- which
is what a prefix cache on a real server keys on. Tails are drawn per request (uid), so nothing past
the last full page is ever shared, as in the simulator (a partial page is never cacheable there).

Ids are uniform in [0, vocab_size). The salt (the bench seed) makes two runs' prompts disjoint, so a
server that kept its cache from an earlier run cannot hit on it.
"""
from __future__ import annotations

import random

from ..sim.request import Request


class PromptBuilder:
    def __init__(self, page_num_tokens: int, vocab_size: int, salt: int = 0) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab size must be >= 2, got {vocab_size}")
        self.page_num_tokens = page_num_tokens
        self.vocab_size = vocab_size
        self.salt = salt
        self._blocks: dict = {}  # page key -> tuple of page_num_tokens ids (pages recur every turn)

    def _draw(self, name: str, num_tokens: int) -> list:
        # Seeding with a str hashes it with SHA-512: stable across runs and platforms.
        rng = random.Random(f"histate-bench/{self.salt}/{name}")
        return rng.choices(range(self.vocab_size), k=num_tokens)

    def block(self, page_key) -> tuple:
        ids = self._blocks.get(page_key)
        if ids is None:
            ids = self._blocks[page_key] = tuple(self._draw(f"page/{page_key!r}", self.page_num_tokens))
        return ids

    def prompt(self, request: Request) -> list:
        ids: list = []
        for key in request.page_keys:
            ids.extend(self.block(key))
        tail = request.input_num_tokens - len(ids)
        if tail < 0:
            raise ValueError(f"request {request.uid}: {len(request.page_keys)} page keys need more than its "
                             f"{request.input_num_tokens} input tokens")
        ids.extend(self._draw(f"tail/{request.uid}", tail))
        return ids
