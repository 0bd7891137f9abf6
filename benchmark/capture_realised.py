"""Issue 16's capture check: of the interior checkpoint positions HiState plans, how many the prefill
passes realise (simulated). The simulator's `histate` keeps a planned position only when a pass of the
request computes it on a kernel chunk boundary (`histate.core.capture`, the rule the SGLang plugin runs,
proven by test/sglang/test_differential.py); chunked-prefill cuts are floored to the state grid as
`--histate-chunk-align grid` does. Target: realised / planned >= 95% on `--preset paper-native`.

    .venv/bin/python benchmark/capture_realised.py [--seeds 0 1 2] [--out out/capture_realised]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from robustness import TRACE, run_one  # noqa: E402  (one replay per (row, seed), resumable)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=Path("out/capture_realised"))
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"skipped: {TRACE} is absent (the Weka traces are not shipped)")
        return 0
    print("simulated, --preset paper-native, policy histate")
    print(f"{'seed':>4} {'planned interior':>16} {'captured':>9} {'off grid':>8} {'realised':>9}")
    worst = 1.0
    for seed in args.seeds:
        captures = run_one("base", seed, ["histate"], args.out, [])["policies"]["histate"]["captures"]
        planned, captured = captures["planned_interior"], captures["captured_interior"]
        share = captured / planned
        worst = min(worst, share)
        print(f"{seed:>4} {planned:>16,} {captured:>9,} {captures['off_grid']:>8,} {share:>9.1%}")
    print(f"lowest realised share {worst:.1%} (target >= 95%)")
    return 0 if worst >= 0.95 else 1


if __name__ == "__main__":
    raise SystemExit(main())
