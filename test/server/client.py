"""What the real-server tests send and read: SGLang's native HTTP API, nothing else.

`generate` posts token ids to `/generate` (greedy, with logprobs) and returns what a user sees: the
output ids, `meta_info.cached_tokens` and each output token's logprob. `agent_sessions` builds the
multi-turn request stream the exactness tests replay: each turn is the previous context (prompt and
answer) extended, truncated, forked from an earlier turn, or edited in the middle, as coding agents do.
"""
from __future__ import annotations

import json
import random
import urllib.request
from dataclasses import dataclass
from typing import Optional

PAGE_NUM_TOKENS = 64  # the servers' --page-size (sglang_cpu.server.launch defaults)
TOKEN_RANGE = (3, 500)  # ids inside the tiny model's 512-token vocabulary, clear of special ids


@dataclass(frozen=True)
class Answer:
    output_ids: tuple
    cached_tokens: int
    logprobs: tuple  # logprob of each output token

    def max_logprob_gap(self, other: "Answer") -> float:
        """Largest |logprob difference| over the tokens both answers agree on so far."""
        gap = 0.0
        for mine, theirs, a, b in zip(self.output_ids, other.output_ids, self.logprobs, other.logprobs):
            gap = max(gap, abs(a - b))
            if mine != theirs:
                break
        return gap


def post_json(url: str, payload: dict, timeout_s: float = 600.0) -> dict:
    request = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def get_text(url: str, timeout_s: float = 60.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def generate(base_url: str, input_ids: list, max_new_tokens: int = 8) -> Answer:
    out = post_json(base_url + "/generate", {
        "input_ids": list(input_ids), "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}})
    meta = out["meta_info"]
    return Answer(tuple(out["output_ids"]), int(meta["cached_tokens"]),
                  tuple(float(entry[0]) for entry in meta["output_token_logprobs"]))


def flush_cache(base_url: str) -> None:
    request = urllib.request.Request(base_url + "/flush_cache", b"", method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def tokens(rng: random.Random, num_tokens: int) -> list:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(num_tokens)]


def common_prefix_len(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Turn:
    session: int
    index: int
    kind: str  # first | extend | truncate | fork | mutate
    prompt: Optional[list] = None  # filled when the turn is built (it needs earlier answers)


class AgentSession:
    """One session's six turns; `next_prompt` builds turn k from the answers of turns < k."""

    KINDS = ("first", "extend", "extend", "truncate", "fork", "mutate")

    def __init__(self, session: int, system_prompt: list):
        self.session = session
        self.rng = random.Random(1000 + session)
        self.system_prompt = system_prompt
        self.contexts: list = []  # prompt + answer of each turn so far

    def next_prompt(self, index: int) -> list:
        kind = self.KINDS[index]
        rng = self.rng
        if kind == "first":
            return self.system_prompt + tokens(rng, rng.randrange(150, 260))
        last = self.contexts[-1]
        if kind == "extend":
            return last + tokens(rng, rng.randrange(90, 200))
        if kind == "truncate":  # rewind into the previous turn's prompt, then go on differently
            cut = len(self.contexts[-2]) + rng.randrange(20, 80)
            return last[:cut] + tokens(rng, rng.randrange(60, 140))
        if kind == "fork":  # a second branch from the end of turn 2
            return self.contexts[1] + tokens(rng, rng.randrange(80, 160))
        # mutate: an edit of three tokens around 60% of the context, then a new message
        edited = list(last)
        at = int(len(edited) * 0.6)
        for i in range(at, at + 3):
            low, high = TOKEN_RANGE
            edited[i] = low + (edited[i] - low + 7) % (high - low)
        return edited + tokens(rng, rng.randrange(60, 120))

    def record(self, prompt: list, answer: Answer) -> None:
        self.contexts.append(list(prompt) + list(answer.output_ids))
