"""Per-step cost of the cache's scheduler-step work (`check_hicache_events`), stock HiCache vs HiState,
as the number of terminal checkpoints on SSD grows.

SGLang calls `check_hicache_events` once per scheduler step (scheduler.py's event loop, through
`UnifiedRadixCache.check_hicache_events`); HiState adds its SSD tier's per-step work there (homing,
demotion, trim, reaping restores). Issue 29 asks that none of it be O(n) in what the cache holds. Here
`--sessions` sessions of two pages each leave one terminal checkpoint each on SSD (its device copy kept
for the next turn), then `--steps` idle steps are timed (thread CPU time, median and p99, µs), and then
steps that each serve one more turn of a session.

Both caches are SGLang 0.5.23 classes on CPU with the test support's stand-in for the D<->H copy
engine (sglang_cpu/hicache.py: transfers complete at once) and the Python tree core. Stock runs
SGLang's host tier with its own `file` storage backend; HiState runs its SSD tier (`--enable-histate`
defaults, plain-file I/O).

    .venv/bin/python benchmark/sglang_step.py [--sessions 16 128 512] [--steps 300] [--write-policy write_back]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLOCK = time.thread_time_ns
_KEEP: list = []  # (cache, its SSD directory) of every run, removed at exit
HOST_RATIO = 4.0  # host pools 4x the device's: every session's states reach the host and the SSD


def _caches(kind: str, num_sessions: int, ssd_dir: str, write_policy: str = "write_through"):
    from sglang_cpu.hicache import attach_hicache, hicache_server_args
    from sglang_cpu.pools import PAGE, build_cache, build_pools, publish_server_args

    pools = build_pools(8 * num_sessions * PAGE + 64 * PAGE, 2 * num_sessions + 16, max_reqs=8)
    if kind == "histate":
        from histate.sglang_plugin.config import resolve_config
        from histate.sglang_plugin.server_settings import storage_extra_config

        config = resolve_config({"enable": True, "ssd_dirs": [ssd_dir], "ssd_backend": "file",
                                 "ssd_size_bytes": "1GiB", "host_state_slots": 2 * num_sessions + 16}, {})
        server_args = hicache_server_args(pools.page_size, max(16, pools.page_size),
                                          storage_extra=storage_extra_config(None, config), hicache_ratio=HOST_RATIO,
                                          hicache_write_policy=write_policy)
        cache = build_cache("histate", pools, histate_config=config)
        return attach_hicache(cache, pools, server_args, config), pools
    from sglang_cpu.hicache import HICACHE_ARGS

    server_args = publish_server_args(page_size=pools.page_size, chunk_tokens=max(16, pools.page_size),
                                      **{**HICACHE_ARGS, "hicache_ratio": HOST_RATIO,
                                         "hicache_write_policy": write_policy}, hicache_storage_backend="file",
                                      hicache_storage_prefetch_policy="wait_complete")
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = ssd_dir
    cache = build_cache("stock", pools)
    return attach_hicache(cache, pools, server_args, None), pools


def _quantiles(samples_ns: list) -> tuple:
    ordered = sorted(samples_ns)
    return statistics.median(ordered) / 1e3, ordered[int(0.99 * (len(ordered) - 1))] / 1e3


def run(kind: str, num_sessions: int, num_steps: int, write_policy: str = "write_through") -> dict:
    from sglang_cpu.hicache import drain_backups
    from sglang_cpu.pools import PAGE, Driver

    ssd_dir = tempfile.mkdtemp(prefix=f"sglang_step_{kind}_")
    cache, pools = _caches(kind, num_sessions, ssd_dir, write_policy)
    _KEEP.append((cache, ssd_dir))  # torn down at exit: SGLang's storage threads outlive a run
    driver = Driver(cache, pools)
    prompts = [list(range(s * 100_000, s * 100_000 + 4 * PAGE)) for s in range(num_sessions)]
    for tokens in prompts:
        driver.serve(tokens[:2 * PAGE], [PAGE, 2 * PAGE])
    drain_backups(cache, timeout_s=120.0)
    idle = []
    for _ in range(num_steps):
        t0 = CLOCK()
        cache.check_hicache_events()
        idle.append(CLOCK() - t0)
    busy = []
    for s in range(min(num_sessions, num_steps)):
        driver.serve(prompts[s][:3 * PAGE], [3 * PAGE])  # the next turn of session s
        t0 = CLOCK()
        cache.check_hicache_events()
        busy.append(CLOCK() - t0)
    drain_backups(cache, timeout_s=120.0)
    homing = len(cache.histate.ssd_tier.homing) if kind == "histate" else None
    return {"idle": _quantiles(idle), "busy": _quantiles(busy), "homing": homing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--write-policy", choices=("write_through", "write_back"), default="write_through",
                    help="SGLang's --hicache-write-policy for both caches (write_back: HiState writes each "
                         "checkpoint to the SSD at creation, sglang_plugin/state_writes.py)")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from sglang_cpu import stubs

    stubs.install()
    print(f"per-step thread CPU time of check_hicache_events, µs (median / p99), {args.write_policy}; idle steps, "
          "then steps after one more turn")
    print(f"{'sessions':>8} {'cache':>8} {'idle p50':>9} {'idle p99':>9} {'turn p50':>9} {'turn p99':>9} "
          f"{'SSD terminal candidates':>24}")
    for n in args.sessions:
        for kind in ("stock", "histate"):
            r = run(kind, n, args.steps, args.write_policy)
            print(f"{n:>8} {kind:>8} {r['idle'][0]:>9.1f} {r['idle'][1]:>9.1f} {r['busy'][0]:>9.1f} "
                  f"{r['busy'][1]:>9.1f} {'' if r['homing'] is None else r['homing']:>24}", flush=True)
    for _cache, ssd_dir in _KEEP:
        shutil.rmtree(ssd_dir, ignore_errors=True)
    os._exit(0)  # SGLang's storage threads would keep the process alive


if __name__ == "__main__":
    main()
