"""Where do prefix hits land? The evidence behind HiState's learned reuse-position prior (docs/policies.md).

For every request of a trace, the longest prefix it shares with any earlier request of its own session
(what an unlimited cache could reuse from that session), classified against the end of the previous
request: at it (an append), k pages before it (the previous request's last pages were rewritten), or
farther inside the context. Prints requests and reused pages per class; the paper's eq. 3 assumes that
non-terminal hits are uniform over the context, which this table tests. Pure trace analysis (no cache).

    .venv/bin/python benchmark/hit_positions.py [--trace ../shared/traces/cc-traces-weka-042026/traces.jsonl.gz]
        [--max-context 262144]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from histate.sim.traces import LoadOptions, load_trace

TRACE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "cc-traces-weka-042026" / "traces.jsonl.gz"
WINDOW_PAGES = 4


def longest_seen_prefix(keys: tuple, seen: set) -> int:
    """Pages of the longest prefix of `keys` seen before (keys are prefix-chained: a key names its prefix)."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in seen:
            lo = mid
        else:
            hi = mid - 1
    return lo


def classify(workload) -> tuple[Counter, Counter]:
    requests, pages = Counter(), Counter()
    for session in workload.iter_sessions():
        seen: set = set()
        prev_end = None
        for req in session.requests:
            reused = longest_seen_prefix(req.page_keys, seen)
            if prev_end is not None and reused:
                offset = prev_end - reused
                label = ("at the previous end" if offset == 0 else
                         f"{offset} page{'s' if offset > 1 else ''} before it" if 0 < offset <= WINDOW_PAGES else
                         f"more than {WINDOW_PAGES} pages before it" if offset > 0 else "beyond it")
                requests[label] += 1
                pages[label] += reused
            seen.update(req.page_keys)
            prev_end = len(req.page_keys)
    return requests, pages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--format", default="weka")
    ap.add_argument("--max-context", type=int, default=262144)
    args = ap.parse_args()
    if not args.trace.exists():
        print(f"SKIP: {args.trace} not found (the traces live in ../shared, which this checkout lacks)")
        return 0
    workload = load_trace(args.trace, args.format, LoadOptions(max_context_num_tokens=args.max_context))
    requests, pages = classify(workload)
    total = sum(pages.values())
    print(f"{workload.name}: {workload.stats.requests} requests; hits within a session, by where they end")
    print(f"{'hit ends':>28} {'requests':>9} {'reused pages':>13} {'share':>7}")
    for label, n in sorted(requests.items(), key=lambda kv: -pages[kv[0]]):
        print(f"{label:>28} {n:>9,} {pages[label]:>13,} {100 * pages[label] / total:>6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
