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

from .client import assert_branch_point_capture_serves, assert_exact, assert_interval_capture_serves, tokens


def test_resuming_from_in_pass_captures_is_exact(servers):
    reference, fresh = servers.reference, servers.fresh
    rng = random.Random(3)
    y, served_y = assert_interval_capture_serves(reference, fresh, rng)
    z = y + tokens(rng, 139)
    w = z + tokens(rng, 150)
    for name, prompt in (("Z", z), ("W", w)):
        assert assert_exact(reference, fresh, name, prompt).cached_tokens > served_y.cached_tokens
    assert_branch_point_capture_serves(reference, fresh, rng)
