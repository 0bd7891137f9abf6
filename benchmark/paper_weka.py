"""Paper §4.2 on the Weka Claude-Code sessions (../shared/traces/cc-traces-weka-042026): `histate replay`
with a workload preset (default `paper`: 125 sessions drawn from all roots, 110,000-token clip, gaps
capped at 120 s; `paper-native`: the same at the model's 262,144-token context; docs/results.md,
"Workload presets") on the paper's system (Qwen3.5-9B, one H100, 45 GiB GPU, 96 GiB CPU, 150 GiB SSD,
24 live sessions), every policy on its own engine's scheduler (docs/policies.md), once per seed.
Prints each seed's table, then the median [min, max] over seeds (benchmark/engine_fidelity.py), and
writes summary.json, requests.csv and plots to --out/seedS. Skips cleanly without the trace.

    .venv/bin/python benchmark/paper_weka.py [--preset paper|paper-native] [--seeds 0 1 2] [--out out/paper_weka]
"""
from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

from engine_fidelity import load, table
from histate.cli import main as histate_main
from histate.sim.presets import PRESETS

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="paper")
    ap.add_argument("--policies", help="comma-separated (default: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="admission-order seeds")
    ap.add_argument("--engine", choices=("sglang", "vllm"), help="what-if: one engine for every policy")
    ap.add_argument("--out", type=Path, default=Path("out/paper_weka"))
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"SKIP: {args.trace} not found (the Weka trace lives in ../shared, which this checkout lacks)")
        return 0
    for seed in args.seeds:
        print(f"\n== seed {seed}")
        argv = ["replay", "--trace", str(args.trace), "--preset", args.preset, "--seed", str(seed),
                "--out", str(args.out / f"seed{seed}")]
        argv += ["--policies", args.policies] if args.policies else []
        argv += ["--engine", args.engine] if args.engine else []
        if histate_main(argv) != 0:
            return 1
    if len(args.seeds) > 1:
        print()
        print(table(load(args.out, args.seeds), f"`--preset {args.preset}`", counters=True))
    print(f"max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
