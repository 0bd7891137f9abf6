"""Paper Figure 11: the mutation microbenchmark. Sessions of 16 turns, 8K new input + 256 output
tokens per turn, 3-minute gaps, 24 live sessions; each later turn truncates the preceding prompt at a
uniform internal 256-token boundary with probability r in {0, 2, 5, 10}%. Reports, for histate and
vllm-disk (paper preset budgets), the mean TTFT of mutation requests after warm-up (the first turn of
every session is excluded), their hit rate, and the overall p99 TTFT; writes out/mutation/figure11.png.

A run has 12-82 mutation requests, so one seed is noise: every rate is replayed with several workload
seeds and the table reports the median over seeds (with the range) of each statistic and of the
per-seed TTFT change against vllm-disk.

    .venv/bin/python benchmark/mutation.py [--rates 0 0.02 0.05 0.1] [--seeds 0 1 2 3 4]

What-ifs, each taking one cause away (docs/results.md, "What the mutation gap is made of"):
`--free-restores` makes host and SSD links 10^5 GB/s; `--checkpoint-price-scale K` multiplies eq. 4's
T_KV/T_state by K in every policy's interval controller of this process (K < 1: denser checkpoints), not a
setting of HiState (no production path reads it); `--chunk-tokens N` is every engine's chunked-prefill
budget per pass (SGLang's --chunked-prefill-size, vLLM's max_num_batched_tokens; default 8,192, the size
of one turn's new input here).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from histate.core import MISS_REASONS, IntervalController
from histate.sim.costs import get_hardware
from histate.sim.engine import EngineConfig
from histate.sim.metrics import percentile
from histate.sim.replay import ReplayConfig, replay_policies
from histate.sim.request import RequestFlag
from histate.sim.workloads import mutation_microbenchmark

POLICIES = ("histate", "vllm-disk")


def mutation_stats(run) -> dict:
    muts = [r for r in run.records if r.flags & RequestFlag.MUTATION]
    ttfts = [r.ttft_s for r in run.records]
    out = {
        "mutation_requests": len(muts),
        "mutation_ttft_mean_s": sum(r.ttft_s for r in muts) / len(muts) if muts else float("nan"),
        "mutation_hit_rate": (sum(r.reused_tokens for r in muts) / sum(r.input_tokens for r in muts)) if muts else float("nan"),
        "p99_ttft_s": percentile(ttfts, 99),
    }
    for reason in MISS_REASONS:  # why mutation requests recompute (docs/misses.md): tokens per mutation request
        out[f"miss_{reason}"] = sum(r.miss_tokens[reason] for r in muts) / len(muts) if muts else float("nan")
    return out


def _reasons_text(stats: dict) -> str:
    """`reason tokens` for each reason a mutation request recomputes at least half a token of."""
    return ", ".join(f"{r} {stats['miss_' + r]:.0f}" for r in MISS_REASONS if stats["miss_" + r] >= 0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.10])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--num-sessions", type=int, default=48)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), help="first is compared with vllm-disk")
    ap.add_argument("--out", type=Path, default=Path("out/mutation"))
    ap.add_argument("--per-seed", action="store_true",
                    help="also print each seed's change and why its mutation requests recompute")
    ap.add_argument("--free-restores", action="store_true", help="what-if: host and SSD links at 10^5 GB/s")
    ap.add_argument("--checkpoint-price-scale", type=float, default=None, metavar="K",
                    help="what-if: eq. 4's T_KV/T_state times K (K < 1: denser checkpoints)")
    ap.add_argument("--chunk-tokens", type=int, default=None, metavar="N",
                    help="every engine's prefill budget per pass (default: the engines' 8,192)")
    args = ap.parse_args()
    engine = EngineConfig() if args.chunk_tokens is None else EngineConfig(token_budget_per_step=args.chunk_tokens)
    if args.checkpoint_price_scale is not None:
        _scale_checkpoint_price(args.checkpoint_price_scale)
    hardware = get_hardware("h100").with_links(h2d_gb_s=1e5, ssd_gb_s=1e5) if args.free_restores else None
    policies = list(dict.fromkeys([*args.policies, "vllm-disk"]))
    rows, summary = [], {"command": sys.argv[1:], "rates": {}}
    for rate in args.rates:
        per_seed, passes = [], []
        for seed in args.seeds:
            w = mutation_microbenchmark(rate, num_sessions=args.num_sessions, seed=seed)
            runs = replay_policies(w, policies, ReplayConfig(seed=seed, hardware_spec=hardware, engine=engine), progress=False)
            per_seed.append({p: mutation_stats(runs[p]) for p in policies})
            if "unlimited" in runs and policies[0] != "unlimited":
                passes.append(extra_pass_gap(runs[policies[0]], runs["unlimited"], engine.token_budget_per_step))
        stats = {p: {k: statistics.median(s[p][k] for s in per_seed) for k in per_seed[0][p]} for p in policies}
        rows.append((rate, stats))
        base = "vllm-disk"
        for p in policies:
            if p == base:
                continue
            changes = [s[p]["mutation_ttft_mean_s"] / s[base]["mutation_ttft_mean_s"] - 1 for s in per_seed
                       if s[p]["mutation_requests"]]
            h, d = stats[p], stats[base]
            summary["rates"].setdefault(f"{rate:g}", {})[p] = {
                "change_median": statistics.median(changes) if changes else None,
                "change_min": min(changes, default=None), "change_max": max(changes, default=None),
                **{k: h[k] for k in ("mutation_ttft_mean_s", "mutation_hit_rate", "p99_ttft_s")}}
            span = f"[{min(changes):+.1%} .. {max(changes):+.1%}]" if changes else ""
            print(f"rate {rate:>5.0%} {p:>16}: mutation requests (median) {h['mutation_requests']:>4.0f}; mean TTFT "
                  f"{h['mutation_ttft_mean_s']:.3f}s vs vllm-disk {d['mutation_ttft_mean_s']:.3f}s; change "
                  f"{statistics.median(changes) if changes else float('nan'):+.1%} {span}; hit rate "
                  f"{h['mutation_hit_rate']:.1%} vs {d['mutation_hit_rate']:.1%}; p99 TTFT "
                  f"{h['p99_ttft_s']:.2f}s vs {d['p99_ttft_s']:.2f}s  ({len(args.seeds)} seeds)", flush=True)
            print(f"{'':>24}why its mutation requests recompute (tokens per request, median over seeds): "
                  f"{_reasons_text(h)}", flush=True)
            if args.per_seed:
                for seed, s in zip(args.seeds, per_seed):
                    if s[p]["mutation_requests"]:
                        print(f"{'':>24}seed {seed}: {s[p]['mutation_ttft_mean_s'] / s[base]['mutation_ttft_mean_s'] - 1:+.1%}"
                              f" over {s[p]['mutation_requests']} requests; {_reasons_text(s[p])}", flush=True)
        if passes:
            n, more, gap_s, more_gap_s = (sum(x[i] for x in passes) for i in range(4))
            print(f"{'':>24}{policies[0]} against unlimited, all seeds: {more} of {n} mutation requests take more "
                  f"prefill passes of {engine.token_budget_per_step} tokens; they carry {more_gap_s:.2f} s of the "
                  f"{gap_s:.2f} s TTFT gap ({more_gap_s / more if more else 0:.3f} s each)", flush=True)
            summary["rates"][f"{rate:g}"]["extra_passes"] = {"requests": n, "more_passes": more, "gap_s": gap_s,
                                                             "more_passes_gap_s": more_gap_s}
    _plot(rows, args.out, policies)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'summary.json'}")
    return 0


def extra_pass_gap(run, ceiling, budget_tokens: int) -> tuple:
    """(mutation requests, those that need more prefill passes than under `ceiling`, the summed TTFT gap
    to `ceiling`, the part of it those requests carry). A pass computes at most `budget_tokens` of one
    request, so a request's first token needs ceil(computed / budget) passes, and each further pass is
    a scheduler step shared with the other running requests."""
    ceiling_by_uid = {r.uid: r for r in ceiling.records if r.flags & RequestFlag.MUTATION}
    n = more = 0
    gap_s = more_gap_s = 0.0
    for r in run.records:
        if not r.flags & RequestFlag.MUTATION:
            continue
        c = ceiling_by_uid[r.uid]
        n += 1
        gap_s += r.ttft_s - c.ttft_s
        if -(-(r.input_tokens - r.reused_tokens) // budget_tokens) > -(-(c.input_tokens - c.reused_tokens) // budget_tokens):
            more += 1
            more_gap_s += r.ttft_s - c.ttft_s
    return n, more, gap_s, more_gap_s


def _scale_checkpoint_price(scale: float) -> None:
    """What-if only: every IntervalController of this benchmark process prices a checkpoint `scale` times
    what eq. 4 says, to ask how much denser checkpoints would buy the mutation requests."""
    if not scale > 0:
        raise SystemExit(f"--checkpoint-price-scale: {scale} is not > 0")
    measured = IntervalController.pressure_ratio
    IntervalController.pressure_ratio = lambda self, now_s=None: scale * measured(self, now_s)


def _plot(rows, out: Path, policies) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [f"{r:.0%}" for r, _ in rows]
    xs = range(len(rows))
    for k, policy in enumerate(policies):
        width = 0.8 / len(policies)
        axes[0].bar([x + width * k for x in xs], [s[policy]["mutation_ttft_mean_s"] for _, s in rows], width, label=policy)
        axes[1].bar([x + width * k for x in xs], [s[policy]["p99_ttft_s"] for _, s in rows], width, label=policy)
    for ax, title in zip(axes, ("(a) mean TTFT of mutation requests (s)", "(b) overall p99 TTFT (s)")):
        ax.set_xticks([x + 0.4 - 0.4 / len(policies) for x in xs], labels)
        ax.set_xlabel("mutation rate")
        ax.set_title(title + " (median over seeds)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "figure11.png", dpi=120)
    print(f"wrote {out / 'figure11.png'}")


if __name__ == "__main__":
    sys.exit(main())
