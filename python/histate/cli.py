"""`histate` command line: `histate replay` answers "what hit rate and TTFT would each cache policy
give on my trace, with my GPU/CPU/SSD budgets?" (docs/results.md shows the paper preset);
`histate bench` measures the same workload on a live server, `histate compare` puts runs side by side
and `histate serve` is a CPU server (the reference executor) to bench against (docs/bench.md)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .core import (DEFAULT_CHUNK_PAGES, DEFAULT_INTERVALS_PAGES, DEFAULT_MAX_YIELDS, DEFAULT_TAU_S, STATE_GRID_TOKENS,
                   available_policies)
from .sim.costs import MODELS
from .sim.presets import PRESETS
from .sim.replay import DEFAULT_STAGGER_S, SESSION_SAMPLINGS
from .sim.traces import MAX_INPUT_NUM_TOKENS

GiB = 2**30
STDIN = Path("/dev/stdin")  # `--trace -`
DEFAULT_SIM_MODEL = "qwen3.5-9b"
NONE = "none"  # --max-gap none / --max-sessions all: override a preset's value with "no limit"


class _Parser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the flag (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(what: str, *, above=None, at_least=None, at_most=None, integer: bool = False, none_word=None):
    """An argparse type: a finite number (or a whole number) of `what` within bounds, or `none_word`."""
    bounds = " and ".join(f"{op} {bound:,}" if isinstance(bound, int) else f"{op} {bound:g}"
                          for op, bound in ((">", above), (">=", at_least), ("<=", at_most)) if bound is not None)
    expected = " ".join(w for w in ("expected", "a whole number" if integer else "a finite number",
                                    f"of {what}" if what else "", bounds) if w) + \
        (f" (or {none_word!r})" if none_word else "")

    def parse(text: str):
        if none_word is not None and text.strip().lower() == none_word:
            return NONE
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or (above is not None and value <= above) or \
                (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
            raise argparse.ArgumentTypeError(f"{expected}, got {text!r}")
        return value
    parse.__name__ = what or "number"
    return parse


def _gib(*, above=None, at_least=None):
    parse = _number("GiB", above=above, at_least=at_least)
    return lambda text: int(parse(text) * GiB)


def _policies(text: str) -> list:
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in available_policies()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; available: {', '.join(available_policies())}")
    return names


def _intervals(text: str) -> tuple:
    try:
        values = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated page counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("intervals must be positive page counts")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="histate", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "replay", help="replay a trace (or a synthetic agent workload) through every cache policy",
        description="Replay agent sessions through cache policies side by side on one simulated GPU and "
                    "print token hit rate, TTFT p50/p95/p99/mean (p95/p99 also over requests that are not "
                    "the first of their session), speedups vs vllm-marconi and the share of "
                    "unlimited's reusable tokens recovered on reuse-sensitive requests (paper §4.2). "
                    "Without --trace it replays the embedded synthetic agent workload (96 sessions x 16 turns "
                    "with truncation, rewind-and-edit, fork and compaction).")
    src = r.add_argument_group("workload")
    given = src.add_mutually_exclusive_group()
    given.add_argument("--trace", type=Path, help="trace file, directory or pipe (Weka cc-traces JSONL(.gz), "
                                                  "TraceLab, Mooncake); '-' reads standard input")
    given.add_argument("--synthetic", choices=("agent", "mutation"),
                       help="synthetic workload instead of --trace: agent (default) or the paper's mutation microbenchmark")
    src.add_argument("--format", choices=("weka", "tracelab", "mooncake"), default="weka", help="trace format (default weka)")
    src.add_argument("--mutation-rate", type=_number("", at_least=0, at_most=1),
                     help="--synthetic mutation: rate of truncations (0.05)")
    src.add_argument("--preset", choices=tuple(PRESETS), default="default",
                     help="how a trace is clipped, timed and sampled; a flag below overrides its field. "
                          + "; ".join(p.describe() for p in PRESETS.values())
                          + " (docs/results.md, workload presets)")
    src.add_argument("--max-context", type=_number("tokens", at_least=1, at_most=MAX_INPUT_NUM_TOKENS, integer=True),
                     help="max context in tokens; a session ends at its first longer request (default: the preset's, "
                          "else the model's native context: "
                          + ", ".join(f"{m.name} {m.native_context_num_tokens:,}" for m in MODELS.values()) + ")")
    src.add_argument("--max-gap", type=_number("seconds", at_least=0, none_word=NONE),
                     help="cap every think/tool gap at this many seconds, or 'none' (default: the preset's)")
    src.add_argument("--max-sessions", type=_number("sessions", at_least=1, integer=True, none_word="all"),
                     help="admit at most this many root sessions, or 'all' (default: the preset's)")
    src.add_argument("--session-sampling", choices=SESSION_SAMPLINGS,
                     help="draw --max-sessions from all roots (those the clip empties take a slot) or only "
                          "non-empty ones (default: the preset's)")
    src.add_argument("--stagger", type=_number("seconds", at_least=0), default=DEFAULT_STAGGER_S,
                     help=f"release the first wave of live sessions one every this many seconds instead of all "
                          f"at t = 0 ({DEFAULT_STAGGER_S:g})")
    src.add_argument("--seed", type=int, default=0, help="seed of the admission order and synthetic workloads (0)")
    src.add_argument("--token-scale", type=_token_scale, default=1.0,
                     help="1/k: merge every k pages of a request into one, outputs scale too (0.0625: 16 pages -> 1; "
                          "the same workload for histate replay and histate bench, docs/bench.md) (1)")
    sim = r.add_argument_group("system (defaults: the paper's setup, Qwen3.5-9B on one H100, §4.1)")
    sim.add_argument("--policies", type=_policies, default=available_policies(), help="comma-separated policies (default: all)")
    sim.add_argument("--model", default=DEFAULT_SIM_MODEL, help="qwen3.5-9b | qwen3-next-80b-a3b | tiny-qwen3.5")
    sim.add_argument("--hardware", default="h100", help="h100 | h200")
    sim.add_argument("--gpu-gib", type=_gib(above=0), default=45 * GiB, help="GPU cache pool shared by KV and states, GiB (45)")
    sim.add_argument("--cpu-gib", type=_gib(at_least=0), default=96 * GiB, help="CPU DRAM cache, GiB (96)")
    sim.add_argument("--ssd-gib", type=_gib(at_least=0), default=150 * GiB, help="SSD cache, GiB (150)")
    sim.add_argument("--h2d-gbps", type=_number("GB/s", above=0), help="host-to-device bandwidth, GB/s (--hardware's: 64)")
    sim.add_argument("--ssd-gbps", type=_number("GB/s", above=0), help="SSD bandwidth, GB/s (--hardware's: 5)")
    sim.add_argument("--max-live-sessions", type=_number("sessions", at_least=1, integer=True), default=24,
                     help="live root sessions at once (24)")
    sim.add_argument("--tau", type=_number("seconds", at_least=0), default=DEFAULT_TAU_S,
                     help=f"eq. 7 time scale tau, seconds ({DEFAULT_TAU_S:g}; sweep in docs/results.md)")
    sim.add_argument("--intervals", type=_intervals, default=DEFAULT_INTERVALS_PAGES,
                     help="supported checkpoint intervals in 64-token pages, comma-separated")
    sim.add_argument("--calibration", type=Path, help="CSV of measured prefill latency (num_tokens,context_num_tokens,latency_s) replacing the roofline")
    sim.add_argument("--engine", choices=("sglang", "vllm"),
                     help="serve every policy with this engine's scheduler and memory admission (what-if; "
                          "default: each policy's own, docs/policies.md)")
    sim.add_argument("--short-prefill-first", type=_number("passes", at_least=1, integer=True), nargs="?",
                     const=DEFAULT_MAX_YIELDS, metavar="MAX_YIELDS",
                     help="policies on SGLang's scheduler cap a continuing chunked prefill so short prefills run "
                          "first, the long one yielding at most MAX_YIELDS passes in a row "
                          f"({DEFAULT_MAX_YIELDS}; the plugin's --histate-short-prefill-first, core/prefill_order.py)")
    sim.add_argument("--chunked-prefill-size", type=_number("tokens", at_least=1, integer=True),
                     help="prefill tokens per forward step for every policy: SGLang's --chunked-prefill-size, vLLM's "
                          f"--max-num-batched-tokens ({DEFAULT_CHUNK_PAGES * STATE_GRID_TOKENS}, both engines' "
                          "default on H100/H200)")
    sim.add_argument("--long-prefill-token-threshold", type=_number("tokens", at_least=0, integer=True), default=0,
                     help="policies on vLLM's scheduler give every prefill at most this many tokens per step "
                          "(vLLM's --long-prefill-token-threshold; 0: off)")
    sim.add_argument("--enable-mixed-chunk", action="store_true",
                     help="policies on SGLang's scheduler run their running decodes in the prefill steps, each decode "
                          "taking one token off the step's chunk budget (SGLang's --enable-mixed-chunk; vLLM's "
                          "scheduler always does)")
    cl = r.add_argument_group("cluster mode (sim/cluster.py; any flag here other than the defaults turns it on)")
    cl.add_argument("--servers", type=_number("servers", at_least=1, integer=True), default=1,
                    help="simulated servers, each with the budgets above; live sessions scale with them (1)")
    cl.add_argument("--router", choices=("manual", "cache_aware"), default="manual",
                    help="sgl-model-gateway policy: manual = sticky by root session id, cache_aware (manual)")
    cl.add_argument("--l3-size-gb", type=_number("GB", at_least=0), default=0.0,
                    help="shared L3 store (Mooncake model), GB = 1e9 bytes; 0 = none. Only histate and "
                         "sglang-hicache use it (0)")
    cl.add_argument("--l3-link-gbps", type=_number("Gbit/s", above=0),
                    help="each server's link to L3 (default: an assumed 100 Gbit/s NIC; loopback measured 4.6, sim/l3_link.py)")
    cl.add_argument("--l3-op-latency-ms", type=_number("ms", at_least=0),
                    help="latency per L3 operation (default: 0.42 ms, measured on loopback, sim/l3_link.py)")
    cl.add_argument("--eviction_high_watermark_ratio", "--eviction-high-watermark-ratio", dest="eviction_high_watermark_ratio",
                    type=_number("", above=0, at_most=1), help="Mooncake master flag (0.90)")
    cl.add_argument("--eviction_ratio", "--eviction-ratio", dest="eviction_ratio", type=_number("", above=0, at_most=1),
                    help="Mooncake master flag (0.05)")
    cl.add_argument("--fail-server", type=_fail_server, metavar="K@T",
                    help="server K dies at simulated second T; also replays without the failure to compare")
    out = r.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("out/replay"), help="directory for summary.json, requests.csv and plots (out/replay)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    out.add_argument("--explain", type=_policies, metavar="POLICY[,POLICY]",
                     help="attribute every token each named policy lost against `unlimited` and against the "
                          "other named policies to its cause (KV evicted, state evicted, no checkpoint near the hit, ...); "
                          "prints a table and writes explain.json (adds `unlimited` to --policies)")
    _add_bench_parser(sub, workload_group=src)
    _add_compare_parser(sub)
    _add_serve_parser(sub)
    return ap


def _fail_server(text: str) -> tuple:
    """argparse type: K@T, a server index and a simulated time in seconds."""
    try:
        k, t = text.split("@")
        k, t = int(k), float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected K@T (server index @ seconds), got {text!r}") from None
    if k < 0 or not (math.isfinite(t) and t >= 0):
        raise argparse.ArgumentTypeError(f"expected K >= 0 and a finite T >= 0, got {text!r}")
    return k, t


def cluster_config(args):
    """The ClusterConfig the cluster flags ask for, or None when they ask for one plain server."""
    from .sim.cluster import ClusterConfig
    from .sim.l3 import DEFAULT_EVICTION_HIGH_WATERMARK_RATIO, DEFAULT_EVICTION_RATIO, L3StoreConfig
    from .sim.l3_link import GBIT, FLEET_L3_LINK, L3LinkSpec

    if args.servers == 1 and not args.l3_size_gb and args.fail_server is None:
        return None
    link = L3LinkSpec(args.l3_link_gbps * GBIT if args.l3_link_gbps else FLEET_L3_LINK.bandwidth_bytes_per_s,
                      args.l3_op_latency_ms / 1e3 if args.l3_op_latency_ms is not None
                      else FLEET_L3_LINK.op_latency_s)
    store = L3StoreConfig(int(args.l3_size_gb * 1e9),
                          args.eviction_high_watermark_ratio or DEFAULT_EVICTION_HIGH_WATERMARK_RATIO,
                          args.eviction_ratio or DEFAULT_EVICTION_RATIO)
    return ClusterConfig(args.servers, args.router, store, link, fail_server=args.fail_server)


def replay_cluster_runs(workload, policies: list, config, cluster, progress: bool) -> tuple:
    """(PolicyRun view per policy, cluster summary per policy): each policy in cluster mode, and
    without the failure too when one is asked for (moved sessions' paired TTFTs)."""
    from dataclasses import replace

    from .sim.cluster import replay_cluster
    from .sim.cluster_metrics import as_policy_run, summarize_cluster

    runs, summaries = {}, {}
    for name in policies:
        run = replay_cluster(workload, name, config, cluster)
        baseline = replay_cluster(workload, name, config, replace(cluster, fail_server=None)) \
            if cluster.fail_server is not None else None
        runs[name] = as_policy_run(run)
        summaries[name] = summarize_cluster(run, baseline)
        if progress:
            print(f"  {name}: cluster replay of {len(run.records)} requests in {run.wall_s:.1f} s", file=sys.stderr)
    return runs, summaries


def _token_scale(text: str) -> float:
    """argparse type: 1/k for a whole k (bench.scaling explains why pages cannot be split)."""
    from .bench.scaling import pages_per_scaled_page

    try:
        value = float(text)
        pages_per_scaled_page(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err) if "token scale" in str(err) else
                                         f"expected a number 1/k, got {text!r}") from None
    return value


def _positive(kind):
    """argparse type: a number of `kind` (int or float) that must be > 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value
    return parse


def _int_list(text: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError("token counts must be >= 0")
    return values


def _add_bench_parser(sub, workload_group) -> None:
    b = sub.add_parser(
        "bench", help="replay the same workloads against a live server and measure TTFT and cache hits",
        description="Replay agent sessions closed-loop against a running server (SGLang /generate or an "
                    "OpenAI-compatible /v1/completions), with the same workloads, admission and report "
                    "schema as `histate replay`; or, with --calibrate, measure the server's prefill latency "
                    "for `histate replay --calibration`. See docs/bench.md.")
    # The workload flags are replay's own (same names, defaults and meaning): bench feeds them to the
    # same load_workload(), so they are shared, not restated.
    shared = b.add_argument_group(workload_group.title)
    for action in workload_group._group_actions:
        shared._add_action(action)
    scale = b.add_argument_group("scaling and admission")
    scale.add_argument("--time-scale", type=_number("", at_least=0), default=1.0,
                       help="multiply every think/tool gap (1)")
    scale.add_argument("--max-live-sessions", type=_positive(int), default=24, help="live root sessions at once (24)")
    server = b.add_argument_group("server")
    server.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    server.add_argument("--backend", choices=("sglang", "openai"), default="sglang",
                        help="sglang: POST /generate (input_ids, meta_info.cached_tokens); openai: POST "
                             "/v1/completions with token-id prompts (vLLM, SGLang) (sglang)")
    server.add_argument("--model", help="model name for --backend openai (default: the first of /v1/models)")
    server.add_argument("--vocab-size", type=_positive(int),
                        help="token ids are drawn below this (default: the server's when it says, else 32000)")
    server.add_argument("--request-timeout", type=_number("seconds", above=0), default=600.0,
                        help="seconds per request (600)")
    server.add_argument("--retries", type=int, default=2, help="retries of a request that failed before its first token or whose stream broke (2)")
    server.add_argument("--no-flush", action="store_true", help="do not empty the server's prefix cache first")
    cal = b.add_argument_group("calibration (instead of a workload)")
    cal.add_argument("--calibrate", type=Path, metavar="CSV", help="measure prefill latency into CSV and exit")
    cal.add_argument("--calibrate-contexts", type=_int_list, help="cached context lengths, tokens (0,2048,4096,8192)")
    cal.add_argument("--calibrate-lengths", type=_int_list, help="new-token counts (64,512,2048,8192)")
    cal.add_argument("--calibrate-reps", type=_positive(int), default=2, help="repetitions of the grid (2)")
    out = b.add_argument_group("output")
    out.add_argument("--label", help="name of this run in the report (default: the server's policy, else 'live')")
    out.add_argument("--out", type=Path, default=Path("out/bench"),
                     help="directory for summary.json, requests.csv and plots (out/bench); checked before the run")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="runs of replay and bench side by side (e.g. sim vs live per policy)",
                       description="Print hit rate and TTFT p50/p95/mean per policy for every run directory "
                                   "(output of `histate replay` or `histate bench`), with TTFT ratios and hit-rate "
                                   "differences against the policy's first run (or against the first directory "
                                   "when each holds a single policy), warn when runs are not of the same "
                                   "workload, and plot the TTFT CDFs.")
    c.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories; the first is the reference")
    c.add_argument("--labels", help="comma-separated names of the runs (default: directory names)")
    c.add_argument("--out", type=Path, help="write compare.json and ttft_cdf_compare.png here")
    c.add_argument("--no-plots", action="store_true", help="skip the plot")


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the reference executor (tiny Qwen3.5 on CPU) over SGLang's /generate",
                       description="A real server on CPU to bench against: the tiny random-weight Qwen3.5 of "
                                   "histate.reference, its KV and recurrent checkpoints placed in GPU/CPU/SSD tiers "
                                   "by the chosen cache policy, SSD on disk. Serves POST /generate (SGLang subset) "
                                   "and POST /v1/completions (token-id prompts), one request at a time.")
    s.add_argument("--policy", default="histate", help="cache policy, or 'none' for no reuse (histate)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    s.add_argument("--port", type=_number("", at_least=0, at_most=65535, integer=True), default=30000,
                   help="port (30000, SGLang's default)")
    s.add_argument("--gpu-mib", type=_number("MiB", above=0), default=64.0,
                   help="'GPU' tier (model device) budget, MiB (64)")
    s.add_argument("--cpu-mib", type=_number("MiB", above=0), default=256.0, help="CPU tier budget, MiB (256)")
    s.add_argument("--ssd-mib", type=_number("MiB", above=0), default=1024.0, help="SSD tier budget, MiB (1024)")
    s.add_argument("--ssd-dir", type=Path, help="where the SSD tier's files go (default: a temporary directory)")
    s.add_argument("--ssd-backend", choices=("auto", "nixl", "file"), default="auto", help="SSD I/O backend (auto)")
    s.add_argument("--max-context", type=_number("tokens", at_least=1, integer=True), default=16384,
                   help="longest prompt accepted, tokens (16384; /get_model_info reports it and histate bench "
                        "checks a workload against it before sending anything)")
    s.add_argument("--threads", type=_positive(int), default=1, help="torch threads of the model (1)")
    s.add_argument("--check-mirror", action="store_true",
                   help="after every request, check that each tier holds exactly what the policy placed there")
    l3 = s.add_argument_group("shared L3 tier (a Mooncake store several workers share)")
    l3.add_argument("--l3-master", metavar="HOST:PORT",
                    help="Mooncake master of the shared store; each request then resumes from L3 beyond its "
                         "local hit and writes its terminal bundle there (default: no L3)")
    l3.add_argument("--l3-key-prefix", default="histate", metavar="NAME",
                    help="namespace of this deployment's objects in the store (histate)")
    l3.add_argument("--l3-pin-ttl-s", type=_number("seconds", at_least=0), default=None, metavar="S",
                    help="soft-pin TTL of each terminal state put to L3, seconds (1800, the master's default)")

    k = sub.add_parser("cluster", help="a loopback fleet: Mooncake L3, N histate serve workers, sglang-router; "
                                       "kills a worker mid-run and reports what failover costs",
                       description="Starts a Mooncake master and store service, N `histate serve` workers sharing "
                                   "it as L3, and sglang-router --policy manual in front, all on 127.0.0.1; sends "
                                   "the synthetic agent workload through the router four times (L3 without "
                                   "failure, L3 with a worker killed mid-run, no L3 with the same kill, L3 with "
                                   "the store service killed mid-run), checks every answer against a cold "
                                   "recompute, and prints per-worker hit rates and the moved sessions' next "
                                   "requests. Stops everything it started (docs/scaleout.md).")
    k.add_argument("--workers", type=_number("workers", at_least=2, integer=True), default=2, help="workers (2)")
    k.add_argument("--sessions", type=_number("sessions", at_least=1, integer=True), default=8,
                   help="agent sessions of the synthetic workload (8)")
    k.add_argument("--turns", type=_number("turns", at_least=2, integer=True), default=4, help="turns per session (4)")
    k.add_argument("--max-live-sessions", type=_number("sessions", at_least=1, integer=True),
                   help="sessions in flight at once (default: all, so every session is mid-way at the kill)")
    k.add_argument("--kill-worker", type=_number("", at_least=0, integer=True),
                   help="index of the worker SIGKILLed mid-run (default: the one that has served the most sessions)")
    k.add_argument("--kill-after", type=_number("", above=0, at_most=0.99), default=0.5,
                   help="fraction of the requests completed when it dies (0.5)")
    k.add_argument("--l3-mib", type=_number("MiB", at_least=16), default=512.0,
                   help="the store service's segment (the whole L3), MiB (512)")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--out", type=Path, default=Path("out/cluster"), help="report.md, summary.json, requests.csv, logs")
    k.add_argument("--no-progress", action="store_true")
    k.add_argument("--router-policy", choices=("manual", "round_robin", "cache_aware"), default="manual",
                   help="sglang-router policy (manual: sticky on the root session id; round_robin spreads "
                        "requests and splits sessions; cache_aware is refused, see docs/scaleout.md)")
    k.add_argument("--faults", action="store_true",
                   help="instead: every L3 fault scenario (garbage, truncated, full, slow, store-kill, "
                        "master-restart) on one cluster, one line each (histate.cluster.faults); "
                        "--workers, --sessions, --turns, --seed apply")


def resolve_workload_settings(args, model_name: str) -> dict:
    """The workload settings of this run: each flag given, else the preset's value, else the native
    context of `model_name` (a simulator model spec; raises ValueError naming the flag for combinations
    that would be ignored)."""
    from .sim.costs import get_model

    preset = PRESETS[args.preset]
    if args.trace is None:
        ignored = [flag for flag, value in (("--max-context", args.max_context), ("--max-gap", args.max_gap))
                   if value is not None]
        if args.preset != "default":
            ignored.insert(0, f"--preset {args.preset}")
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: applies to --trace only (synthetic workloads set their own)")
    if args.mutation_rate is not None and args.synthetic != "mutation":
        raise ValueError("--mutation-rate: applies to --synthetic mutation only")

    def pick(flag_value, preset_value):
        value = preset_value if flag_value is None else flag_value
        return None if value == NONE else value

    max_context = pick(args.max_context, preset.max_context_num_tokens)
    if max_context is None and args.trace is not None:
        max_context = get_model(model_name).native_context_num_tokens
    return {
        "preset": preset.name,
        "max_context_num_tokens": max_context,  # None: a synthetic workload, which sets its own
        "max_gap_s": pick(args.max_gap, preset.max_gap_s),
        "max_sessions": pick(args.max_sessions, preset.max_sessions),
        "session_sampling": pick(args.session_sampling, preset.session_sampling),
        "stagger_s": args.stagger,
    }


def load_workload(args, settings: dict):
    from .sim.traces import LoadOptions, load_trace
    from .sim.workloads import demo_workload, mutation_microbenchmark

    if args.synthetic == "mutation":
        rate = 0.05 if args.mutation_rate is None else args.mutation_rate
        return mutation_microbenchmark(rate, seed=args.seed)
    trace = args.trace
    if trace is None:
        return demo_workload(seed=args.seed)
    if str(trace) == "-":
        trace = STDIN  # the loaders read pipes as they come (histate.sim.traces)
    if not trace.exists():
        raise FileNotFoundError(f"--trace {trace}: no such file or directory")
    options = LoadOptions(max_context_num_tokens=settings["max_context_num_tokens"], max_gap_s=settings["max_gap_s"],
                          progress=not args.no_progress)
    return load_trace(trace, args.format, options)


def build_config(args, settings: dict, page_num_tokens: int):
    from dataclasses import replace

    from .core import ShortPrefillFirst
    from .sim.costs import CalibratedStepCost, PrefillProfile, get_hardware, get_model
    from .sim.replay import ReplayConfig

    model, hardware = get_model(args.model), get_hardware(args.hardware)  # unknown names fail here
    config = ReplayConfig(model=args.model, hardware=args.hardware, gpu_cache_bytes=args.gpu_gib,
                          cpu_cache_bytes=args.cpu_gib, ssd_cache_bytes=args.ssd_gib,
                          max_live_sessions=args.max_live_sessions, max_sessions=settings["max_sessions"],
                          session_sampling=settings["session_sampling"], stagger_s=settings["stagger_s"],
                          seed=args.seed, tau_s=args.tau, intervals_pages=args.intervals, engine_name=args.engine)
    if args.h2d_gbps is not None or args.ssd_gbps is not None:
        config = replace(config, hardware_spec=hardware.with_links(h2d_gb_s=args.h2d_gbps, ssd_gb_s=args.ssd_gbps))
    if getattr(args, "chunked_prefill_size", None) is not None:
        config = replace(config, engine=replace(config.engine, token_budget_per_step=args.chunked_prefill_size))
    if getattr(args, "enable_mixed_chunk", False):
        config = replace(config, engine=replace(config.engine, sglang_mixed_chunk=True))
    if getattr(args, "long_prefill_token_threshold", 0):
        config = replace(config, engine=replace(config.engine, long_prefill_token_threshold=args.long_prefill_token_threshold))
    if getattr(args, "short_prefill_first", None) is not None:
        rule = ShortPrefillFirst(max_yields=args.short_prefill_first)
        config = replace(config, engine=replace(config.engine, short_prefill_first=rule))
    if args.calibration:
        profile = PrefillProfile.from_csv(args.calibration)
        config = replace(config, step_cost=CalibratedStepCost(model, config.resolved_hardware(), profile))
    config.cache_config(page_num_tokens)  # validates the budgets and knobs (ConfigError names the field)
    return config


def plan_replay(args) -> tuple:
    """(settings, workload, config, admitted roots, roots drawn but emptied by the clip): everything
    a replay needs, with every input checked, before any policy runs. Raises ValueError / OSError
    with a one-line message naming the flag or file:line:field."""
    from .bench.scaling import scale_workload
    from .sim.replay import admission_order, sampled_roots
    from .sim.report import check_writable

    settings = resolve_workload_settings(args, args.model)
    check_writable(args.out)
    workload = scale_workload(load_workload(args, settings), args.token_scale)  # as bench scales it
    config = build_config(args, settings, workload.page_num_tokens)
    drawn, admitted = sampled_roots(workload, config), admission_order(workload, config)
    if not any(s.requests for root in admitted for s in root.iter_sessions()):
        raise ValueError(nothing_to_run(workload, settings, "replay"))
    return settings, workload, config, admitted, len(drawn) - len(admitted)


def nothing_to_run(workload, settings: dict, verb: str) -> str:
    """Why a workload has no request to run, for the one-line error."""
    over = workload.stats.requests_over_context
    if over:
        return (f"no requests to {verb}: {over:,} dropped by the max context of "
                f"{settings['max_context_num_tokens']:,} tokens (--max-context)")
    return f"no requests to {verb}: the workload has none (an empty trace?)"


def settings_record(args, settings: dict, workload, config, admitted: list, num_drawn_empty: int) -> dict:
    """summary.json's "settings": every value the run used, preset or flag, workload and system."""
    from dataclasses import asdict

    system = {k: v for k, v in asdict(config).items() if k not in ("engine", "step_cost", "hardware_spec")}
    return {**settings, "token_scale": args.token_scale, "seed": args.seed,
            "trace": str(args.trace) if args.trace else None,
            "format": args.format if args.trace else None, "workload": workload.name,
            "admitted_sessions": len(admitted), "drawn_empty_sessions": num_drawn_empty,
            "admitted_requests": sum(len(s.requests) for root in admitted for s in root.iter_sessions()),
            **system, "hardware_spec": asdict(config.resolved_hardware()), "engine": asdict(config.engine),
            "calibration": str(args.calibration) if args.calibration else None}


def replay_command(args) -> int:
    from .sim.report import build_summary, format_table, strict_json, write_outputs

    try:  # bad input is one line naming its source, and all of it is found before the replay starts
        settings, workload, config, admitted, num_drawn_empty = plan_replay(args)
    except (ValueError, OSError) as err:
        print(f"histate replay: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("histate replay: interrupted while loading the workload; nothing was replayed or written",
              file=sys.stderr)
        return 130
    stats = workload.stats
    record = settings_record(args, settings, workload, config, admitted, num_drawn_empty)
    clip = settings["max_context_num_tokens"]
    print(f"workload {workload.name}: {stats.sessions} sessions (+{stats.subagent_sessions} subagents), "
          f"{stats.requests} requests, {stats.input_tokens / 1e6:.1f}M input tokens; "
          + (f"dropped by the {clip:,}-token max context: {stats.requests_over_context} requests; " if clip else "")
          + f"malformed skipped {stats.malformed_skipped}")
    print(f"preset {settings['preset']}: admitting {len(admitted)} sessions"
          + (f" (+{num_drawn_empty} drawn but emptied by the clip)" if num_drawn_empty else "")
          + f", {record['admitted_requests']} requests; "
          + ("" if args.trace is None else "think/tool gaps as recorded; " if settings["max_gap_s"] is None
             else f"think/tool gaps capped at {settings['max_gap_s']:g} s; ")
          + f"first wave released one every {settings['stagger_s']:g} s")
    logs, policies = {}, list(args.policies)
    if args.explain:
        from .sim.explain import EvictionLog

        logs = {name: EvictionLog() for name in args.explain}
        policies += [p for p in (*args.explain, "unlimited") if p not in policies]
    try:
        cluster = cluster_config(args)
    except ValueError as err:
        print(f"histate replay: error: {err}", file=sys.stderr)
        return 2
    cluster_summaries = None
    if cluster is not None:
        if logs:
            print("histate replay: error: --explain runs on one server only (no --servers/--l3-size-gb/--fail-server)",
                  file=sys.stderr)
            return 2
        print(f"cluster mode: {cluster.num_servers} servers, router {cluster.router}, "
              f"{cluster.num_servers * args.max_live_sessions} live sessions, "
              f"L3 {cluster.l3_store.capacity_bytes / 1e9:g} GB"
              + (f" (link {cluster.l3_link.bandwidth_bytes_per_s / 1.25e8:g} Gbit/s, "
                 f"{cluster.l3_link.op_latency_s * 1e3:g} ms/op)" if cluster.has_l3 else "")
              + (f", server {cluster.fail_server[0]} fails at {cluster.fail_server[1]:g} s" if cluster.fail_server else ""))
        runs, cluster_summaries = replay_cluster_runs(workload, policies, config, cluster, not args.no_progress)
        interrupted = None
    else:
        runs, interrupted = replay_until_interrupted(workload, policies, config, not args.no_progress, logs)
    if interrupted and not runs:
        print(f"histate replay: interrupted during {interrupted}, before any policy finished; nothing written",
              file=sys.stderr)
        return 130
    summary = {**build_summary(runs), "settings": record, "workload_stats": stats.as_dict()}
    if interrupted:
        summary["interrupted"] = {"policy": interrupted, "not_replayed": policies[len(runs):]}
    print(format_table(summary))
    if cluster_summaries is not None:
        from .sim.cluster_metrics import format_cluster_table

        summary["cluster"] = cluster_summaries
        print(format_cluster_table(cluster_summaries))
    for name, run in runs.items():
        n = len(run.records)
        span_h = summary["policies"][name]["simulated_span_s"] / 3600
        print(f"  {name}: replayed {n} requests ({span_h:.2f} h simulated) in {run.wall_s:.1f} s "
              f"({n / max(run.wall_s, 1e-9):,.0f} req/s)")
    written = write_outputs(runs, summary, args.out, plots=not args.no_plots)
    if interrupted:
        print(f"histate replay: interrupted during {interrupted}; wrote the {len(runs)} policies that finished "
              f"({', '.join(runs)}) to {args.out}", file=sys.stderr)
        return 130
    if logs:
        from .sim.explain import explain, format_explain

        report = explain(workload, runs, logs, references=("unlimited", *args.explain))
        print(format_explain(report))
        path = args.out / "explain.json"
        path.write_text(json.dumps(strict_json(report), indent=1) + "\n")
        written.append(path)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def replay_until_interrupted(workload, policies: list, config, progress: bool, observers: dict) -> tuple:
    """(runs of the policies that finished, the policy Ctrl-C interrupted or None): policies run one
    after another, so an interrupted replay still has every policy it completed to report."""
    from .sim.replay import replay_policies

    runs: dict = {}
    for name in policies:
        try:
            runs.update(replay_policies(workload, [name], config, progress=progress, observers=observers))
        except KeyboardInterrupt:
            if progress:
                print(file=sys.stderr)  # end the progress bar's line
            return runs, name
    return runs, None


def bench_command(args) -> int:
    from .bench.backends import BenchError
    from .bench.run import BenchOptions, RunFailed, check_base_url, report, run_bench
    from .bench.scaling import scale_workload
    from .bench.sessions import RetryPolicy, admitted_requests
    from .sim.replay import ReplayConfig
    from .sim.report import check_writable

    try:
        check_base_url(args.base_url)
        if args.retries < 0:
            raise BenchError(f"--retries must be >= 0, got {args.retries}")
        # bench's --model names the server's model; traces are clipped at the simulator's default model's
        # native context unless --max-context says otherwise (docs/bench.md)
        settings = resolve_workload_settings(args, DEFAULT_SIM_MODEL)
        admission = ReplayConfig(max_live_sessions=args.max_live_sessions, max_sessions=settings["max_sessions"],
                                 seed=args.seed, session_sampling=settings["session_sampling"],
                                 stagger_s=settings["stagger_s"])
        options = BenchOptions(args.base_url, args.backend, args.model, args.vocab_size, args.label, admission,
                               RetryPolicy(max_attempts=args.retries + 1), args.request_timeout,
                               flush_cache=not args.no_flush, progress=not args.no_progress)
        if args.calibrate:
            return _calibrate(args, options)
        check_writable(args.out)  # before the run, not after it (the reports are written at the end)
        workload = scale_workload(load_workload(args, settings), args.token_scale, args.time_scale)
        if not admitted_requests(workload, admission):
            raise BenchError(nothing_to_run(workload, settings, "send"))
    except (BenchError, ValueError, OSError) as err:
        print(f"histate bench: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("histate bench: interrupted before the run; nothing was sent or written", file=sys.stderr)
        return 130
    stats = workload.stats
    print(f"workload {workload.name}: {stats.sessions} sessions (+{stats.subagent_sessions} subagents), "
          f"{stats.requests} requests, {stats.input_tokens / 1e6:.2f}M input tokens")
    try:
        result = run_bench(workload, options)
    except RunFailed as failed:  # the run started, then failed: write what it measured, as Ctrl-C does
        report(failed.result, args.out, plots=not args.no_plots)
        print(f"histate bench: error: {failed} (wrote the {len(failed.result.run.records)} requests completed "
              f"before it)", file=sys.stderr)
        return 2
    except BenchError as err:
        print(f"histate bench: error: {err}", file=sys.stderr)
        return 2
    report(result, args.out, plots=not args.no_plots)
    return 130 if result.interrupted else 0


def _calibrate(args, options) -> int:
    from .bench.calibrate import DEFAULT_CONTEXTS, DEFAULT_LENGTHS, calibrate_server
    from .sim.costs import PrefillProfile

    contexts = args.calibrate_contexts or DEFAULT_CONTEXTS
    lengths = args.calibrate_lengths or DEFAULT_LENGTHS
    if min(lengths) < 1:
        raise ValueError("--calibrate-lengths: every new-token count must be >= 1")
    calibrate_server(options, contexts, lengths, args.calibrate_reps, args.calibrate)
    profile = PrefillProfile.from_csv(args.calibrate)
    print(f"wrote {args.calibrate}: {profile.num_points} points, fit max relative error "
          f"{profile.max_relative_error:.1%}")
    return 0


def compare_command(args) -> int:
    from .bench.compare import compare, format_comparison, write_comparison

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else []
    try:
        warnings: list = []
        table = compare(args.dirs, labels, warnings)
        for line in warnings:
            print(line, file=sys.stderr)
        print(format_comparison(table))
        if args.out:
            written = write_comparison(table, args.dirs, labels, args.out, plots=not args.no_plots)
            print("wrote " + ", ".join(str(p) for p in written))
    except (ValueError, OSError) as err:
        print(f"histate compare: error: {err}", file=sys.stderr)
        return 2
    return 0


def _l3_settings(args) -> dict:
    """ServeConfig's L3 fields from the flags; the L3 flags without --l3-master are an error, not ignored."""
    if args.l3_master is None:
        given = [flag for flag, value in (("--l3-key-prefix", args.l3_key_prefix != "histate"),
                                          ("--l3-pin-ttl-s", args.l3_pin_ttl_s is not None)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: needs --l3-master")
        return {}
    settings = {"l3_master": args.l3_master, "l3_key_prefix": args.l3_key_prefix}
    if args.l3_pin_ttl_s is not None:
        settings["l3_pin_ttl_s"] = args.l3_pin_ttl_s
    return settings


def serve_command(args) -> int:
    from .core import Tier

    MiB = 2**20
    try:
        from .serve.engine import ServeConfig, ServingEngine
        from .serve.http import run_forever

        config = ServeConfig(args.policy, {Tier.GPU: int(args.gpu_mib * MiB), Tier.CPU: int(args.cpu_mib * MiB),
                                           Tier.SSD: int(args.ssd_mib * MiB)},
                             args.ssd_dir, args.ssd_backend, args.max_context, check_mirror=args.check_mirror,
                             num_threads=args.threads, **_l3_settings(args))
        engine = ServingEngine(config)
    except (ValueError, OSError, ImportError) as err:
        print(f"histate serve: error: {err}", file=sys.stderr)
        return 2
    info = engine.info()
    print(f"histate serve: policy {args.policy}, {info['model_path']}, vocab {info['vocab_size']}, "
          f"http://{args.host}:{args.port}", flush=True)
    try:
        run_forever(engine, args.host, args.port)
    except OSError as err:
        print(f"histate serve: error: {err}", file=sys.stderr)
        return 2
    finally:
        engine.close()
    return 0


def cluster_command(args) -> int:
    from .cluster.run import ClusterOptions, cold_output_digests, format_report, run_cluster, summarize, write_report
    from .cluster.workload import cluster_workload
    from .l3.services import unavailable_reason

    if args.router_policy == "cache_aware":
        from .cluster.policies import CACHE_AWARE_REFUSAL

        print(f"histate cluster: error: --router-policy cache_aware: {CACHE_AWARE_REFUSAL}", file=sys.stderr)
        return 2
    try:
        options = ClusterOptions(num_workers=args.workers, kill_worker=args.kill_worker, router_policy=args.router_policy,
                                 kill_after_fraction=args.kill_after,
                                 max_live_sessions=args.max_live_sessions or args.sessions,
                                 seed=args.seed, l3_segment_bytes=int(args.l3_mib * 2**20),
                                 progress=not args.no_progress)
    except ValueError as err:
        print(f"histate cluster: error: {err}", file=sys.stderr)
        return 2
    reason = unavailable_reason()
    if reason:
        print(f"histate cluster: error: {reason}", file=sys.stderr)
        return 2
    from .cluster.router import router_executable

    if router_executable() is None:
        print("histate cluster: error: sglang-router is not installed (make venv installs it)", file=sys.stderr)
        return 2
    if args.faults:
        return _cluster_faults(args)
    workload = cluster_workload(args.sessions, args.turns, args.seed)
    runs = run_cluster(workload, options, args.out / "logs")
    summary = summarize(runs, cold_output_digests(workload, args.seed))
    write_report(summary, runs, args.out)
    print(format_report(summary))
    print(f"wrote {args.out}/report.md, summary.json, requests.csv")
    return 0


def _cluster_faults(args) -> int:
    """`histate cluster --faults`: one line per scenario; exit 1 when any answer was wrong, a fault did
    not fire, or a request stalled past the bound."""
    from .cluster.faults import STALL_BOUND_S, FaultOptions, fired_count, format_line, run_faults

    results = run_faults(FaultOptions(num_workers=args.workers, sessions=args.sessions, turns=args.turns,
                                      seed=args.seed, progress=not args.no_progress), args.out / "fault-logs")
    failed = False
    for r in results:
        print(format_line(r))
        fired = fired_count(r)
        failed |= r.wrong > 0 or (fired is not None and fired <= 0) or r.max_ttft_s >= STALL_BOUND_S
    print(f"stall bound {STALL_BOUND_S:g} s; " + ("FAILED" if failed else "every fault a miss, 0 wrong answers"))
    return 1 if failed else 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"replay": replay_command, "bench": bench_command, "compare": compare_command,
                "serve": serve_command, "cluster": cluster_command}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
