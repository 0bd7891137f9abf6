"""What the real-server tests send and read: SGLang's native HTTP API, nothing else.

`generate` posts token ids to `/generate` (greedy, with logprobs) and returns what a user sees: the
output ids, `meta_info.cached_tokens` and each output token's logprob. `agent_sessions` builds the
multi-turn request stream the exactness tests replay: each turn is the previous context (prompt and
answer) extended, truncated, forked from an earlier turn, or edited in the middle, as coding agents do.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PAGE_NUM_TOKENS = 64  # the servers' --page-size (sglang_cpu.server.launch defaults)
TOKEN_RANGE = (3, 500)  # ids inside the tiny model's 512-token vocabulary, clear of special ids
LOGPROB_TOLERANCE = 1e-5  # fp32: rounding is ~1e-6; a wrong state moves logprobs by ~1e-3 (capture-live.md)
ROOT = Path(__file__).resolve().parents[2]


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


def assert_exact(reference: object, served_by: object, where: str, prompt: list) -> Answer:
    """Send `prompt` to both servers: the reference (stock SGLang, radix cache disabled) answers cold;
    the other must give the same greedy ids, logprobs within LOGPROB_TOLERANCE, and a page-aligned hit.
    Returns the served answer."""
    cold, served = generate(reference.url, prompt), generate(served_by.url, prompt)
    assert cold.cached_tokens == 0, where
    assert served.output_ids == cold.output_ids, f"{where}: greedy answer differs from stock's cold one"
    gap = served.max_logprob_gap(cold)
    assert gap <= LOGPROB_TOLERANCE, f"{where} (cached {served.cached_tokens}): logprobs {gap:.2e} off a cold prefill"
    assert served.cached_tokens % PAGE_NUM_TOKENS == 0, where
    return served


def metric_series(base_url: str, name: str) -> dict:
    """{label set: value} of one metric family on SGLang's /metrics (`sglang:` prefix)."""
    text = get_text(base_url + "/metrics")
    return {labels: float(value) for labels, value in
            re.findall(rf"^sglang:{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", text, flags=re.M)}


def metric_sum(base_url: str, name: str, **labels: str) -> float:
    """Sum of the series of `name` whose labels include `labels`."""
    return sum(value for label_set, value in metric_series(base_url, name).items()
               if all(f'{k}="{v}"' in label_set for k, v in labels.items()))


def capture_counts(base_url: str) -> dict:
    """HiState's `histate_captures_total` by result (tracked, extra, unfilled, ...)."""
    counts: dict = {}
    for label_set, value in metric_series(base_url, "histate_captures_total").items():
        result = re.search(r'result="(\w+)"', label_set).group(1)
        counts[result] = counts.get(result, 0.0) + value
    return counts


def assert_interval_capture_serves(reference: object, server: object, rng: random.Random) -> tuple:
    """X (512 new tokens), then Y = X[:256] + 149, on a tree nobody touched: X's pass must capture a
    state of its own besides SGLang's one tracked position (its end), and Y must resume strictly inside
    (0, 512), which only such a capture can serve; both answers exact. Returns (Y, Y's answer)."""
    x = tokens(rng, 512)
    y = x[:256] + tokens(rng, 149)
    before = capture_counts(server.url)
    assert assert_exact(reference, server, "X", x).cached_tokens == 0
    assert capture_counts(server.url).get("extra", 0) > before.get("extra", 0), "X's pass captured nothing extra"
    served_y = assert_exact(reference, server, "Y", y)
    assert 0 < served_y.cached_tokens < len(x), f"Y resumed at {served_y.cached_tokens}: not from inside X's pass"
    return y, served_y


def assert_branch_point_capture_serves(reference: object, server: object, rng: random.Random) -> None:
    """S (320 tokens), X2 = S + 192, Y2 = S + 149 (diverges from X2 at 320, inside Y2's pass), V2 = S + 144:
    V2 can resume at 320 only from the state Y2's pass captured at its branch point (neither prompt ends
    there); every answer exact, no capture left unfilled."""
    s = tokens(rng, 320)
    x2, y2, v2 = s + tokens(rng, 192), s + tokens(rng, 149), s + tokens(rng, 144)
    assert_exact(reference, server, "X2", x2)
    before = capture_counts(server.url)
    assert_exact(reference, server, "Y2", y2)
    assert capture_counts(server.url).get("extra", 0) > before.get("extra", 0), "Y2's pass captured nothing extra"
    assert assert_exact(reference, server, "V2", v2).cached_tokens == len(s), "V2 did not resume at the branch point"
    assert capture_counts(server.url).get("unfilled", 0) == 0


def run_sglang_module(module: str, argv: list, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    """`python -m module argv...` for a client that imports sglang (bench_serving): with the project's
    CPU import stubs (sglang_cpu/stubs.py), offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "sglang_cpu" / "stubs.py"), module, *argv],
                          env=env, capture_output=True, text=True, timeout=timeout_s)


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


def serve_turn(reference: object, server: object, session: AgentSession, turn: int, seen: list,
               label: str = "") -> tuple:
    """Turn `turn` of `session` on both servers: `server`'s answer equals the cold reference's
    (`assert_exact`), and it reused no more than the longest prefix the prompt shares with a context sent
    before (`seen`, every earlier prompt and prompt + answer; extended here) nor its last token.
    Returns (where, answer, that shared-prefix bound)."""
    prompt = session.next_prompt(turn)
    where = f"{label}turn {turn} ({AgentSession.KINDS[turn]}, {len(prompt)} tokens)"
    served = assert_exact(reference, server, where, prompt)
    bound = max((common_prefix_len(prompt, context) for context in seen), default=0)
    assert served.cached_tokens <= min(bound, len(prompt) - 1), f"{where}: {served.cached_tokens} cached"
    session.record(prompt, served)
    seen.extend([prompt, session.contexts[-1]])
    return where, served, bound
