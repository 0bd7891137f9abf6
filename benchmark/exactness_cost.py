"""What exact resumption costs on the tiny reference Qwen3.5 (CPU, transformers, 1 torch thread).

Part 1 -- capturing k checkpoints inside one prefill vs none. One fresh prefill of N tokens, variants
interleaved rep by rep (order rotated) so machine drift hits all alike; medians of the thread's CPU time
(one torch thread, so this is the compute; wall-clock medians are reported next to it):
  stock     transformers' own torch GDN kernels, nothing swapped
  k=0       histate.reference.gdr kernels, no capture (the executor's path when nothing is planned)
  k=K       the same forward, keeping K checkpoints at evenly spaced 64-token boundaries
Overhead = median over reps of t(k=K) / t(k=0) within the same rep, minus 1 (paired, so slow phases of a
shared machine cancel); `stock` vs `k=0` is the same arithmetic, so its ratio shows the noise floor.
Extra memory: the bytes the captured states occupy (exact), and the peak RSS of one prefill in a fresh
process per variant (median of --rss-reps runs).

Part 2 -- restore vs recompute for a hit at c tokens. Restore = read KV pages [0, c) and the checkpoint
at c from one tier's store (GPU tier = tensors on the compute device, CPU = packed host buffers, SSD =
histate.storage objects) and build the model cache; recompute = a fresh prefill of c tokens. The ratio
restore / recompute is what a hit saves on this model; it is *not* a GPU number (the tiny model has
1 KiB of KV per token and CPU matmuls; docs/exactness.md).

Part 3 (`--parts diffs`) -- the numbers behind docs/exactness.md's table: the agent workload of the
exactness suite replayed in its four policy/capacity cases, in fp64 and fp32; max |logit diff| over all
hits vs a cold prefill, and the range for the same workload with every restored checkpoint replaced by
the state one token earlier (histate, roomy tiers).

    .venv/bin/python benchmark/exactness_cost.py --tokens 8192 --k 1 8 32 --reps 15 \
        --out out/exactness_cost.json --plot docs/exactness_cost.png
    .venv/bin/python benchmark/exactness_cost.py --parts diffs
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from histate.core import Tier
from histate.reference.exactness import TOLERANCE, max_logit_diff
from histate.reference.executor import ReferenceExecutor
from histate.reference.hybrid_cache import Checkpoint, kv_pages_from_cache, restore_cache
from histate.reference.runner import ModelRunner
from histate.reference.ssd import open_ssd
from histate.reference.tier_stores import (GpuCheckpointPool, KvPageStore, PackedCheckpointStore,
                                           SsdCheckpointStore, SsdKvPageStore)
from histate_kernels import pack_slot

CHUNK = 64


def evenly_spaced(num_tokens: int, k: int) -> list[int]:
    """k capture positions on the 64-token grid, the last one at the end of the (aligned) prompt."""
    num_chunks = num_tokens // CHUNK
    return sorted({max(1, round(num_chunks * (i + 1) / k)) * CHUNK for i in range(k)})


def tokens_for(num_tokens: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (num_tokens,), generator=g).tolist()


@torch.no_grad()
def stock_prefill(runner: ModelRunner, token_ids: list[int]) -> None:
    ids = torch.tensor([token_ids])
    runner.model(input_ids=ids, past_key_values=runner.new_cache(), use_cache=True, logits_to_keep=1)


def run_variant(runner: ModelRunner, token_ids: list[int], variant: str):
    if variant == "stock":
        return stock_prefill(runner, token_ids)
    k = int(variant.removeprefix("k="))
    positions = evenly_spaced(len(token_ids), k) if k else []
    return runner.prefill(runner.new_cache(), token_ids, 0, capture_positions=positions)


def capture_cost(runner: ModelRunner, num_tokens: int, ks: list[int], reps: int) -> dict:
    token_ids = tokens_for(num_tokens)
    variants = ["stock", "k=0"] + [f"k={k}" for k in ks]
    run_variant(runner, token_ids[:256], "k=1")  # warm-up (allocator, first-call paths)
    times = {v: [] for v in variants}
    wall = {v: [] for v in variants}
    for rep in tqdm(range(reps), desc=f"capture cost, {num_tokens} tokens"):
        order = variants[rep % len(variants):] + variants[: rep % len(variants)]
        for v in order:
            start, start_wall = time.thread_time(), time.perf_counter()
            run_variant(runner, token_ids, v)
            times[v].append(time.thread_time() - start)
            wall[v].append(time.perf_counter() - start_wall)
    def paired_overhead(samples: dict, v: str) -> float:
        return statistics.median(t / t0 for t, t0 in zip(samples[v], samples["k=0"])) - 1.0

    rows = []
    for v in variants:
        k = 0 if v == "stock" else int(v.removeprefix("k="))
        captured_bytes = k * runner.geometry.checkpoint_size_bytes if v != "stock" else 0
        if k:
            result = run_variant(runner, token_ids, v)
            captured_bytes = result.captured.conv.nbytes + result.captured.ssm.nbytes
        median, median_wall = statistics.median(times[v]), statistics.median(wall[v])
        rows.append(dict(variant=v, k=k, median_s=median, overhead=paired_overhead(times, v),
                         median_wall_s=median_wall, overhead_wall=paired_overhead(wall, v),
                         captured_bytes=captured_bytes, cpu_times_s=times[v], wall_times_s=wall[v]))
    return dict(num_tokens=num_tokens, rows=rows)


def peak_rss_mib(numerics: str, num_tokens: int, variant: str, reps: int) -> float:
    """Median peak RSS of one prefill in a fresh process (imports and weights included)."""
    values = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, __file__, "--rss-child", variant, "--tokens", str(num_tokens),
                              "--numerics", numerics], capture_output=True, text=True, check=True)
        values.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(values)


def rss_child(numerics: str, num_tokens: int, variant: str) -> None:
    torch.set_num_threads(1)
    runner = ModelRunner(numerics)
    token_ids = tokens_for(num_tokens)
    run_variant(runner, token_ids, variant)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def restore_vs_recompute(runner: ModelRunner, contexts: list[int], reps: int, ssd_dir: str) -> dict:
    geometry = runner.geometry
    page = geometry.page_num_tokens
    num_tokens = max(contexts)
    token_ids = tokens_for(num_tokens, seed=1)
    cache = runner.new_cache()
    result = runner.prefill(cache, token_ids, 0, capture_positions=contexts)
    pages = kv_pages_from_cache(cache, geometry, 0, num_tokens // page)
    keys = [f"page{i}".encode() for i in range(len(pages))]
    device = torch.device("cpu")
    page_bytes = geometry.kv_page_size_bytes
    ssd = open_ssd(ssd_dir, (len(pages) + len(contexts)) * (page_bytes + geometry.checkpoint_size_bytes))
    pool = GpuCheckpointPool(geometry, len(contexts), device)
    kv = {"GPU": KvPageStore("GPU", device), "CPU": KvPageStore("CPU", device), "SSD": SsdKvPageStore(ssd, geometry)}
    ckpt = {"GPU": pool, "CPU": PackedCheckpointStore(pool.layout), "SSD": SsdCheckpointStore(ssd, pool.layout)}
    captured = {"conv": result.captured.conv, "ssm": result.captured.ssm}
    for tier in kv:
        for key, p in zip(keys, pages):
            kv[tier].write(key, p)
    ckpt_keys = [keys[c // page - 1] for c in contexts]
    pool.write_captured(ckpt_keys, result.captured.conv, result.captured.ssm, list(range(len(contexts))))
    for j, key in enumerate(ckpt_keys):
        packed = pack_slot(captured, j, pool.layout)
        ckpt["CPU"].write(key, packed)
        ckpt["SSD"].write(key, packed)

    def restore(tier: str, c: int):
        read = [kv[tier].read(k) for k in keys[: c // page]]
        checkpoint = ckpt[tier].checkpoint(keys[c // page - 1], c)
        return restore_cache(runner.model, geometry, read, checkpoint)

    def recompute(c: int):
        runner.prefill(runner.new_cache(), token_ids[:c], 0)

    rows = []
    for c in tqdm(contexts, desc="restore vs recompute"):
        # Restores are interleaved with each other, not with the prefill: a prefill frees ~100 MiB of
        # activations, and the next allocation's page faults would be charged to whichever restore follows.
        timings = {name: [] for name in ("recompute", "GPU", "CPU", "SSD")}
        for _ in range(reps):
            start = time.perf_counter()
            recompute(c)
            timings["recompute"].append(time.perf_counter() - start)
        restore("GPU", c)  # warm-up after the prefills
        tiers = ["GPU", "CPU", "SSD"]
        for rep in range(reps):
            for name in tiers[rep % 3:] + tiers[: rep % 3]:
                start = time.perf_counter()  # wall clock: SSD reads wait on I/O, not CPU
                restore(name, c)
                timings[name].append(time.perf_counter() - start)
        recompute_s = statistics.median(timings["recompute"])
        for tier in ("GPU", "CPU", "SSD"):
            restore_s = statistics.median(timings[tier])
            rows.append(dict(context_tokens=c, tier=tier, restore_s=restore_s, recompute_s=recompute_s,
                             ratio=restore_s / recompute_s,
                             bytes=c * geometry.kv_bytes_per_token + geometry.checkpoint_size_bytes))
    backend, direct = ssd.store.backend_name, ssd.store.direct_io
    ssd.close()
    return dict(rows=rows, ssd_backend=backend, ssd_direct_io=direct)


DIFF_CASES = {  # (policy, tier sizes in KV pages: GPU, CPU, SSD) -- the cases of test/reference/test_exactness.py
    "histate/roomy": ("histate", (20, 20, 400)),
    "histate/tight": ("histate", (20, 12, 40)),
    "vllm-disk/roomy": ("vllm-disk", (20, 20, 400)),
    "sglang-hicache/roomy": ("sglang-hicache", (20, 20, 400)),
}


def workload_diffs(numerics: str, ssd_root: str) -> dict:
    from histate.reference.workloads import agent_mutation_workload

    runner = ModelRunner(numerics)
    page_bytes = runner.geometry.kv_page_size_bytes
    requests = agent_mutation_workload()
    colds = {r.token_ids: runner.cold_run(list(r.token_ids), 3) for r in tqdm(requests, desc=f"cold runs {numerics}")}

    def replay(policy, pages, fault=None):
        capacity = {t: n * page_bytes for t, n in zip((Tier.GPU, Tier.CPU, Tier.SSD), pages)}
        ssd = open_ssd(tempfile.mkdtemp(dir=ssd_root), capacity[Tier.SSD])
        executor = ReferenceExecutor(runner, policy, capacity, ssd, checkpoint_fault=fault)
        diffs = []
        for r in requests:
            served = executor.serve(r.token_ids, r.now_s, colds[r.token_ids].decode_tokens)
            executor.check_mirror()
            if served.num_reused_pages:
                diffs.append(max_logit_diff(served, colds[r.token_ids]))
        executor.close()
        return diffs

    def off_by_one(token_ids, checkpoint):
        shifted = runner.checkpoint_by_prefill(token_ids, checkpoint.position - 1)
        return Checkpoint(checkpoint.position, shifted.conv, shifted.ssm)

    hits = {name: replay(*case) for name, case in tqdm(DIFF_CASES.items(), desc=f"replays {numerics}")}
    faulty = replay("histate", DIFF_CASES["histate/roomy"][1], off_by_one)
    every = [d for ds in hits.values() for d in ds]
    return dict(numerics=numerics, tolerance=TOLERANCE[numerics], num_hits=len(every), max_diff=max(every),
                num_bitwise=sum(d == 0.0 for d in every), per_case={k: max(v) for k, v in hits.items()},
                off_by_one_hits=len(faulty), off_by_one_min=min(faulty), off_by_one_max=max(faulty))


def print_diffs(rows: list[dict]) -> None:
    print("\n### exactness of the agent workload (all hits of the four cases)\n")
    print("| mode | bound | hits | max abs diff | bitwise equal | off-by-one checkpoint: hits, min .. max diff |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['numerics']} | {r['tolerance']:.0e} | {r['num_hits']} | {r['max_diff']:.2e} | {r['num_bitwise']} | "
              f"{r['off_by_one_hits']}, {r['off_by_one_min']:.2e} .. {r['off_by_one_max']:.2e} |")


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cap = report["capture"]["rows"]
    labels = ["stock\n(noise floor)" if r["variant"] == "stock" else r["variant"] for r in cap]
    colors = ["tab:gray" if r["variant"] == "stock" else "tab:blue" for r in cap]
    left.bar(labels, [100 * r["overhead"] for r in cap], color=colors)
    left.axhline(10, color="tab:red", linestyle="--", label="target: < 10 %")
    left.set_ylabel("prefill CPU time vs k=0 (%, paired median)")
    left.set_title(f"capture k checkpoints in one {report['capture']['num_tokens']}-token prefill")
    left.legend()
    rows = report["restore"]["rows"]
    contexts = sorted({r["context_tokens"] for r in rows})
    for tier, color in (("GPU", "tab:green"), ("CPU", "tab:orange"), ("SSD", "tab:purple")):
        right.plot(contexts, [next(r["restore_s"] for r in rows if r["context_tokens"] == c and r["tier"] == tier)
                              for c in contexts], marker="o", color=color, label=f"restore from {tier}")
    right.plot(contexts, [next(r["recompute_s"] for r in rows if r["context_tokens"] == c) for c in contexts],
               marker="s", color="black", label="recompute (prefill)")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("hit position c (tokens)")
    right.set_ylabel("seconds (median)")
    right.set_title("restore KV[0,c) + checkpoint vs recompute")
    right.legend()
    fig.suptitle(f"tiny Qwen3.5 ({report['numerics']}, CPU, 1 thread) -- not GPU numbers", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def print_tables(report: dict) -> None:
    if "capture" in report:
        print_capture_table(report)
    if "restore" in report:
        print_restore_table(report)
    if "diffs" in report:
        print_diffs(report["diffs"])


def print_capture_table(report: dict) -> None:
    cap = report["capture"]
    print(f"\n### capture cost: one prefill of {cap['num_tokens']} tokens ({report['numerics']}, "
          f"{report['reps']} reps, medians)\n")
    print("| variant | CPU s (median) | vs k=0 (paired) | wall s (median) | vs k=0 (paired) | captured bytes | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in cap["rows"]:
        rss = report.get("rss_mib", {}).get(r["variant"])
        print(f"| {r['variant']} | {r['median_s']:.3f} | {100 * r['overhead']:+.1f} % | {r['median_wall_s']:.3f} | "
              f"{100 * r['overhead_wall']:+.1f} % | {r['captured_bytes']:,} | {'' if rss is None else f'{rss:.0f}'} |")


def print_restore_table(report: dict) -> None:
    res = report["restore"]
    print(f"\n### restore vs recompute (SSD backend {res['ssd_backend']}, O_DIRECT {res['ssd_direct_io']})\n")
    print("| c (tokens) | tier | restore ms | recompute ms | restore / recompute |")
    print("|---:|---|---:|---:|---:|")
    for r in res["rows"]:
        print(f"| {r['context_tokens']} | {r['tier']} | {1e3 * r['restore_s']:.2f} | {1e3 * r['recompute_s']:.1f} | "
              f"{r['ratio']:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192, help="prefill length for the capture-cost part")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 8, 32], help="checkpoints captured per prefill")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192], help="hit positions c (tokens)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rss-reps", type=int, default=3, help="fresh processes per variant for peak RSS (0: skip)")
    ap.add_argument("--numerics", choices=["fp32", "fp64"], default="fp32")
    ap.add_argument("--out", help="write the report as JSON here")
    ap.add_argument("--plot", help="write a two-panel PNG here")
    ap.add_argument("--parts", nargs="+", choices=["capture", "restore", "diffs"], default=["capture", "restore"])
    ap.add_argument("--from-json", help="print tables (and --plot) from a saved report instead of measuring")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
        print_tables(report)
        if args.plot:
            plot(report, args.plot)
        return
    if args.rss_child:
        return rss_child(args.numerics, args.tokens, args.rss_child)
    for c in args.contexts:
        if c % CHUNK:
            ap.error(f"--contexts {c}: hit positions must be multiples of {CHUNK} tokens")
    torch.set_num_threads(1)
    runner = ModelRunner(args.numerics)
    report = dict(numerics=args.numerics, reps=args.reps, torch=torch.__version__, python=platform.python_version(),
                  cpus=os.cpu_count(), threads=1)
    if "capture" in args.parts:
        report["capture"] = capture_cost(runner, args.tokens, args.k, args.reps)
    if "capture" in args.parts and args.rss_reps:
        variants = ["k=0"] + [f"k={k}" for k in args.k]
        report["rss_mib"] = {v: peak_rss_mib(args.numerics, args.tokens, v, args.rss_reps)
                             for v in tqdm(variants, desc="peak RSS (fresh processes)")}
    if "restore" in args.parts:
        with tempfile.TemporaryDirectory(prefix="histate-exactness-cost-", dir=os.environ.get("TMPDIR")) as ssd_dir:
            report["restore"] = restore_vs_recompute(runner, sorted(args.contexts), args.reps, ssd_dir)
    if "diffs" in args.parts:
        with tempfile.TemporaryDirectory(prefix="histate-exactness-diffs-", dir=os.environ.get("TMPDIR")) as root:
            report["diffs"] = [workload_diffs(n, root) for n in ("fp64", "fp32")]
    print_tables(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot and {"capture", "restore"} <= set(report):
        plot(report, args.plot)


if __name__ == "__main__":
    main()
