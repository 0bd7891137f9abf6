"""Per-request cache-operation cost: HiState's SGLang cache vs stock UnifiedRadixCache, side by side.

Three caches, SGLang 0.5.23 classes on real pools (device="cpu"): HiState's (on the Python tree core,
which any component override -- HiState's included -- runs), stock `UnifiedRadixCache` on the same
Python core, and stock `UnifiedRadixCache` on the Rust core, which is what stock SGLang runs by
default (issue 29's target: HiState per request <= 1.1x it). A seeded synthetic agent workload
(histate.sim: appends, truncations, rewinds, forks) is replayed through all three, request by request,
interleaved with the order rotated, with pools small enough that steady-state requests evict. A request's cost is the thread CPU time of what the
scheduler asks of the cache: match, lock, one insert (+ re-match) per checkpoint, unlock, and the
evictions those allocations trigger.

Modes:
  same-plan  both caches insert at the positions HiState planned (the decision machinery's
             overhead on identical work);
  own-plan   each cache its own placement: HiState's plan vs SGLang's (a state per chunked-prefill
             chunk end + the prompt end), i.e. what each would do in a server.

Also prints the host-tier split for Qwen3.5-9B at a 96 GiB host budget (stock vs HiState).

    .venv/bin/python benchmark/sglang_ops.py [--sessions 24 --turns 12 --repeats 3 --plot docs/sglang_ops.png]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

from histate.core import DEFAULT_TAU_S

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _import_sglang_on_cpu() -> None:
    """SGLang imports triton unconditionally; on a CPU-only box install the CPU stubs the tests use
    (sglang_cpu/stubs.py, shared by both; never reachable from the histate package)."""
    sys.path.insert(0, ROOT)
    if importlib.util.find_spec("triton") is None:
        from sglang_cpu import stubs

        stubs.install()


def _tokens_for(token_of: dict, page_keys, page_tokens: int) -> list[int]:
    out = []
    for key in page_keys:
        base = token_of.setdefault(key, len(token_of))
        out.extend(range(base * page_tokens, (base + 1) * page_tokens))
    return out


def _sglang_positions(reused: int, total: int, kv_match: int, chunk_tokens: int, grid: int) -> list[int]:
    """Stock SGLang placement: a state at every chunk end of the chunked prefill, at the branch
    point (`mamba_branching_seqlen`: the grid position at the KV match end) and at the prompt end."""
    ends = {e // grid * grid for e in range(reused + chunk_tokens, total, chunk_tokens)}
    if reused < kv_match // grid * grid < total:
        ends.add(kv_match // grid * grid)
    return sorted(ends | {total // grid * grid})


def run_once(args, mode: str) -> dict:
    import torch

    from sglang_cpu.pools import QWEN35_LIKE_STATE, TINY_STATE, Driver, ManualClock, build_cache, build_pools, \
        publish_server_args
    from histate.sim.workloads import AgentWorkloadConfig, agent_workload
    from histate.sglang_plugin.config import resolve_config

    torch.set_num_threads(1)
    page = args.page_tokens
    publish_server_args(page_size=page, chunk_tokens=page)
    workload = agent_workload(AgentWorkloadConfig(
        num_sessions=args.sessions, num_turns=args.turns, system_prompt_num_tokens=16 * page,
        first_input_num_tokens=(16 * page, 96 * page), append_num_tokens=(4 * page, 32 * page),
        output_num_tokens=(page, 4 * page), page_num_tokens=page, cut_granularity_num_tokens=4 * page,
        truncation_rate=0.05, rewind_edit_rate=0.05, fork_rate=0.03, compaction_rate=0.0,
        max_context_num_tokens=None, seed=args.seed), name="bench")
    per_session = [s.requests for s in workload.iter_sessions()]
    requests = [r for turn in zip(*per_session) for r in turn]  # sessions interleaved by turn
    clock = ManualClock()
    caches = {}
    for kind in KINDS:
        pools = build_pools(args.kv_pages * page, args.state_slots, page_size=page, max_context=1 << 17,
                            state_shape=TINY_STATE if args.tiny_states else QWEN35_LIKE_STATE)
        if kind == "histate":
            cache = build_cache(kind, pools, clock=clock,
                                histate_config=resolve_config({"enable": True, "tau_s": args.tau}, {}))
        else:  # "stock" on the Python core, "stock-rust" on SGLang's default Rust core
            cache = build_cache("stock", pools, params_fields={"tree_core": "rust" if kind == "stock-rust" else "python"})
        caches[kind] = (cache, Driver(cache, pools), pools)
    histate_cache = caches["histate"][0]
    grid = histate_cache.histate.grid_tokens
    token_of: dict = {}
    cost_ns = {k: [] for k in caches}
    ops = {k: [] for k in caches}  # cache operations per request: the match + one insert per checkpoint
    reused = {k: 0 for k in caches}
    input_tokens = 0
    evictions_before = {k: 0 for k in caches}
    for i, request in enumerate(requests):
        clock.now = float(i)
        tokens = _tokens_for(token_of, request.page_keys, page)
        input_tokens += len(tokens)
        order = KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]  # who goes first rotates
        for kind in order:
            cache, driver, _ = caches[kind]
            if mode == "same-plan":
                plan = histate_cache.plan_checkpoints
            elif kind == "histate":
                plan = cache.plan_checkpoints
            else:  # stock, either core
                plan = lambda c, n, m: _sglang_positions(c, n, m, args.chunk_tokens, grid)  # noqa: E731
            start = time.thread_time_ns()
            outcome = driver.serve(tokens, plan=plan)
            cost_ns[kind].append(time.thread_time_ns() - start)
            ops[kind].append(1 + len(outcome.checkpoints))
            reused[kind] += outcome.reused_tokens
    for kind, (cache, _, pools) in caches.items():
        cache.sanity_check()
    evictions = histate_cache.histate.metrics.totals
    return {"mode": mode, "requests": len(requests), "cost_ns": cost_ns, "ops": ops, "reused": reused,
            "input_tokens": input_tokens,
            "histate_evictions": (evictions[("evictions_total", "checkpoint", "device")], evictions[("evictions_total", "bundle", "device")])}


KINDS = ("stock", "histate", "stock-rust")


def _pct(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def host_split_report() -> list[str]:
    from histate.sglang_plugin.host_stack import default_staging_slots, histate_host_split, stock_host_split

    gib, ckpt, kv_per_token = 2**30, 51_511_296, 32 * 1024
    budget, device = 96 * gib, 45 * gib
    device_states = device * 9 // 19  # --mamba-full-memory-ratio 0.9 (resolver fallback)
    stock = stock_host_split(budget, device - device_states, device_states, ckpt)
    ours = histate_host_split(budget, ckpt, default_staging_slots(24))
    lines = ["| host tier (96 GiB) | KV GiB | KV tokens | states GiB | state slots |", "|---|---:|---:|---:|---:|"]
    for name, split in (("stock SGLang (mirrors the 0.9 device split)", stock),
                        ("HiState (KV first, 2 x 24 staging slots)", ours)):
        lines.append(f"| {name} | {split.kv_bytes / gib:.2f} | {split.kv_tokens(kv_per_token):,} | "
                     f"{split.state_bytes / gib:.2f} | {split.state_slots} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--page-tokens", type=int, default=64)
    parser.add_argument("--kv-pages", type=int, default=1500, help="device KV pool, pages (pressure)")
    parser.add_argument("--state-slots", type=int, default=48, help="device state pool, slots")
    parser.add_argument("--chunk-tokens", type=int, default=8192, help="stock placement's chunked prefill size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tau", type=float, default=DEFAULT_TAU_S, help="HiState's eq. 7 time scale, s (--histate-tau)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-states", action="store_true",
                        help="states of ~17 KV-token equivalents instead of Qwen3.5-9B's ~1,540: the "
                             "interval controller then plans many checkpoints (a stress regime)")
    parser.add_argument("--plot", default=None, help="write a per-request cost CDF (PNG) here")
    args = parser.parse_args()
    _import_sglang_on_cpu()
    from tqdm import tqdm

    rows, last = [], {}
    for mode in ("same-plan", "own-plan"):
        runs = [run_once(args, mode) for _ in tqdm(range(args.repeats), desc=mode, leave=False)]
        stock_p50 = statistics.median(_pct(r["cost_ns"]["stock"], 0.5) for r in runs) / 1e3
        ours_p50 = statistics.median(_pct(r["cost_ns"]["histate"], 0.5) for r in runs) / 1e3
        stock_p90 = statistics.median(_pct(r["cost_ns"]["stock"], 0.9) for r in runs) / 1e3
        ours_p90 = statistics.median(_pct(r["cost_ns"]["histate"], 0.9) for r in runs) / 1e3
        ratio = statistics.median(
            statistics.median(h / s for h, s in zip(r["cost_ns"]["histate"], r["cost_ns"]["stock"])) for r in runs)
        per_op = {k: statistics.median(statistics.median(c / o for c, o in zip(r["cost_ns"][k], r["ops"][k]))
                                       for r in runs) / 1e3 for k in ("stock", "histate")}
        r0 = runs[0]
        ops_per_req = {k: sum(r0["ops"][k]) / r0["requests"] - 1 for k in ("stock", "histate")}
        rust_p50 = statistics.median(_pct(r["cost_ns"]["stock-rust"], 0.5) for r in runs) / 1e3
        rust_ratio = statistics.median(
            statistics.median(h / s for h, s in zip(r["cost_ns"]["histate"], r["cost_ns"]["stock-rust"])) for r in runs)
        rows.append((mode, r0["requests"], stock_p50, ours_p50, ours_p50 / stock_p50, ratio, stock_p90, ours_p90,
                     ops_per_req["stock"], ops_per_req["histate"], per_op["stock"], per_op["histate"],
                     r0["reused"]["stock"] / r0["input_tokens"], r0["reused"]["histate"] / r0["input_tokens"],
                     r0["histate_evictions"], rust_p50, rust_ratio, r0["reused"]["stock-rust"] / r0["input_tokens"]))
        last[mode] = r0
    n_s = "~17" if args.tiny_states else "~1,540"
    print(f"sessions={args.sessions} turns={args.turns} page={args.page_tokens} kv_pages={args.kv_pages} "
          f"state_slots={args.state_slots} state={n_s} KV-token equivalents repeats={args.repeats} "
          "(thread CPU time, medians over repeats)")
    print("| mode | requests | stock p50 µs | HiState p50 µs | p50 ratio | median per-request ratio | "
          "stock p90 µs | HiState p90 µs | checkpoints / request (stock, HiState) | "
          "µs per cache op (stock, HiState) | token hit rate (stock, HiState) | HiState evictions (ckpt, bundle) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|")
    for row in rows:
        mode, n, sp50, hp50, r50, rr, sp90, hp90, cs, ch, os_, oh, hs, hh, ev = row[:15]
        print(f"| {mode} | {n} | {sp50:.0f} | {hp50:.0f} | {r50:.2f} | {rr:.2f} | {sp90:.0f} | {hp90:.0f} | "
              f"{cs:.1f}, {ch:.1f} | {os_:.0f}, {oh:.0f} ({oh / os_:.2f}x) | {hs:.3f}, {hh:.3f} | {ev} |")
    print()
    print("stock SGLang on its default Rust tree core, same requests, same pools (the table's stock is the Python core):")
    print("| mode | stock-rust p50 µs | HiState p50 µs | median per-request ratio HiState / stock-rust | "
          "token hit rate stock-rust |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row[0]} | {row[15]:.0f} | {row[3]:.0f} | {row[16]:.2f} | {row[17]:.3f} |")
    print()
    print("\n".join(host_split_report()))
    for row in rows:  # the issue-29 target, last so a script can read it: <= 1.1
        print(f"{row[0]}: histate/stock-python per-request median ratio: {row[5]:.2f}")
        print(f"{row[0]}: histate/stock-rust per-request median ratio: {row[16]:.2f}")
    if args.plot:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for ax, (mode, run) in zip(axes, last.items()):
            for kind, style, label in (("stock", "--", "stock UnifiedRadixCache, Python core"),
                                       ("stock-rust", ":", "stock UnifiedRadixCache, Rust core (default)"),
                                       ("histate", "-", "HiStateRadixCache (Python core)")):
                values = sorted(v / 1e3 for v in run["cost_ns"][kind])
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], style, label=label)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("cache-operation CPU time per request (µs)")
            ax.set_title(mode)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[0].legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
