"""Issue 17: choose the options of the operator-tuned baselines on the robustness table, not on one row.

`sglang-tuned` and `vllm-current` (python/histate/core/policies/) are SGLang 0.5.23 and vLLM main as a
careful operator configures them. Their options are picked here: every candidate is replayed on the
rows of benchmark/robustness.py (same flags, seed 0 by default) and compared by the geometric mean over
rows of its p95 and p99 TTFT relative to the reference candidate (the defaults), with the hit rate
alongside. The candidates are registered only inside this script (names start with `opt-`); the
registry keeps the chosen configuration alone. docs/policies.md quotes the table this printed.

    .venv/bin/python benchmark/baseline_options.py --set sglang [--rows base gpu30 ...] [--seed 0]
        [--out out/baseline_options]     # one replay process at a time; resumable per (set, row)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import robustness  # noqa: E402  (rows and flags of the robustness table)

from histate.core import Tier, make_policy, register_policy  # noqa: E402

SglangTuned, VllmCurrent, VllmCurrentCpu = (type(make_policy(n)) for n in ("sglang-tuned", "vllm-current",
                                                                            "vllm-current-cpu"))


def _variant(base, name: str, **attrs):
    """A candidate: the kept policy's class with other option values (each names every option it
    varies, so a change of the kept defaults does not change what a candidate means)."""
    return register_policy(type(name.replace("-", "_"), (base,), {"name": name, **attrs}))


# --- sglang-tuned: eviction strategy, state cap, sessions, int8 --------------------------------------
SGLANG = {
    "opt-sgl-lru": dict(eviction_strategy="lru"),  # the reference: SGLang's defaults for these options
    "opt-sgl-nosession": dict(eviction_strategy="lru", session_refs=False),
    "opt-sgl-slru2": dict(eviction_strategy="slru", slru_protected_threshold=2),
    "opt-sgl-slru4": dict(eviction_strategy="slru", slru_protected_threshold=4),
    "opt-sgl-tlru8k": dict(eviction_strategy="tlru", tlru_threshold_tokens=8192),
    "opt-sgl-tlru32k": dict(eviction_strategy="tlru", tlru_threshold_tokens=32768, tlru_next_prompt_tokens=2048),
    "opt-sgl-cap1": dict(eviction_strategy="lru", max_states_per_path=1),
    "opt-sgl-cap2": dict(eviction_strategy="lru", max_states_per_path=2),
    "opt-sgl-cap4": dict(eviction_strategy="lru", max_states_per_path=4),
    "opt-sgl-cap8": dict(eviction_strategy="lru", max_states_per_path=8),
    # second round: the best strategy of the first (slru, threshold 2) with the state caps
    "opt-sgl-slru3": dict(eviction_strategy="slru", slru_protected_threshold=3),
    "opt-sgl-slru2-cap2": dict(eviction_strategy="slru", slru_protected_threshold=2, max_states_per_path=2),
    "opt-sgl-slru2-cap4": dict(eviction_strategy="slru", slru_protected_threshold=2, max_states_per_path=4),
    "opt-sgl-slru2-cap8": dict(eviction_strategy="slru", slru_protected_threshold=2, max_states_per_path=8),
    # int8 checkpoints cannot be combined with HiCache nor with unified memory (sglang_tuned.py): the
    # only int8 configuration is device-only with SGLang's static split.
    "opt-sgl-int8-device": dict(eviction_strategy="lru", tiers=(Tier.GPU,), shared_pool_tiers=(),
                                int8_checkpoints=True),
}
# --- vllm-current: the prefix-cache retention interval (pages; None = dense) ---------------------------
VLLM = {
    "opt-vllm-ret0": dict(retention_interval_pages=0),  # the reference: vLLM's default
    "opt-vllm-dense": dict(retention_interval_pages=None),
    "opt-vllm-ret126": dict(retention_interval_pages=126),  # 14 blocks = one full 8,192-token step
    "opt-vllm-cpu-ret0": dict(retention_interval_pages=0),
    "opt-vllm-cpu-dense": dict(retention_interval_pages=None),
    "opt-vllm-cpu-ret126": dict(retention_interval_pages=126),
}
SETS = {
    "sglang": ({name: _variant(SglangTuned, name, **attrs) for name, attrs in SGLANG.items()}, "opt-sgl-lru"),
    "vllm": ({name: _variant(VllmCurrentCpu if "-cpu-" in name else VllmCurrent, name, **attrs)
              for name, attrs in VLLM.items()}, "opt-vllm-ret0"),
}
METRICS = ("token_hit_rate", "ttft_p95_s", "ttft_p99_s")


def run_row(row: str, seed: int, policies: list, out: Path) -> dict:
    """One `histate replay` of the row in this process (the candidates are registered here)."""
    from histate.cli import main as cli_main

    summary = out / "summary.json"
    if not summary.exists():
        argv = robustness.command(row, seed, policies, out, [])[3:]  # drop `python -m histate.cli`
        if cli_main(argv) != 0:
            raise RuntimeError(f"{row} seed {seed} failed")
    return json.loads(summary.read_text())


def table(results: dict, policies: list, reference: str) -> str:
    rows = list(results)
    lines = [f"seed-0 replays; p95/p99 TTFT in s; ratio = geometric mean over the {len(rows)} rows of "
             f"p95 (p99) / {reference}'s (< 1: better)", "",
             "| candidate | " + " | ".join(rows) + " | geo p95 ratio | geo p99 ratio | mean hit |",
             "|---|" + "---|" * (len(rows) + 3)]
    for p in policies:
        cells, r95, r99, hits = [], [], [], []
        for row in rows:
            m = results[row]["policies"][p]
            ref = results[row]["policies"][reference]
            cells.append(f"{100 * m['token_hit_rate']:.1f}% {m['ttft_p95_s']:.2f}/{m['ttft_p99_s']:.2f}")
            r95.append(m["ttft_p95_s"] / ref["ttft_p95_s"])
            r99.append(m["ttft_p99_s"] / ref["ttft_p99_s"])
            hits.append(m["token_hit_rate"])
        geo = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
        lines.append(f"| {p} | " + " | ".join(cells)
                     + f" | {geo(r95):.3f} | {geo(r99):.3f} | {100 * sum(hits) / len(hits):.1f}% |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=list(SETS), required=True)
    ap.add_argument("--rows", nargs="+", default=list(robustness.ROWS), choices=list(robustness.ROWS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", help="comma-separated subset of the set's candidates (default: all)")
    ap.add_argument("--out", type=Path, default=Path("out/baseline_options"))
    args = ap.parse_args()
    variants, reference = SETS[args.set]
    policies = args.policies.split(",") if args.policies else list(variants)
    if reference not in policies:
        policies.insert(0, reference)
    rows = [r for r in args.rows if not robustness.ROWS[r][1] or robustness.TRACE.exists()]
    results = {row: run_row(row, args.seed, policies, args.out / args.set / row / f"seed{args.seed}")
               for row in rows}
    text = table(results, policies, reference)
    (args.out / args.set).mkdir(parents=True, exist_ok=True)
    (args.out / args.set / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
