"""Paper Figure 10: ablations of HiState on the reuse-sensitive requests. Variants replace one policy
in HiState (admission: `histate-align`, `histate-fixed32`; eviction: `histate-lru-disk`). The cohort
is defined as in §4.2 from histate, vllm-disk and unlimited on the same replay. The paper uses
TraceLab, which is not available here: this runs on the Weka sessions when ../shared has them, else on
the embedded synthetic agent workload. Weka uses paper_weka.py's preset (125 sessions, gaps capped at 60 s). Bars: mean per-request hit rate and mean TTFT on the cohort.

    .venv/bin/python benchmark/ablation.py [--max-sessions 125] [--synthetic]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from histate.sim.metrics import reuse_sensitive_uids
from histate.sim.replay import ReplayConfig, replay_policies
from histate.sim.traces import LoadOptions, load_weka
from histate.sim.workloads import demo_workload

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"
VARIANTS = ("histate", "histate-align", "histate-fixed32", "histate-lru-disk")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-sessions", type=int, default=125)
    ap.add_argument("--synthetic", action="store_true", help="use the synthetic workload even if the trace exists")
    ap.add_argument("--out", type=Path, default=Path("out/ablation"))
    args = ap.parse_args()
    if TRACE.exists() and not args.synthetic:
        workload = load_weka(TRACE, LoadOptions(max_gap_s=60.0))  # the paper preset of paper_weka.py
        config = ReplayConfig(max_sessions=args.max_sessions)
    else:
        workload, config = demo_workload(), ReplayConfig()
    runs = replay_policies(workload, VARIANTS + ("vllm-disk", "unlimited"), config)
    cohort = reuse_sensitive_uids(runs)
    print(f"{workload.name}: {len(cohort)} reuse-sensitive requests")
    rows = []
    for name in VARIANTS:
        by = runs[name].by_uid()
        hit = sum(by[u].hit_rate for u in cohort) / len(cohort)
        ttft = sum(by[u].ttft_s for u in cohort) / len(cohort)
        rows.append((name, hit, ttft))
    base_ttft = rows[0][2]
    for name, hit, ttft in rows:
        print(f"{name:<18} mean hit rate {hit:6.1%}   mean TTFT {ttft:6.3f}s ({ttft / base_ttft - 1:+.1%} vs histate)")
    _plot(rows, args.out)
    return 0


def _plot(rows, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r[0] for r in rows]
    axes[0].bar(names, [r[1] for r in rows])
    axes[0].set_title("mean hit rate (reuse-sensitive)", fontsize=9)
    axes[1].bar(names, [r[2] for r in rows])
    axes[1].set_title("mean TTFT, s (reuse-sensitive)", fontsize=9)
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "figure10.png", dpi=120)
    print(f"wrote {out / 'figure10.png'}")


if __name__ == "__main__":
    sys.exit(main())
