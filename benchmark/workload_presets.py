"""The measurements behind `histate replay --preset paper` and the start-up stagger, on the Weka dev
traces (../shared/traces/cc-traces-weka-042026; skips cleanly without them). docs/results.md,
"Workload presets", shows the output.

1. load: requests admitted for 125 sessions by context clip and session sampling (the paper: 3,784);
2. span: simulated replay duration and request rate by gap cap at the paper clip (the paper: ~3 h,
   0.35 requests/s), `histate` policy;
3. stagger: where the top 1% of TTFTs come from with all first-wave sessions released at t = 0
   versus one every --stagger seconds, and p99 over all / non-first requests, paper preset.

    .venv/bin/python benchmark/workload_presets.py [--seeds 0 1 2 ...] [--parts load span stagger]
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from histate.sim.costs import QWEN35_9B
from histate.sim.metrics import percentile, summarize
from histate.sim.presets import PRESETS
from histate.sim.replay import DEFAULT_STAGGER_S, ReplayConfig, admission_order, replay, sampled_roots
from histate.sim.traces import LoadOptions, load_weka

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"
PAPER = PRESETS["paper"]
PAPER_REQUESTS, PAPER_SPAN_H = 3784, 3.0
CLIPS = (100_000, 110_000, 128_000, 131_072, QWEN35_9B.native_context_num_tokens)
GAP_CAPS = (60.0, 90.0, 120.0, 150.0, None)
STAGGER_POLICIES = ("histate", "vllm-marconi", "sglang-hicache", "unlimited")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--stagger-seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--stagger", type=float, nargs="+", default=[0.0, DEFAULT_STAGGER_S, 30.0])
    ap.add_argument("--parts", nargs="+", default=["load", "span", "stagger"], choices=("load", "span", "stagger"))
    ap.add_argument("--plot", type=Path, default=Path("docs/workload_presets_stagger.png"),
                    help="TTFT tail per policy with and without the stagger (first stagger seed)")
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"SKIP: {args.trace} not found (the Weka trace lives in ../shared, which this checkout lacks)")
        return 0
    if "load" in args.parts:
        load_table(args.trace, args.seeds)
    if "span" in args.parts:
        span_table(args.trace, args.seeds)
    if "stagger" in args.parts:
        tails = stagger_table(args.trace, args.stagger_seeds, args.stagger)
        plot_tails(tails, args.plot)
    return 0


def _config(seed: int, **overrides) -> ReplayConfig:
    return ReplayConfig(max_sessions=PAPER.max_sessions, session_sampling=PAPER.session_sampling, seed=seed,
                        **overrides)


def _num_requests(roots) -> int:
    return sum(len(s.requests) for root in roots if root is not None for s in root.iter_sessions())


def load_table(trace: Path, seeds: list) -> None:
    print(f"\n== requests for {PAPER.max_sessions} sessions, mean [min, max] over seeds {seeds[0]}..{seeds[-1]} "
          f"(paper: {PAPER_REQUESTS:,})")
    print("| max context | roots kept / all | sampled from all roots | sampled from non-empty roots |")
    print("|---:|---:|---:|---:|")
    for clip in CLIPS:
        workload = load_weka(trace, LoadOptions(max_context_num_tokens=clip))
        cells = []
        for sampling in ("all", "non-empty"):
            counts = [_num_requests(sampled_roots(workload, replace(_config(seed), session_sampling=sampling)))
                      for seed in seeds]
            cells.append(f"{statistics.mean(counts):,.0f} [{min(counts):,}, {max(counts):,}]")
        print(f"| {clip:,} | {len(workload.sessions)} / {len(workload.root_ids)} | {cells[0]} | {cells[1]} |")


def span_table(trace: Path, seeds: list) -> None:
    print(f"\n== simulated span at the paper clip ({PAPER.max_context_num_tokens:,}), histate, seeds "
          f"{seeds[0]}..{seeds[-1]} (paper: {PAPER_REQUESTS:,} requests in ~{PAPER_SPAN_H:g} h, "
          f"{PAPER_REQUESTS / PAPER_SPAN_H / 3600:.2f} requests/s)")
    print("| gap cap | gaps capped | span h, median [min, max] | requests/s, median |")
    print("|---:|---:|---:|---:|")
    for cap in GAP_CAPS:
        workload = load_weka(trace, LoadOptions(max_context_num_tokens=PAPER.max_context_num_tokens, max_gap_s=cap))
        spans, rates = [], []
        for seed in tqdm(seeds, desc=f"gap cap {cap}", leave=False):
            s = summarize(replay(workload, "histate", _config(seed)))
            spans.append(s["simulated_span_s"] / 3600)
            rates.append(s["requests"] / s["simulated_span_s"])
        share = workload.stats.gaps_capped / max(workload.stats.requests, 1)
        print(f"| {'none' if cap is None else f'{cap:g} s'} | {share:.1%} | {statistics.median(spans):.2f} "
              f"[{min(spans):.2f}, {max(spans):.2f}] | {statistics.median(rates):.3f} |")


def stagger_table(trace: Path, seeds: list, staggers: list) -> dict:
    """Prints the table; returns {(stagger, policy): TTFTs} of the first seed, for the plot."""
    workload = load_weka(trace, LoadOptions(max_context_num_tokens=PAPER.max_context_num_tokens,
                                            max_gap_s=PAPER.max_gap_s))
    print(f"\n== paper preset, seeds {seeds}: median over seeds; top 1% = the slowest 1% of TTFTs; "
          f"first wave = the first request of the first 24 sessions admitted")
    print("| stagger | policy | p99 s | p99 non-first s | top 1% that are first of a session | "
          "top 1% that are first wave |")
    print("|---:|---|---:|---:|---:|---:|")
    tails = {}
    for stagger in staggers:
        for policy in STAGGER_POLICIES:
            p99, p99_nf, first_share, wave_share = [], [], [], []
            for seed in seeds:
                config = _config(seed, stagger_s=stagger)
                wave = {root.session_id for root in admission_order(workload, config)[:config.max_live_sessions]}
                run = replay(workload, policy, config)
                if seed == seeds[0]:
                    tails[(stagger, policy)] = sorted(r.ttft_s for r in run.records)
                s = summarize(run)
                cut = percentile([r.ttft_s for r in run.records], 99)
                top = [r for r in run.records if r.ttft_s >= cut]
                p99.append(s["ttft_p99_s"])
                p99_nf.append(s["ttft_p99_non_first_s"])
                first_share.append(sum(r.session_index == 0 for r in top) / len(top))
                wave_share.append(sum(r.session_index == 0 and r.session_id in wave for r in top) / len(top))
            med = statistics.median
            print(f"| {stagger:g} s | {policy} | {med(p99):.2f} | {med(p99_nf):.2f} | {med(first_share):.0%} | "
                  f"{med(wave_share):.0%} |", flush=True)
    return tails


def plot_tails(tails: dict, path: Path) -> None:
    """Upper 5% of the TTFT CDF per policy, all sessions released at t = 0 (dashed) against the
    default stagger (solid)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, policy in enumerate(STAGGER_POLICIES):
        for stagger, style in ((0.0, "--"), (DEFAULT_STAGGER_S, "-")):
            xs = tails.get((stagger, policy))
            if xs:
                ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], style, color=f"C{i}", lw=1.2,
                        label=f"{policy}, stagger {stagger:g} s")
    ax.set_ylim(0.95, 1.0)
    ax.set_xscale("log")
    ax.set_xlim(left=0.5)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Paper preset, seed 0: TTFT tail, first wave released at t = 0 vs staggered")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
