"""The `histate` argument parser: one subcommand per verb (replay, bench, compare, serve, cluster), with
the flags, defaults and help text users see."""
from __future__ import annotations

import argparse
from pathlib import Path

from histate.cli.arg_types import (GiB, NONE, OneLineErrorParser, fail_server, gib, int_list, intervals, number, plot_policies, policy_list,
                                   positive, token_scale)
from histate.core import (DEFAULT_CHUNK_PAGES, DEFAULT_INTERVALS_PAGES, DEFAULT_MAX_YIELDS, DEFAULT_TAU_S,
                          STATE_GRID_TOKENS, available_policies)
from histate.sim.costs import MODELS
from histate.sim.presets import PRESETS
from histate.sim.replay import DEFAULT_STAGGER_S, SESSION_SAMPLINGS
from histate.sim.traces import MAX_INPUT_NUM_TOKENS

DEFAULT_SIM_MODEL = "qwen3.5-9b"
DESCRIPTION = """`histate` command line: `histate replay` answers "what hit rate and TTFT would each cache policy
give on my trace, with my GPU/CPU/SSD budgets?" (docs/results.md shows the paper preset);
`histate bench` measures the same workload on a live server, `histate compare` puts runs side by side
and `histate serve` is a CPU server (the reference executor) to bench against (docs/bench.md)."""


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineErrorParser(prog="histate", description=DESCRIPTION)
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
    src.add_argument("--system-prompt-tokens", type=number("tokens", at_least=0, at_most=65536, integer=True),
                     help="synthetic agent workload: tokens of the system prompt every session shares (4096; a "
                          "multiple of 64). 4096 falls on eq. 5's power-of-two grid; 4992 (SGLang #37198) does not")
    src.add_argument("--checkpoint-hints", choices=("off", "system-prompt"), default="off",
                     help="synthetic agent workload: each request names the end of the shared system prompt as a "
                          "checkpoint position, as an application using the server's hints API would "
                          "(docs/hints.md; policies without the API ignore it; default off)")
    src.add_argument("--mutation-rate", type=number("", at_least=0, at_most=1),
                     help="--synthetic mutation: rate of truncations (0.05)")
    src.add_argument("--preset", choices=tuple(PRESETS), default="default",
                     help="how a trace is clipped, timed and sampled; a flag below overrides its field. "
                          + "; ".join(p.describe() for p in PRESETS.values())
                          + " (docs/results.md, workload presets)")
    src.add_argument("--max-context", type=number("tokens", at_least=1, at_most=MAX_INPUT_NUM_TOKENS, integer=True),
                     help="max context in tokens; a session ends at its first longer request (default: the preset's, "
                          "else the model's native context: "
                          + ", ".join(f"{m.name} {m.native_context_num_tokens:,}" for m in MODELS.values()) + ")")
    src.add_argument("--max-gap", type=number("seconds", at_least=0, none_word=NONE),
                     help="cap every think/tool gap at this many seconds, or 'none' (default: the preset's)")
    src.add_argument("--max-sessions", type=number("sessions", at_least=1, integer=True, none_word="all"),
                     help="admit at most this many root sessions, or 'all' (default: the preset's)")
    src.add_argument("--session-sampling", choices=SESSION_SAMPLINGS,
                     help="draw --max-sessions from all roots (those the clip empties take a slot) or only "
                          "non-empty ones (default: the preset's)")
    src.add_argument("--stagger", type=number("seconds", at_least=0), default=DEFAULT_STAGGER_S,
                     help=f"release the first wave of live sessions one every this many seconds instead of all "
                          f"at t = 0 ({DEFAULT_STAGGER_S:g})")
    src.add_argument("--seed", type=int, default=0, help="seed of the admission order and synthetic workloads (0)")
    src.add_argument("--token-scale", type=token_scale, default=1.0,
                     help="1/k: merge every k pages of a request into one, outputs scale too (0.0625: 16 pages -> 1; "
                          "the same workload for histate replay and histate bench, docs/bench.md) (1)")
    sim = r.add_argument_group("system (defaults: the paper's setup, Qwen3.5-9B on one H100, §4.1)")
    sim.add_argument("--policies", type=policy_list, default=available_policies(), help="comma-separated policies (default: all)")
    sim.add_argument("--model", default=DEFAULT_SIM_MODEL, help="qwen3.5-9b | qwen3-next-80b-a3b | tiny-qwen3.5")
    sim.add_argument("--hardware", default="h100", help="h100 | h200")
    sim.add_argument("--gpu-gib", type=gib(above=0), default=45 * GiB, help="GPU cache pool shared by KV and states, GiB (45)")
    sim.add_argument("--cpu-gib", type=gib(at_least=0), default=96 * GiB, help="CPU DRAM cache, GiB (96)")
    sim.add_argument("--ssd-gib", type=gib(at_least=0), default=150 * GiB, help="SSD cache, GiB (150)")
    sim.add_argument("--h2d-gbps", type=number("GB/s", above=0), help="host-to-device bandwidth, GB/s (--hardware's: 64)")
    sim.add_argument("--ssd-gbps", type=number("GB/s", above=0), help="SSD bandwidth, GB/s (--hardware's: 5)")
    sim.add_argument("--max-live-sessions", type=number("sessions", at_least=1, integer=True), default=24,
                     help="live root sessions at once (24)")
    sim.add_argument("--tau", type=number("seconds", at_least=0), default=DEFAULT_TAU_S,
                     help=f"eq. 7 time scale tau, seconds ({DEFAULT_TAU_S:g}; sweep in docs/results.md)")
    sim.add_argument("--intervals", type=intervals, default=DEFAULT_INTERVALS_PAGES,
                     help="supported checkpoint intervals in 64-token pages, comma-separated")
    sim.add_argument("--calibration", type=Path, help="CSV of measured prefill latency (num_tokens,context_num_tokens,latency_s) replacing the roofline")
    sim.add_argument("--engine", choices=("sglang", "vllm"),
                     help="serve every policy with this engine's scheduler and memory admission (what-if; "
                          "default: each policy's own, docs/policies.md)")
    sim.add_argument("--short-prefill-first", type=number("passes", at_least=1, integer=True), nargs="?",
                     const=DEFAULT_MAX_YIELDS, metavar="MAX_YIELDS",
                     help="policies on SGLang's scheduler cap a continuing chunked prefill so short prefills run "
                          "first, the long one yielding at most MAX_YIELDS passes in a row "
                          f"({DEFAULT_MAX_YIELDS}; the plugin's --histate-short-prefill-first, core/prefill_order.py)")
    sim.add_argument("--tool-wait-prefetch", choices=("on", "off"), default="off",
                     help="tool-wait residency: a finished turn's path is held, ranked after everything unheld, "
                          "until its next turn is unlikely to come (the 99th percentile of observed waits, or twice "
                          "the chain's own longest); core/tool_wait.py, the plugin's --histate-tool-wait-prefetch; "
                          "policies that read it: the histate family (off)")
    sim.add_argument("--chunked-prefill-size", type=number("tokens", at_least=1, integer=True),
                     help="prefill tokens per forward step for every policy: SGLang's --chunked-prefill-size, vLLM's "
                          f"--max-num-batched-tokens ({DEFAULT_CHUNK_PAGES * STATE_GRID_TOKENS}, both engines' "
                          "default on H100/H200)")
    sim.add_argument("--long-prefill-token-threshold", type=number("tokens", at_least=0, integer=True), default=0,
                     help="policies on vLLM's scheduler give every prefill at most this many tokens per step "
                          "(vLLM's --long-prefill-token-threshold; 0: off)")
    sim.add_argument("--enable-mixed-chunk", action="store_true",
                     help="policies on SGLang's scheduler run their running decodes in the prefill steps, each decode "
                          "taking one token off the step's chunk budget (SGLang's --enable-mixed-chunk; vLLM's "
                          "scheduler always does)")
    cl = r.add_argument_group("cluster mode (sim/cluster.py; any flag here other than the defaults turns it on)")
    cl.add_argument("--servers", type=number("servers", at_least=1, integer=True), default=1,
                    help="simulated servers, each with the budgets above; live sessions scale with them (1)")
    cl.add_argument("--router", choices=("manual", "cache_aware"), default="manual",
                    help="sgl-model-gateway policy: manual = sticky by root session id, cache_aware (manual)")
    cl.add_argument("--l3-size-gb", type=number("GB", at_least=0), default=0.0,
                    help="shared L3 store (Mooncake model), GB = 1e9 bytes; 0 = none. Only histate and "
                         "sglang-hicache use it (0)")
    cl.add_argument("--l3-link-gbps", type=number("Gbit/s", above=0),
                    help="each server's link to L3 (default: an assumed 100 Gbit/s NIC; loopback measured 4.6, sim/l3_link.py)")
    cl.add_argument("--l3-op-latency-ms", type=number("ms", at_least=0),
                    help="latency per L3 operation (default: 0.42 ms, measured on loopback, sim/l3_link.py)")
    cl.add_argument("--eviction_high_watermark_ratio", "--eviction-high-watermark-ratio", dest="eviction_high_watermark_ratio",
                    type=number("", above=0, at_most=1), help="Mooncake master flag (0.90)")
    cl.add_argument("--eviction_ratio", "--eviction-ratio", dest="eviction_ratio", type=number("", above=0, at_most=1),
                    help="Mooncake master flag (0.05)")
    cl.add_argument("--fail-server", type=fail_server, metavar="K@T",
                    help="server K dies at simulated second T; also replays without the failure to compare")
    out = r.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("out/replay"), help="directory for summary.json, requests.csv and plots (out/replay)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--plot-policies", type=plot_policies, metavar="POLICY[,POLICY]|all",
                     help="policies ttft_cdf.png draws (default: histate, unlimited and each engine's best baseline "
                          "of the run by p95; 'all' for every replayed policy)")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    out.add_argument("--explain", type=policy_list, metavar="POLICY[,POLICY]",
                     help="attribute every token each named policy lost against `unlimited` and against the "
                          "other named policies to its cause (KV evicted, state evicted, no checkpoint near the hit, ...); "
                          "prints a table and writes explain.json (adds `unlimited` to --policies)")
    _add_bench_parser(sub, workload_group=src)
    _add_compare_parser(sub)
    _add_serve_parser(sub)
    return ap


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
    scale.add_argument("--time-scale", type=number("", at_least=0), default=1.0,
                       help="multiply every think/tool gap (1)")
    scale.add_argument("--max-live-sessions", type=positive(int), default=24, help="live root sessions at once (24)")
    server = b.add_argument_group("server")
    server.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:30000")
    server.add_argument("--backend", choices=("sglang", "openai"), default="sglang",
                        help="sglang: POST /generate (input_ids, meta_info.cached_tokens); openai: POST "
                             "/v1/completions with token-id prompts (vLLM, SGLang) (sglang)")
    server.add_argument("--model", help="model name for --backend openai (default: the first of /v1/models)")
    server.add_argument("--vocab-size", type=positive(int),
                        help="token ids are drawn below this (default: the server's when it says, else 32000)")
    server.add_argument("--request-timeout", type=number("seconds", above=0), default=600.0,
                        help="seconds per request (600)")
    server.add_argument("--retries", type=int, default=2, help="retries of a request that failed before its first token or whose stream broke (2)")
    server.add_argument("--no-flush", action="store_true", help="do not empty the server's prefix cache first")
    cal = b.add_argument_group("calibration (instead of a workload)")
    cal.add_argument("--calibrate", type=Path, metavar="CSV", help="measure prefill latency into CSV and exit")
    cal.add_argument("--calibrate-contexts", type=int_list, help="cached context lengths, tokens (0,2048,4096,8192)")
    cal.add_argument("--calibrate-lengths", type=int_list, help="new-token counts (64,512,2048,8192)")
    cal.add_argument("--calibrate-reps", type=positive(int), default=2, help="repetitions of the grid (2)")
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
    s.add_argument("--port", type=number("", at_least=0, at_most=65535, integer=True), default=30000,
                   help="port (30000, SGLang's default)")
    s.add_argument("--gpu-mib", type=number("MiB", above=0), default=64.0,
                   help="'GPU' tier (model device) budget, MiB (64)")
    s.add_argument("--cpu-mib", type=number("MiB", above=0), default=256.0, help="CPU tier budget, MiB (256)")
    s.add_argument("--ssd-mib", type=number("MiB", above=0), default=1024.0, help="SSD tier budget, MiB (1024)")
    s.add_argument("--ssd-dir", type=Path, help="where the SSD tier's files go (default: a temporary directory)")
    s.add_argument("--ssd-backend", choices=("auto", "nixl", "file"), default="auto", help="SSD I/O backend (auto)")
    s.add_argument("--max-context", type=number("tokens", at_least=1, integer=True), default=16384,
                   help="longest prompt accepted, tokens (16384; /get_model_info reports it and histate bench "
                        "checks a workload against it before sending anything)")
    s.add_argument("--threads", type=positive(int), default=1, help="torch threads of the model (1)")
    s.add_argument("--check-mirror", action="store_true",
                   help="after every request, check that each tier holds exactly what the policy placed there")
    l3 = s.add_argument_group("shared L3 tier (a Mooncake store several workers share)")
    l3.add_argument("--l3-master", metavar="HOST:PORT",
                    help="Mooncake master of the shared store; each request then resumes from L3 beyond its "
                         "local hit and writes its terminal bundle there (default: no L3)")
    l3.add_argument("--l3-key-prefix", default="histate", metavar="NAME",
                    help="namespace of this deployment's objects in the store (histate)")
    l3.add_argument("--l3-pin-ttl-s", type=number("seconds", at_least=0), default=None, metavar="S",
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
    k.add_argument("--workers", type=number("workers", at_least=2, integer=True), default=2, help="workers (2)")
    k.add_argument("--sessions", type=number("sessions", at_least=1, integer=True), default=8,
                   help="agent sessions of the synthetic workload (8)")
    k.add_argument("--turns", type=number("turns", at_least=2, integer=True), default=4, help="turns per session (4)")
    k.add_argument("--max-live-sessions", type=number("sessions", at_least=1, integer=True),
                   help="sessions in flight at once (default: all, so every session is mid-way at the kill)")
    k.add_argument("--kill-worker", type=number("", at_least=0, integer=True),
                   help="index of the worker SIGKILLed mid-run (default: the one that has served the most sessions)")
    k.add_argument("--kill-after", type=number("", above=0, at_most=0.99), default=0.5,
                   help="fraction of the requests completed when it dies (0.5)")
    k.add_argument("--l3-mib", type=number("MiB", at_least=16), default=512.0,
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
