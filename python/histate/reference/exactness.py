"""What "resuming is exact" means, in numbers: the comparison every exactness test makes.

A served request is compared with a cold run of the same tokens (one uncached prefill): the logits
at the last input position and after each of a few teacher-forced decode steps (the cold run's greedy
tokens, fed to both, so an argmax tie cannot make the two runs diverge). The score is the largest
absolute difference over all those logits.

Tolerances (docs/exactness.md): "fp64" runs float64 weights and float64 GDN kernels, where a correct
resume differs from the cold run by a few ulps at most; "fp32" is deployment numerics, where GEMM
blocking and chunk padding make any split point differ by ~1e-7 relative, never bit for bit. A
checkpoint off by a single token moves the logits by ~1e-3 (research/refmodel.md), far outside both.
"""

from __future__ import annotations

from histate.reference.executor import ServedRequest
from histate.reference.runner import ColdRun

TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5}


def max_logit_diff(served: ServedRequest, cold: ColdRun) -> float:
    if len(served.decode_logits) != len(cold.decode_logits):
        raise ValueError(f"served {len(served.decode_logits)} decode steps, cold run has {len(cold.decode_logits)}")
    pairs = [(served.last_logits, cold.last_logits), *zip(served.decode_logits, cold.decode_logits)]
    return max((a - b).abs().max().item() for a, b in pairs)
