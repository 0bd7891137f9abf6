"""Loader for TraceLab round traces (Zhu et al. 2026; uw-syfi/TraceLab), JSON lines, gzip or not.

One row per LLM round: `session_id`, `input_tokens_total = prefix_tokens + newly_append_tokens`,
`output_tokens`, `timing_events[]` and `tools[]` (schema:
/work/shared/traces/tracelab-schema-example/README.md). Rows of a session are taken in file
(ingestion) order, since `(session_id, round_index)` is not unique in the dataset.

No block hashes: keys come from the prefix/append structure
--------------------------------------------------------------
Each session keeps a *context stream*: the previous round's prompt followed by its output (what
TraceLab's own replayer, `replay/src/session.rs`, carries forward). Round r's prompt is the first
`shared` tokens of that stream followed by `input_tokens_total - shared` new tokens; new pages get
fresh keys, so a page key identifies its prefix. `shared` depends on `prefix_source`:
* "provider" (default; TraceLab's replayer and its `csv_export`): `shared = prefix_tokens`, the
  provider-reported cached prefix. Provider-side misses therefore show up as reuse *inside* the
  earlier context, as the replayed server would see them.
* "growth": the context is append-only (`shared` = the whole stream, capped at the prompt length),
  the ideal-cache reading of the same rows.
Both: a *compaction* (the prompt shrinks by at least `compaction_drop_num_tokens`, 64K by TraceLab's
definition) breaks the prefix: `shared = prefix_tokens` and the round is flagged COMPACTION. `shared`
is capped at the stream length (a provider prefix that reaches into another session's cache, e.g. a
shared system prompt, is not reproduced; counted in `stats.prefix_tokens_unmatched`).

Gaps: arrival of a round = the latest timestamp among its input events (user_message / tool_result),
end of a round = the latest of its other events; the gap before round r is arrival(r) - end(r - 1)
(tool latency plus human think time). Without timestamps: the previous round's summed
`tool_wall_latency_ms`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from ..request import PageKeyAllocator, Request, RequestFlag, Session, Workload, WorkloadStats
from ._source import (FieldReader, LoadOptions, TraceFormatError, iter_json_records, progress_bar,
                      record_error, trace_files)

TRACELAB_SUFFIXES = (".jsonl", ".jsonl.gz")
PREFIX_SOURCES = ("provider", "growth")
COMPACTION_DROP_NUM_TOKENS = 65536  # TraceLab: a compaction is a context drop of >= 64K tokens
INPUT_EVENT_TYPES = frozenset({"user_message", "tool_result"})


@dataclass(slots=True)
class _Round:
    input_num_tokens: int
    prefix_num_tokens: int
    output_num_tokens: int
    arrival_s: Optional[float]     # epoch seconds
    end_s: Optional[float]
    tool_wait_s: float


def load_tracelab(path, options: LoadOptions = LoadOptions(), *, provider: Optional[str] = None,
                  prefix_source: str = "provider",
                  compaction_drop_num_tokens: int = COMPACTION_DROP_NUM_TOKENS) -> Workload:
    """Load TraceLab rounds into a `Workload`; `provider="codex"` selects the paper's Codex subset."""
    if prefix_source not in PREFIX_SOURCES:
        raise ValueError(f"prefix_source must be one of {PREFIX_SOURCES}, got {prefix_source!r}")
    stats = WorkloadStats()
    rounds_by_session: dict = {}
    for file_path in trace_files(path, TRACELAB_SUFFIXES):
        for line, record in iter_json_records(file_path):
            try:
                parsed = _parse_round(FieldReader(file_path, line), record, provider)
            except TraceFormatError as err:
                record_error(err, options, stats)
                continue
            if parsed is not None:
                session_id, rnd = parsed
                rounds_by_session.setdefault(session_id, []).append(rnd)

    first_arrivals = [r[0].arrival_s for r in rounds_by_session.values() if r[0].arrival_s is not None]
    epoch_s = min(first_arrivals) if first_arrivals else 0.0
    keys, uids = PageKeyAllocator(), itertools.count()
    sessions = []
    for session_id, rounds in progress_bar(list(rounds_by_session.items()), options, "tracelab"):
        session = _build_session(session_id, rounds, options, stats, keys, uids, prefix_source,
                                 compaction_drop_num_tokens, epoch_s)
        if session is None:
            stats.sessions_dropped_empty += 1
        else:
            stats.sessions += 1
            sessions.append(session)
    params = {"path": str(path), "format": "tracelab", "provider": provider, "prefix_source": prefix_source,
              "compaction_drop_num_tokens": compaction_drop_num_tokens, **options.__dict__}
    return Workload(name=f"tracelab:{path}", sessions=sessions, stats=stats,
                    page_num_tokens=options.page_num_tokens, params=params, root_ids=tuple(rounds_by_session))


def _parse_round(reader: FieldReader, record, provider: Optional[str]):
    record = reader.obj(record, "<round>")
    if provider is not None and record.get("provider") != provider:
        return None
    session_id = reader.get(record, "session_id", "", "str")
    total = reader.num_tokens(record, "input_tokens_total", "")
    prefix = reader.get(record, "prefix_tokens", "", "int", minimum=0)
    append = reader.get(record, "newly_append_tokens", "", "int", minimum=0)
    if prefix + append != total:
        raise reader.fail("input_tokens_total", f"{total} != prefix_tokens + newly_append_tokens = "
                                                f"{prefix} + {append}")
    output = reader.get(record, "output_tokens", "", "int", minimum=0)
    arrival_s = end_s = None
    first_s = None
    events = reader.get(record, "timing_events", "", "list", required=False, default=[])
    for i, event in enumerate(events):
        event = reader.obj(event, f"timing_events[{i}]")
        stamp = reader.get(event, "timestamp", f"timing_events[{i}].", "str")
        try:
            ts = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise reader.fail(f"timing_events[{i}].timestamp", f"not an ISO-8601 time: {stamp!r}") from None
        first_s = ts if first_s is None else min(first_s, ts)
        if event.get("event_type") in INPUT_EVENT_TYPES:
            arrival_s = ts if arrival_s is None else max(arrival_s, ts)
        else:
            end_s = ts if end_s is None else max(end_s, ts)
    if arrival_s is None:
        arrival_s = first_s
    tool_wait_s = 0.0
    for i, tool in enumerate(reader.get(record, "tools", "", "list", required=False, default=[])):
        tool = reader.obj(tool, f"tools[{i}]")
        latency_ms = reader.get(tool, "tool_wall_latency_ms", f"tools[{i}].", "num", required=False, default=0,
                                minimum=0)
        tool_wait_s += latency_ms / 1000.0
    return session_id, _Round(total, prefix, output, arrival_s, end_s, tool_wait_s)


def _build_session(session_id: str, rounds: list, options: LoadOptions, stats: WorkloadStats,
                   keys: PageKeyAllocator, uids, prefix_source: str, compaction_drop: int,
                   epoch_s: float) -> Optional[Session]:
    page = options.page_num_tokens
    stream_keys: tuple = ()      # full pages of the context stream
    stream_num_tokens = 0
    prev: Optional[_Round] = None   # previous kept round
    prev_input = None            # prompt length of the previous round, kept or not
    requests = []
    start_s = rounds[0].arrival_s
    for position, rnd in enumerate(rounds):
        compaction = prev_input is not None and rnd.input_num_tokens <= prev_input - compaction_drop
        prev_input = rnd.input_num_tokens
        if not options.fits(rnd.input_num_tokens):
            stats.requests_over_context += 1
            stats.input_tokens_over_context += rnd.input_num_tokens
            if options.overflow == "truncate_session":
                stats.sessions_truncated += 1
                rest = rounds[position + 1:]
                stats.requests_over_context += len(rest)
                stats.input_tokens_over_context += sum(r.input_num_tokens for r in rest)
                break
            continue
        if prefix_source == "provider" or compaction:
            shared = rnd.prefix_num_tokens
        else:
            shared = stream_num_tokens
        if shared > stream_num_tokens:
            stats.prefix_tokens_unmatched += shared - stream_num_tokens
            shared = stream_num_tokens
        shared = min(shared, rnd.input_num_tokens)
        kept_pages = shared // page
        prompt_keys = stream_keys[:kept_pages] + tuple(keys.fresh(rnd.input_num_tokens // page - kept_pages))
        stream_num_tokens = rnd.input_num_tokens + rnd.output_num_tokens
        output_keys = tuple(keys.fresh(stream_num_tokens // page - len(prompt_keys)))
        stream_keys = prompt_keys + output_keys

        if prev is None:
            gap_s = 0.0
        elif rnd.arrival_s is not None and prev.end_s is not None:
            gap_s = max(0.0, rnd.arrival_s - prev.end_s)
        else:
            gap_s = prev.tool_wait_s
        gap_s = options.cap_gap(gap_s, stats)
        flags = RequestFlag.NONE
        if compaction:
            flags = RequestFlag.COMPACTION | RequestFlag.MUTATION
            stats.compactions += 1
        offset_s = (rnd.arrival_s - start_s) if (rnd.arrival_s is not None and start_s is not None) else 0.0
        requests.append(Request(
            uid=next(uids), session_id=session_id, index=len(requests), input_num_tokens=rnd.input_num_tokens,
            output_num_tokens=rnd.output_num_tokens, page_keys=prompt_keys, gap_before_s=gap_s,
            offset_s=offset_s, flags=flags, output_page_keys=output_keys))
        stats.requests += 1
        stats.input_tokens += rnd.input_num_tokens
        stats.output_tokens += rnd.output_num_tokens
        prev = rnd
    if not requests:
        return None
    start_offset_s = (start_s - epoch_s) if start_s is not None else 0.0
    return Session(session_id=session_id, requests=tuple(requests), start_offset_s=start_offset_s)
