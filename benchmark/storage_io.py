"""Storage I/O benchmark: the HiState store (NIXL and plain-file backends) next to the raw device.

For each case the same bytes are moved by every implementation, interleaved rep by rep (order rotated)
so that drift on a shared disk hits all of them alike; cells are medians.

  raw         plain sequential O_DIRECT: one pwrite into a new file / one preadv of all the bytes,
              page-aligned buffer; KV batches: all pages in one sequential file
  raw-layout  the store's file-system work without the store: one file per object (per KV batch: the
              pack) holding a header block + payload, written to a temp name then renamed, read back
              with one preadv; O_DIRECT, no checksum, no queue, one thread
  file, nixl  CheckpointStore.put / .get(out=...) end to end (sync calls; KV pages as one packed batch,
              put_many(pack=True), read back with one get_many): checksums, header, temp file +
              preallocation, rename, index, O_DIRECT

Every write creates a new object (as new checkpoints do); the previous one is deleted outside the
timed region. Reads fetch the newest object into a preallocated, page-aligned buffer. Before timing,
each store's 256 fan-out directories are created (`warm_fanouts`): a store that has served for a while
has them all, a fresh one makes each on first use.

Per-call overhead = median(store call on a 4 KiB object) - median(raw-layout call on the same 8 KiB
file: header block + payload block). Ratio = median over reps of raw latency / store latency, paired
within a rep (so >= 0.90 means the store reaches 90% of the raw throughput).

    python benchmark/storage_io.py --dir /nvme/tmp/histate-bench --reps 15 --out out/storage_io.json \
        --plot docs/storage_io.png
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from histate.storage import CheckpointStore, StoreConfig, aligned_empty, nixl_available
from histate.storage.format import ItemSpec, header_bytes_for
from histate.storage.layout import FANOUT_DIRS

MiB = 1 << 20
KiB = 1 << 10
CHECKPOINT_SIZES = [1 * MiB, 16 * MiB, 64 * MiB]
KV_PAGES, KV_PAGE_BYTES = 64, 256 * KiB
SMALL_BYTES = 4 * KiB


def _raw_write(path: str, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        done = 0
        while done < buf.size:
            done += os.pwrite(fd, buf[done:], done)
    finally:
        os.close(fd)


def _raw_read(path: str, buf: np.ndarray) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < buf.size:
            n = os.preadv(fd, [buf[done:]], done)
            if n <= 0:
                raise EOFError(path)
            done += n
    finally:
        os.close(fd)


class RawFiles:
    """Objects as plain files: write(rep) creates object `rep` (one O_DIRECT pwrite per file, optionally to
    a temp name + rename), read() reads the newest back, drop(rep) deletes object `rep` (untimed)."""

    def __init__(self, root: str, name: str, srcs: list[np.ndarray], dsts: list[np.ndarray], publish: bool):
        self.root, self.name, self.srcs, self.dsts, self.publish = root, name, srcs, dsts, publish
        self.last = 0

    def _path(self, rep: int, i: int) -> str:
        return os.path.join(self.root, f"{self.name}-{rep}-{i}")

    def write(self, rep: int) -> None:
        for i, buf in enumerate(self.srcs):
            final = self._path(rep, i)
            _raw_write(final + ".tmp" if self.publish else final, buf)
            if self.publish:
                os.rename(final + ".tmp", final)
        self.last = rep

    def read(self, _rep: int) -> None:
        for i, buf in enumerate(self.dsts):
            _raw_read(self._path(self.last, i), buf)

    def drop(self, rep: int) -> None:
        for i in range(len(self.srcs)):
            os.unlink(self._path(rep, i))


class StoreObjects:
    """The same through the store: one put/get for one object, one batch for a list of pages."""

    def __init__(self, store: CheckpointStore, name: str, srcs: list[np.ndarray], dsts: list[np.ndarray]):
        self.store, self.name, self.srcs, self.dsts = store, name, srcs, dsts
        self.last = 0

    def _keys(self, rep: int) -> list[str]:
        return [f"{self.name}-{rep}-{i}" for i in range(len(self.srcs))]

    def write(self, rep: int) -> None:
        keys = self._keys(rep)
        if len(keys) == 1:
            r = self.store.put(keys[0], self.srcs[0])
            assert r.stored, r
        else:
            assert all(r.stored for r in self.store.put_many(list(zip(keys, self.srcs)), pack=True))
        self.last = rep

    def read(self, _rep: int) -> None:
        keys = self._keys(self.last)
        if len(keys) == 1:
            r = self.store.get(keys[0], out=self.dsts[0])
            assert r.hit, r
        else:
            assert all(r.hit for r in self.store.get_many(keys, out=self.dsts))

    def drop(self, rep: int) -> None:
        self.store.delete_many(self._keys(rep))


class Case:
    """One workload: impl name -> object with write(rep) / read(rep) / drop(rep) moving the same bytes."""

    def __init__(self, name: str, num_bytes: int, impls: dict):
        self.name, self.num_bytes, self.impls = name, num_bytes, impls


def warm_fanouts(store: CheckpointStore) -> None:
    """Create every fan-out directory of the store's roots, as a store that has run for a while has
    them (they are made on first use: without this, most timed writes of a fresh store would include
    a mkdir, which the raw baselines never pay)."""
    layout, keys = store.layout, []
    missing = {(root, f"{i:02x}") for root in range(len(layout.roots)) for i in range(FANOUT_DIRS)}
    n = 0
    while missing:
        loc = layout.object_location(f"warm-{n}")
        if (loc.root, loc.fanout) in missing:
            missing.discard((loc.root, loc.fanout))
            keys.append(f"warm-{n}")
        n += 1
    one = np.zeros(1, np.uint8)
    assert all(r.stored for r in store.put_many([(k, one) for k in keys]))
    store.delete_many(keys)


def _aligned_random(rng, num_bytes: int) -> np.ndarray:
    buf = aligned_empty(num_bytes)
    buf[:] = rng.integers(0, 256, num_bytes, dtype=np.uint8)
    return buf


def build_cases(stores: dict[str, CheckpointStore], raw_dir: str, rng) -> list[Case]:
    """Every write creates a new object (new checkpoints get new keys); the previous one is deleted
    outside the timed region, as eviction would. Reads fetch the newest object into a fixed buffer."""
    cases = []
    for size in [SMALL_BYTES] + CHECKPOINT_SIZES:
        src, dst = _aligned_random(rng, size), aligned_empty(size)
        # what the store's file holds: one header block + the (block aligned) payload
        file_src, file_dst = aligned_empty(size + 4096), aligned_empty(size + 4096)
        file_src[:4096] = 0
        file_src[4096:] = src
        label = f"{size // KiB} KiB" if size < MiB else f"{size // MiB} MiB"
        impls = {"raw": RawFiles(raw_dir, f"raw-{size}", [src], [dst], publish=False),
                 "raw-layout": RawFiles(raw_dir, f"layout-{size}", [file_src], [file_dst], publish=True)}
        for impl, store in stores.items():
            impls[impl] = StoreObjects(store, f"ckpt-{size}", [src], [dst])
        cases.append(Case(("call " if size == SMALL_BYTES else "ckpt ") + label, size, impls))
    # pages are slices of one host pool, as SGLang's host KV pool is (separate small buffers would make
    # every O_DIRECT transfer pin 4 KiB pages instead of huge pages: ~2x slower here, for raw I/O too)
    seq = _aligned_random(rng, KV_PAGES * KV_PAGE_BYTES)
    pages = [seq[i * KV_PAGE_BYTES: (i + 1) * KV_PAGE_BYTES] for i in range(KV_PAGES)]
    pool_out = aligned_empty(KV_PAGES * KV_PAGE_BYTES)
    outs = [pool_out[i * KV_PAGE_BYTES: (i + 1) * KV_PAGE_BYTES] for i in range(KV_PAGES)]
    header_bytes = header_bytes_for([ItemSpec(f"kv-0-{i}", KV_PAGE_BYTES, "|u1", (KV_PAGE_BYTES,))
                                     for i in range(KV_PAGES)], StoreConfig.chunk_bytes)
    pack = aligned_empty(header_bytes + seq.size)  # what the store's pack holds: header + pages
    pack[:header_bytes] = 0
    pack[header_bytes:] = seq
    impls = {"raw": RawFiles(raw_dir, "raw-kv", [seq], [aligned_empty(seq.size)], publish=False),
             "raw-layout": RawFiles(raw_dir, "layout-kv", [pack], [aligned_empty(pack.size)], publish=True)}
    for impl, store in stores.items():
        impls[impl] = StoreObjects(store, "kv", pages, outs)
    cases.append(Case(f"kv {KV_PAGES}x{KV_PAGE_BYTES // KiB} KiB", KV_PAGES * KV_PAGE_BYTES, impls))
    return cases


def measure(cases: list[Case], reps: int, progress) -> dict:
    """{case: {impl: {op: [latency_s, ...]}}}; writes before reads, implementations interleaved and
    rotated every rep; rep 0 warms up (directories exist, buffers are faulted in) and is not kept."""
    out: dict = {}
    total = sum(len(c.impls) for c in cases) * 2 * (reps + 1)
    with progress(total=total, desc="storage_io", unit="op") as bar:
        for case in cases:
            res = out.setdefault(case.name, {})
            names = list(case.impls)
            for op in ("write", "read"):
                for rep in range(reps + 1):
                    k = rep % len(names)
                    for impl in names[k:] + names[:k]:
                        obj = case.impls[impl]
                        t0 = time.perf_counter()
                        getattr(obj, op)(rep)
                        dt = time.perf_counter() - t0
                        if op == "write" and rep:
                            obj.drop(rep - 1)
                        if rep:
                            res.setdefault(impl, {}).setdefault(op, []).append(dt)
                        bar.update(1)
    return out


def summarize(cases: list[Case], samples: dict) -> list[dict]:
    """Medians per cell; ratios are medians of per-rep paired ratios (raw and the store ran back to
    back in the same rep), which drift on a shared machine disturbs far less than a ratio of medians."""
    rows = []
    for case in cases:
        for op in ("write", "read"):
            raw = samples[case.name]["raw"][op]
            layout = samples[case.name]["raw-layout"][op]
            for impl, ops in samples[case.name].items():
                lat = statistics.median(ops[op])
                rows.append(dict(case=case.name, op=op, impl=impl, num_bytes=case.num_bytes,
                                 median_latency_s=lat, throughput_gb_s=case.num_bytes / lat / 1e9,
                                 ratio_vs_raw=statistics.median(r / x for r, x in zip(raw, ops[op])),
                                 ratio_vs_layout=statistics.median(r / x for r, x in zip(layout, ops[op])),
                                 p90_latency_s=sorted(ops[op])[int(0.9 * (len(ops[op]) - 1))]))
    return rows


def print_table(rows: list[dict], impls: list[str]) -> None:
    stores = [i for i in impls if not i.startswith("raw")]
    print("| case | op | " + " | ".join(f"{i} ms (GB/s)" for i in impls) + " | " +
          " | ".join(f"{i} / raw" for i in stores) + " | " + " | ".join(f"{i} / raw-layout" for i in stores) + " |")
    print("|" + "---|" * (2 + len(impls) + 2 * len(stores)))
    by = {(r["case"], r["op"], r["impl"]): r for r in rows}
    for case, op in dict.fromkeys((r["case"], r["op"]) for r in rows):
        cells = [f"{by[(case, op, i)]['median_latency_s'] * 1e3:.2f} ({by[(case, op, i)]['throughput_gb_s']:.2f})"
                 for i in impls]
        vs_raw = [f"{by[(case, op, i)]['ratio_vs_raw']:.2f}" for i in stores]
        vs_layout = [f"{by[(case, op, i)]['ratio_vs_layout']:.2f}" for i in stores]
        print(f"| {case} | {op} | " + " | ".join(cells + vs_raw + vs_layout) + " |")


def overheads(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per-call overhead (us) of each store backend over raw-layout, from the 4 KiB case."""
    by = {(r["case"], r["op"], r["impl"]): r for r in rows}
    small = next(r["case"] for r in rows if r["case"].startswith("call "))
    out = {}
    for (case, op, impl), r in by.items():
        if case == small and not impl.startswith("raw"):
            base = by[(case, op, "raw-layout")]["median_latency_s"]
            out.setdefault(impl, {})[op] = (r["median_latency_s"] - base) * 1e6
    return out


def plot(rows: list[dict], impls: list[str], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in dict.fromkeys((r["case"], r["op"]) for r in rows) if not g[0].startswith("call ")]
    by = {(r["case"], r["op"], r["impl"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ys = [by[(c, o, impl)]["throughput_gb_s"] if (c, o, impl) in by else 0 for c, o in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=impl)
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(groups))])
    ax.set_xticklabels([f"{c}\n{o}" for c, o in groups], fontsize=8)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the device under test (default: a temp dir under /tmp)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--backends", default="file,nixl", help="comma list of store backends to measure")
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--piece-mib", type=int, help="StoreConfig.piece_bytes in MiB (default: the store's)")
    ap.add_argument("--max-inflight", type=int, help="StoreConfig.max_inflight (default: the store's)")
    ap.add_argument("--file-io-threads", type=int, help="StoreConfig.file_io_threads (default: the store's)")
    ap.add_argument("--checksum-threads", type=int, help="StoreConfig.checksum_threads (default: the store's)")
    ap.add_argument("--no-preallocate", action="store_true", help="StoreConfig.preallocate=False")
    ap.add_argument("--out", help="write raw samples and summary as JSON here")
    ap.add_argument("--plot", help="write a throughput bar chart (PNG) here")
    args = ap.parse_args(argv)
    try:
        from tqdm import tqdm as progress
    except ImportError:
        progress = _NoProgress
    base = args.dir or tempfile.mkdtemp(prefix="histate-storage-io-", dir="/tmp")
    os.makedirs(base, exist_ok=True)
    backends = [b for b in args.backends.split(",") if b]
    if "nixl" in backends and not nixl_available():
        print("nixl unavailable: measuring the file backend only", file=sys.stderr)
        backends.remove("nixl")
    stores = {}
    try:
        raw_dir = os.path.join(base, "raw")
        os.makedirs(raw_dir, exist_ok=True)
        for b in backends:
            tuning = {k: v for k, v in dict(piece_bytes=args.piece_mib and args.piece_mib * MiB,
                                            max_inflight=args.max_inflight, file_io_threads=args.file_io_threads,
                                            checksum_threads=args.checksum_threads,
                                            preallocate=False if args.no_preallocate else None).items()
                      if v is not None}
            cfg = StoreConfig(dirs=[os.path.join(base, b)], capacity_bytes=64 << 30, backend=b,
                              num_workers=args.num_workers, **tuning)
            stores[b] = CheckpointStore(cfg)
            warm_fanouts(stores[b])
            if not all(stores[b].direct_io.values()):
                print(f"warning: {base} refuses O_DIRECT; {b} runs buffered", file=sys.stderr)
        cases = build_cases(stores, raw_dir, np.random.default_rng(0))
        samples = measure(cases, args.reps, progress)
        impls = ["raw", "raw-layout"] + backends
        rows = summarize(cases, samples)
        c = next(iter(stores.values())).config if stores else None
        env = dict(host=platform.node(), kernel=platform.release(), cpus=os.cpu_count(), dir=base,
                   fs=_fs_type(base), reps=args.reps, num_workers=args.num_workers,
                   load_avg=os.getloadavg()[0], **({} if c is None else dict(
                       piece_bytes=c.piece_bytes, max_inflight=c.max_inflight, file_io_threads=c.file_io_threads,
                       checksum_threads=c.checksum_threads, checksum=c.checksum, preallocate=c.preallocate)))
        print(f"\nenvironment: {env}\n")
        print_table(rows, impls)
        ov = overheads(rows)
        print("\nper-call overhead over raw-layout (4 KiB object, median, us): " +
              ", ".join(f"{impl} get {v.get('read', float('nan')):.0f} / put {v.get('write', float('nan')):.0f}"
                        for impl, v in ov.items()))
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                json.dump(dict(env=env, rows=rows, overhead_us=ov, samples=samples), fh, indent=1)
        if args.plot:
            plot(rows, impls, args.plot, f"HiState storage vs raw O_DIRECT ({env['fs']}, {env['cpus']} CPUs, "
                                         f"median of {args.reps})")
    finally:
        for s in stores.values():
            s.close(flush=False)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    return 0


def _fs_type(path: str) -> str:
    best, fs = "", "?"
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, mnt, typ = line.split()[:3]
            if os.path.abspath(path).startswith(mnt) and len(mnt) > len(best):
                best, fs = mnt, f"{typ} on {dev}"
    return fs


class _NoProgress:
    def __init__(self, **_kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def update(self, _n):
        pass


if __name__ == "__main__":
    raise SystemExit(main())
