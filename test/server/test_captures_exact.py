"""Resuming from a state HiState captured inside a prefill pass gives a cold prefill's logprobs (R0).

Before the fix, SGLang's server inserted capture slots the forward never wrote: the capture list rode on
an undeclared ForwardBatch attribute that the eager runner's `dataclasses.replace` drops
(model_executor/runner/eager_runner.py:180-208), so a resumed request read whatever an earlier state
left in the slot (logprobs 2.5e-3 - 1.2e-2 off, greedy ids flipped; research/capture-live.md). The CPU
rig missed it because it fed `ForwardBatch.init_new`'s result straight to the backend.

The patterns need a tree nobody else touched (`servers.fresh`), so which state serves a hit follows
from the stream alone:
  * interval capture: X (512 new tokens), then Y = X[:256] + 149. X's pass ends at 512, where SGLang
    tracks its one state; a hit of Y strictly inside (0, 512) can only be a state captured inside X's
    pass. Z and W chain on through Y's and Z's passes.
  * branch point: S (320 tokens), X2 = S + 192, Y2 = S + 149 (diverges from X2 at 320, inside Y2's
    pass), V2 = S + 144. V2 can resume at 320 only from the state Y2's pass captured at its branch
    point (320 is neither prompt's end).
Each answer is compared with stock SGLang's cold one (radix cache disabled) to 1e-5 in fp32.
"""
from __future__ import annotations

import random

from .client import PAGE_NUM_TOKENS, assert_exact, capture_counts, tokens


def test_resuming_from_in_pass_captures_is_exact(servers):
    reference, fresh = servers.reference, servers.fresh
    rng = random.Random(3)
    x = tokens(rng, 512)
    y = x[:256] + tokens(rng, 149)
    z = y + tokens(rng, 139)
    w = z + tokens(rng, 150)
    before = capture_counts(fresh.url)
    assert assert_exact(reference, fresh, "X", x).cached_tokens == 0
    assert capture_counts(fresh.url).get("extra", 0) > before.get("extra", 0), "X's pass captured nothing extra"
    served_y = assert_exact(reference, fresh, "Y", y)
    assert 0 < served_y.cached_tokens < len(x) and served_y.cached_tokens % PAGE_NUM_TOKENS == 0, \
        f"Y resumed at {served_y.cached_tokens}: not from a state inside X's pass"
    for name, prompt in (("Z", z), ("W", w)):
        assert assert_exact(reference, fresh, name, prompt).cached_tokens > served_y.cached_tokens

    s = tokens(rng, 320)
    x2, y2, v2 = s + tokens(rng, 192), s + tokens(rng, 149), s + tokens(rng, 144)
    assert_exact(reference, fresh, "X2", x2)
    before = capture_counts(fresh.url)
    assert_exact(reference, fresh, "Y2", y2)
    assert capture_counts(fresh.url).get("extra", 0) > before.get("extra", 0), "Y2's pass captured nothing extra"
    assert assert_exact(reference, fresh, "V2", v2).cached_tokens == len(s), "V2 did not resume at the branch point"
    assert capture_counts(fresh.url).get("unfilled", 0) == 0
