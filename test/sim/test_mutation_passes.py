"""benchmark/mutation.py's extra-pass attribution (docs/results.md, "What the mutation gap is made of"),
on hand-built records: a request needs ceil(computed / budget) prefill passes before its first token."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

from histate.sim.request import RequestFlag

_SPEC = importlib.util.spec_from_file_location(
    "mutation_bench", Path(__file__).resolve().parents[2] / "benchmark" / "mutation.py")
mutation_bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mutation_bench)

M = RequestFlag.MUTATION


def _run(*records):
    return SimpleNamespace(records=[SimpleNamespace(uid=u, flags=f, ttft_s=t, input_tokens=i, reused_tokens=r)
                                    for u, f, t, i, r in records])


def test_only_the_requests_that_spill_into_another_pass_carry_the_gap():
    ceiling = _run((1, M, 0.30, 20_000, 11_808),   # computes 8,192: one pass
                   (2, M, 0.40, 30_000, 21_808),   # one pass
                   (3, M, 0.50, 40_000, 23_616),   # 16,384: two passes
                   (4, 0, 0.10, 9_000, 8_000))     # not a mutation request
    run = _run((1, M, 0.45, 20_000, 11_000),       # 9,000: two passes, +0.15 s
               (2, M, 0.38, 30_000, 21_808),       # still one pass, -0.02 s
               (3, M, 0.60, 40_000, 23_000),       # 17,000: three passes against two, +0.10 s
               (4, 0, 9.00, 9_000, 0))
    n, more, gap_s, more_gap_s = mutation_bench.extra_pass_gap(run, ceiling, 8192)
    assert (n, more) == (3, 2)
    assert abs(gap_s - 0.23) < 1e-9 and abs(more_gap_s - 0.25) < 1e-9
    assert mutation_bench.extra_pass_gap(run, ceiling, 20_000)[1] == 0  # one pass each under a larger budget
