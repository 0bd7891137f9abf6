"""Loader for the Weka / SemiAnalysis Claude Code traces (`cc-traces-weka-042026` and its schema).

Accepts what the corpus ships as: a JSON-lines file with one conversation per line (gzip'd or not;
the layout of /work/shared/traces/cc-traces-weka-042026/traces.jsonl.gz), a single conversation
`.json` file, or a directory of either (the `traces/trace_NNNN.json` layout of
callanjfox/kv-cache-tester). Schema: /work/shared/research/anchors.md §1.2.

Mapping to `Request`s
---------------------
* Page keys. `hash_ids` has one id per `block_size`-token block of the input (`len == in //
  block_size`), scoped per conversation ("local"); subagents share their parent's namespace.
  Keys are prefix-chained by interning ((previous key, id) -> key) in one namespace per root
  conversation, so equal keys mean equal prefixes. A block larger than a page yields one key per
  page (content (id, j)); pages of the input beyond the blocks the ids cover get fresh keys.
* Subagents. A `type: "subagent"` entry becomes a child `Session` (id `<parent>/<agent_id>`)
  released by the parent's preceding request; the parent's next request waits for it
  (`after_sessions`). In these traces the marker's `t` is the subagent's *completion* time and
  `t - duration_ms/1000` its start (checked on the local copy: siblings spawned together share that
  start, and the parent resumes after the last one ends).
* Gaps. Request i > 0: its `think_time` (client delay after the previous response); without it
  `t_i - t_{i-1} - api_time_{i-1}` (kv-cache-tester's fallback). After subagents:
  `t_i - max(marker t)`. A root's first request arrives on admission (gap 0); a child's first
  request: its start minus the end of the parent request that spawned it.
* Output pages. When the next request of the same session extends this prompt by at least the
  output's length, the output is taken to be carried verbatim and the keys of the pages it completes
  are that request's keys at those positions (`output_page_keys`); otherwise (no next request, a
  different prefix, or a next prompt shorter than prompt + output: 11% of extending turns on the
  dev split, e.g. thinking dropped from the context) they stay unknown. `hash_ids` cover inputs
  only, so the trace cannot confirm that the carried tokens are the output's: this is an assumption.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from ..request import PageKeyAllocator, Request, RequestFlag, Session, Workload, WorkloadStats
from ._source import (FieldReader, LoadOptions, TraceFormatError, iter_json_records, progress_bar,
                      record_error, trace_files)

WEKA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


@dataclass(slots=True)
class _RawRequest:
    t_s: float
    input_num_tokens: int
    output_num_tokens: int
    hash_ids: list
    think_time_s: Optional[float]
    api_time_s: Optional[float]
    where: str          # field path prefix, for error messages

    @property
    def end_s(self) -> float:
        return self.t_s + (self.api_time_s or 0.0)


@dataclass(slots=True)
class _RawSubagent:
    t_s: float          # completion time in the parent's clock
    start_s: float      # start time in the parent's clock
    agent_id: str
    entries: list


def load_weka(path, options: LoadOptions = LoadOptions(), session_ids: Optional[Iterable[str]] = None) -> Workload:
    """Load Weka conversations into a `Workload` (see module docstring for the mapping)."""
    stats = WorkloadStats()
    session_ids = list(session_ids) if session_ids is not None else None
    sessions, root_ids = [], []
    for root_id, session in _iter_roots(path, options, stats, session_ids):
        root_ids.append(root_id)
        if session is not None:
            sessions.append(session)
    params = {"path": str(path), "format": "weka", **options.__dict__}
    if session_ids is not None:
        params["session_ids"] = sorted(set(session_ids))
    return Workload(name=f"weka:{path}", sessions=sessions, stats=stats,
                    page_num_tokens=options.page_num_tokens, params=params, root_ids=tuple(root_ids))


def iter_weka_sessions(path, options: LoadOptions = LoadOptions(), stats: Optional[WorkloadStats] = None,
                       *, session_ids: Optional[Iterable[str]] = None) -> Iterator[Session]:
    """Stream root sessions one conversation at a time (memory: one conversation's keys).

    Request uids are dense from 0 over the yielded sessions; `stats` (if given) is updated as
    sessions are yielded, a skipped malformed conversation contributes only its skip count."""
    for _, session in _iter_roots(path, options, stats, session_ids):
        if session is not None:
            yield session


def _iter_roots(path, options: LoadOptions, stats: Optional[WorkloadStats],
                session_ids: Optional[Iterable[str]]) -> Iterator[tuple]:
    """(root id, root Session or None when the max-context rule left it empty) per well-formed
    conversation, in file order."""
    stats = stats if stats is not None else WorkloadStats()
    keys = PageKeyAllocator()
    next_uid = 0
    wanted = set(session_ids) if session_ids is not None else None
    records = ((p, line, rec) for p in trace_files(path, WEKA_SUFFIXES) for line, rec in iter_json_records(p))
    for file_path, line, record in progress_bar(records, options, "weka"):
        reader = FieldReader(file_path, line)
        try:
            record = reader.obj(record, "<session>")
            session_id = reader.get(record, "id", "", "str")
            if wanted is not None and session_id not in wanted:
                continue
            local = WorkloadStats()       # merged only if the whole conversation is well formed
            builder = _SessionBuilder(reader, options, local, keys, itertools.count(next_uid), record)
            session = builder.build_root(session_id)
        except TraceFormatError as err:
            record_error(err, options, stats)
            continue
        stats.merge(local)
        if session is None:
            stats.sessions_dropped_empty += 1
            yield session_id, None
            continue
        next_uid += sum(len(s.requests) for s in session.iter_sessions())
        stats.sessions += 1
        yield session_id, session


class _SessionBuilder:
    """Builds one conversation (root + subagents) in one key namespace."""

    def __init__(self, reader: FieldReader, options: LoadOptions, stats: WorkloadStats,
                 keys: PageKeyAllocator, uids: Iterator[int], record: dict) -> None:
        self.reader, self.options, self.stats, self.uids = reader, options, stats, uids
        self.keys = keys
        self.namespace = keys.namespace()
        block = reader.get(record, "block_size", "", "int", required=False, default=options.page_num_tokens,
                           minimum=1)
        page = options.page_num_tokens
        if block % page != 0 and page % block != 0:
            raise reader.fail("block_size", f"{block} is neither a multiple nor a divisor of the "
                                            f"simulator page ({page} tokens)")
        self.block_num_tokens = block
        self.entries = self._parse_entries(reader.get(record, "requests", "", "list"), "requests")

    # ---------------------------------------------------------------- parsing (validation only)
    def _parse_entries(self, items: list, prefix: str) -> list:
        reader, block = self.reader, self.block_num_tokens
        entries = []
        for i, item in enumerate(items):
            where = f"{prefix}[{i}]."
            item = reader.obj(item, f"{prefix}[{i}]")
            t_s = reader.get(item, "t", where, "num", minimum=0)
            if item.get("type") == "subagent":
                children = self._parse_entries(reader.get(item, "requests", where, "list"), f"{where}requests")
                duration_ms = reader.get(item, "duration_ms", where, "num", required=False, minimum=0)
                agent_id = reader.get(item, "agent_id", where, "str", required=False, default=f"sa{i}")
                if duration_ms is None:  # no duration: assume the children span their own recorded times
                    last = next((e for e in reversed(children) if isinstance(e, _RawRequest)), None)
                    duration_ms = 1000.0 * (last.end_s if last else 0.0)
                entries.append(_RawSubagent(t_s, t_s - duration_ms / 1000.0, agent_id, children))
                continue
            num_in = reader.num_tokens(item, "in", where)
            num_out = reader.get(item, "out", where, "int", minimum=0)
            hash_ids = reader.get(item, "hash_ids", where, "list")
            if len(hash_ids) != num_in // block:
                raise reader.fail(f"{where}hash_ids", f"has {len(hash_ids)} ids, expected in // block_size = "
                                                      f"{num_in} // {block} = {num_in // block}")
            think = reader.get(item, "think_time", where, "num", required=False, minimum=0)
            api = reader.get(item, "api_time", where, "num", required=False, minimum=0)
            entries.append(_RawRequest(t_s, num_in, num_out, hash_ids, think, api, where))
        return entries

    # ---------------------------------------------------------------- building
    def build_root(self, session_id: str) -> Optional[Session]:
        return self._build(session_id, self.entries, parent_id=None, spawn_after_index=-1,
                           base_s=0.0, release_s=0.0)

    def _build(self, session_id: str, entries: list, parent_id: Optional[str], spawn_after_index: int,
               base_s: float, release_s: float) -> Optional[Session]:
        """One session; `base_s` = its t=0 and `release_s` = its release, both on the root clock."""
        options, stats = self.options, self.stats
        kept: list = []          # (raw, gap_s, after_sessions)
        children: list = []
        pending: list = []       # (child session id, completion time on this session's clock)
        truncated = False
        flags = RequestFlag.SUBAGENT if parent_id is not None else RequestFlag.NONE
        used_child_ids: set = set()
        for entry in entries:
            if isinstance(entry, _RawSubagent):
                if truncated:
                    self._count_dropped_subtree(entry)
                    continue
                child_id = f"{session_id}/{entry.agent_id}"
                while child_id in used_child_ids:
                    child_id += "'"
                used_child_ids.add(child_id)
                child_release = base_s + kept[-1][0].end_s if kept else release_s
                child = self._build(child_id, entry.entries, session_id, len(kept) - 1,
                                    base_s + entry.start_s, child_release)
                if child is None:
                    stats.sessions_dropped_empty += 1
                    continue
                stats.subagent_sessions += 1
                children.append(child)
                pending.append((child_id, entry.t_s))
                continue
            if truncated:
                stats.requests_over_context += 1
                stats.input_tokens_over_context += entry.input_num_tokens
                continue
            if not options.fits(entry.input_num_tokens):
                stats.requests_over_context += 1
                stats.input_tokens_over_context += entry.input_num_tokens
                if options.overflow == "truncate_session":
                    truncated = True
                    stats.sessions_truncated += 1
                continue
            if pending:
                gap_s = entry.t_s - max(t for _, t in pending)
            elif not kept:  # roots: admission is the first arrival; children: start - release
                gap_s = 0.0 if parent_id is None else base_s + entry.t_s - release_s
            elif entry.think_time_s is not None:
                gap_s = entry.think_time_s
            else:
                gap_s = entry.t_s - kept[-1][0].end_s
            gap_s = options.cap_gap(max(0.0, gap_s), stats)
            kept.append((entry, gap_s, tuple(cid for cid, _ in pending)))
            pending = []
        if not kept:
            return None
        page_keys = self._page_keys([raw for raw, _, _ in kept])
        requests = []
        for i, (raw, gap_s, after) in enumerate(kept):
            output_keys = ()
            if i + 1 < len(kept):
                output_keys = self._output_keys(raw, kept[i + 1][0], page_keys[i], page_keys[i + 1])
            stats.requests += 1
            stats.input_tokens += raw.input_num_tokens
            stats.output_tokens += raw.output_num_tokens
            requests.append(Request(
                uid=next(self.uids), session_id=session_id, index=i, input_num_tokens=raw.input_num_tokens,
                output_num_tokens=raw.output_num_tokens, page_keys=page_keys[i], gap_before_s=gap_s,
                offset_s=base_s + raw.t_s, flags=flags, parent_session_id=parent_id, after_sessions=after,
                output_page_keys=output_keys, original_latency_s=raw.api_time_s))
        return Session(session_id=session_id, requests=tuple(requests), parent_session_id=parent_id,
                       spawn_after_index=spawn_after_index, start_offset_s=base_s, subagents=tuple(children))

    def _count_dropped_subtree(self, sub: _RawSubagent) -> None:
        for e in sub.entries:
            if isinstance(e, _RawSubagent):
                self._count_dropped_subtree(e)
            else:
                self.stats.requests_over_context += 1
                self.stats.input_tokens_over_context += e.input_num_tokens
        self.stats.sessions_dropped_empty += 1

    def _page_keys(self, raws: list) -> list:
        """Prefix-chained keys for each request, reusing the previous request's keys on the common prefix."""
        page, block = self.options.page_num_tokens, self.block_num_tokens
        ns = self.namespace
        out = []
        prev_contents: list = []
        prev_keys: tuple = ()
        for raw in raws:
            contents = self._contents(raw, page, block)
            n = len(prev_contents)
            if len(contents) >= n and contents[:n] == prev_contents:
                lcp = n
            else:
                lcp = 0
                for a, b in zip(contents, prev_contents):
                    if a != b:
                        break
                    lcp += 1
            new = contents[lcp:]
            for j, c in enumerate(new):
                if not _is_content(c):
                    raise self.reader.fail(f"{raw.where}hash_ids", f"entry for page {lcp + j} is {c!r}, expected int")
            parent = prev_keys[lcp - 1] if lcp else ns.root
            keys = prev_keys[:lcp] + tuple(ns.chain(parent, new))
            num_pages = raw.input_num_tokens // page
            if len(keys) < num_pages:  # pages of a partial trailing block: content unknown, never shared
                keys += tuple(self.keys.fresh(num_pages - len(keys)))
            out.append(keys)
            prev_contents, prev_keys = contents, keys
        return out

    @staticmethod
    def _contents(raw: _RawRequest, page: int, block: int) -> list:
        ids = raw.hash_ids
        if block == page:
            return ids
        if block > page:
            per = block // page
            return [(h, j) for h in ids for j in range(per)]
        per = page // block
        return [tuple(ids[k:k + per]) for k in range(0, len(ids) - per + 1, per)]

    def _output_keys(self, raw: _RawRequest, next_raw: _RawRequest, keys: tuple, next_keys: tuple) -> tuple:
        n = len(keys)
        extends = len(next_keys) > n and (n == 0 or next_keys[n - 1] == keys[n - 1])
        if not extends or next_raw.input_num_tokens < raw.input_num_tokens + raw.output_num_tokens:
            return ()
        num_out_pages = (raw.input_num_tokens + raw.output_num_tokens) // self.options.page_num_tokens - n
        return next_keys[n:n + num_out_pages]


def _is_content(c) -> bool:
    if type(c) is int:
        return True
    if type(c) is tuple:
        return all(type(x) is int for x in c)
    return False
