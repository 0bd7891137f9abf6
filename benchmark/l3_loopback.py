"""Loopback Mooncake Store cost: put and get latency per object size, the numbers the simulator's L3 link
is calibrated from (sim/l3 defaults; docs/scaleout.md says what is extrapolated).

One master + one standalone store service on 127.0.0.1 (histate.l3.services), one client process that
contributes no segment (as a cluster worker), TCP transport. For each object size, `--reps` rounds
each put a fresh object and get it back; puts and gets are timed separately and the median is
reported, with the implied per-operation latency and bandwidth from a least-squares fit of
median time against size (t = latency + size / bandwidth).

This is one machine's loopback: no NIC, no RDMA. What it calibrates is the software path (framing,
RPC to the master, TCP copy through the kernel); a real fleet's link is slower per byte and faster
per operation with RDMA. Numbers are measured, not simulated.

    python benchmark/l3_loopback.py --reps 15 --out out/l3_loopback.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid

from histate.l3.client import L3Client
from histate.l3.services import LoopbackMooncake, unavailable_reason

KiB, MiB = 1 << 10, 1 << 20
SIZES_BYTES = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]


def fit_latency_bandwidth(sizes_bytes: list, times_s: list) -> tuple[float, float]:
    """Least squares t = a + b*size; returns (a seconds, 1/b bytes per second)."""
    n = len(sizes_bytes)
    mean_x = sum(sizes_bytes) / n
    mean_y = sum(times_s) / n
    sxx = sum((x - mean_x) ** 2 for x in sizes_bytes)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes_bytes, times_s))
    slope = sxy / sxx
    return mean_y - slope * mean_x, (1.0 / slope if slope > 0 else float("inf"))


def measure(client: L3Client, size_bytes: int, reps: int) -> dict:
    payload = os.urandom(size_bytes)
    put_s, get_s = [], []
    for _ in range(reps):
        name = uuid.uuid4().hex
        t0 = time.perf_counter()
        ok = client.put(name, payload)
        t1 = time.perf_counter()
        got = client.get(name)
        t2 = time.perf_counter()
        if not ok or got != payload:
            raise RuntimeError(f"round trip of {size_bytes} bytes failed (put ok={ok})")
        put_s.append(t1 - t0)
        get_s.append(t2 - t1)
        client.remove(name)
    return {"size_bytes": size_bytes, "put_median_s": statistics.median(put_s),
            "get_median_s": statistics.median(get_s), "reps": reps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="out/l3_loopback.json")
    args = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"skipped: {reason}", file=sys.stderr)
        return 2
    with LoopbackMooncake(segment_size_bytes=256 * MiB) as mc:
        client = L3Client(mc.master_address, key_prefix="bench")
        rows = [measure(client, size, args.reps) for size in SIZES_BYTES]
        client.close()
    sizes = [r["size_bytes"] for r in rows]
    put_lat, put_bw = fit_latency_bandwidth(sizes, [r["put_median_s"] for r in rows])
    get_lat, get_bw = fit_latency_bandwidth(sizes, [r["get_median_s"] for r in rows])
    result = {"rows": rows, "put_latency_s": put_lat, "put_bytes_per_s": put_bw,
              "get_latency_s": get_lat, "get_bytes_per_s": get_bw}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("| object | put median | get median |\n|---:|---:|---:|")
    for r in rows:
        print(f"| {r['size_bytes'] // KiB} KiB | {r['put_median_s'] * 1e3:.2f} ms | {r['get_median_s'] * 1e3:.2f} ms |")
    print(f"fit: put {put_lat * 1e3:.2f} ms + size / {put_bw / 1e9:.2f} GB/s; "
          f"get {get_lat * 1e3:.2f} ms + size / {get_bw / 1e9:.2f} GB/s  (measured, loopback TCP)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
