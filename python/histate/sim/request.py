"""The request and session records every workload source produces and the replay driver consumes.

Owns the shared vocabulary of the simulator's input side: `Request` (one LLM call), `Session` (an
ordered chain of requests, with optional subagent child sessions), `Workload` (the sessions of one
trace or synthetic generator, plus the counters that say what the loader kept and dropped) and
`RequestFlag`. Trace loaders (`histate.sim.traces`) and synthetic generators
(`histate.sim.workloads`) build these; nothing here does I/O.

Page keys
---------
A request's `page_keys` has one key per *full* page of its prompt (`input_num_tokens //
page_num_tokens` keys; the trailing partial page is never cacheable). Keys are prefix-chained: key i
identifies the whole prompt prefix [0, (i + 1) * P), so two requests share their first n keys exactly
when their first n pages of prompt are equal. Keys are small ints unique within one `Workload`; never
mix requests of two workloads in one cache.

Timing model (closed loop, as kv-cache-tester's default "think-only" replay)
---------------------------------------------------------------------------
A session is *released* when the driver admits it (root sessions) or when its parent's request
`spawn_after_index` completes (subagents; -1 = when the parent session is released). Request 0
arrives `gap_before_s` after the release. Request i > 0 arrives `gap_before_s` after the later of
(a) the completion (last output token) of request i - 1 and (b) the completion of every child
session named in `after_sessions` (a parent waits for the subagents it spawned). `offset_s` keeps
the original arrival time relative to the root session start, for open-loop replays.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Optional

PAGE_NUM_TOKENS = 64
"""Simulator page: 64 tokens (Weka `block_size`, one `hash_id` per page; the GDN chunk size)."""


class RequestFlag(enum.IntFlag):
    """What kind of context change produced a request. MUTATION is set with every non-append kind."""

    NONE = 0
    SUBAGENT = enum.auto()     # issued by a subagent child session
    MUTATION = enum.auto()     # any non-append edit of the context (one of the four kinds below)
    TRUNCATION = enum.auto()   # prompt cut inside an earlier message; the suffix is not restored
    REWIND_EDIT = enum.auto()  # rewound to an earlier turn and its message edited
    FORK = enum.auto()         # continued from the end of an earlier turn (later turns abandoned)
    COMPACTION = enum.auto()   # context replaced by a summary (keeps only the system prompt)


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One LLM call. Identity-hashed (eq=False): usable as a dict key without hashing page_keys."""

    uid: int                          # unique within the workload, dense from 0
    session_id: str
    index: int                        # position within its session
    input_num_tokens: int
    output_num_tokens: int
    page_keys: tuple                  # one prefix-chained key per full prompt page
    gap_before_s: float               # closed-loop think/tool gap (module docstring)
    offset_s: float = 0.0             # original arrival, seconds after the root session start
    flags: RequestFlag = RequestFlag.NONE
    parent_session_id: Optional[str] = None
    after_sessions: tuple = ()        # child session ids that must complete before this arrives
    output_page_keys: tuple = ()      # keys of the full pages the output completes, when known
    original_latency_s: Optional[float] = None  # server time in the original trace (Weka api_time)
    checkpoint_hint_tokens: tuple = ()  # positions the application names for checkpoints (docs/hints.md)

    @property
    def num_pages(self) -> int:
        return len(self.page_keys)

    def keys_through(self, num_pages: int) -> tuple:
        """The first `num_pages` page keys of prompt + output, as an engine caches them at finish:
        the prompt's keys, the output pages the workload knows (`output_page_keys`: a later request
        that carries this output matches them), then keys of this request's own for output pages
        no later request shares (("out", uid, page): deterministic, never equal to another key)."""
        keys = (self.page_keys + self.output_page_keys)[:num_pages]
        if len(keys) < num_pages:
            keys += tuple(("out", self.uid, i) for i in range(len(keys), num_pages))
        return keys

    @property
    def is_mutation(self) -> bool:
        return bool(self.flags & RequestFlag.MUTATION)


@dataclass(frozen=True, slots=True, eq=False)
class Session:
    """An ordered chain of requests sharing one context, with its subagent children."""

    session_id: str
    requests: tuple
    parent_session_id: Optional[str] = None
    spawn_after_index: int = -1       # parent request whose completion releases this session
    start_offset_s: float = 0.0       # original start, seconds after the root session start
    subagents: tuple = ()             # child Sessions (may nest)

    def iter_sessions(self) -> Iterator["Session"]:
        """This session, then every descendant, depth first."""
        yield self
        for child in self.subagents:
            yield from child.iter_sessions()


@dataclass(slots=True)
class WorkloadStats:
    """Counters a loader or generator fills in; every dropped item is counted here, none silently."""

    sessions: int = 0                 # root sessions kept
    subagent_sessions: int = 0        # child sessions kept
    requests: int = 0                 # requests kept (all sessions)
    input_tokens: int = 0
    output_tokens: int = 0
    requests_over_context: int = 0    # requests dropped by the max-context rule (incl. the rest
                                      # of truncated sessions and of their unspawned subagents)
    input_tokens_over_context: int = 0
    sessions_truncated: int = 0       # sessions cut at their first over-long request
    sessions_dropped_empty: int = 0   # sessions (root or child) with no request left
    malformed_skipped: int = 0        # records skipped with on_error="skip" (see `errors`)
    gaps_capped: int = 0              # gaps shortened by max_gap_s
    prefix_tokens_unmatched: int = 0  # TraceLab: provider prefix beyond the session's own context
    compactions: int = 0
    mutations: dict = field(default_factory=dict)  # RequestFlag name -> count (synthetic workloads)
    errors: list = field(default_factory=list)     # first messages of skipped malformed records

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def merge(self, other: "WorkloadStats") -> None:
        """Add `other`'s counters to these (errors appended, mutation counts summed)."""
        for name in self.__slots__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                for key, count in theirs.items():
                    mine[key] = mine.get(key, 0) + count
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, name, mine + theirs)


@dataclass(slots=True)
class Workload:
    """The sessions of one trace or synthetic generator, ready to replay."""

    name: str
    sessions: list                    # root Sessions; subagents nested inside
    stats: WorkloadStats
    page_num_tokens: int = PAGE_NUM_TOKENS
    open_loop: bool = False           # True: arrivals are fixed times (start_offset_s + offset_s)
    params: dict = field(default_factory=dict)  # how it was made (paths, options, seeds)
    root_ids: tuple = ()              # every root session id of the source, in source order, including
                                      # roots the max-context rule emptied (absent from `sessions`):
                                      # what sampling "from all roots" draws from; () = `sessions` is all

    def iter_sessions(self) -> Iterator[Session]:
        for root in self.sessions:
            yield from root.iter_sessions()

    def iter_requests(self) -> Iterator[Request]:
        for session in self.iter_sessions():
            yield from session.requests

    @property
    def num_requests(self) -> int:
        return sum(len(s.requests) for s in self.iter_sessions())


def common_prefix_pages(a: tuple, b: tuple) -> int:
    """Number of leading page keys two requests share (= shared prompt prefix in pages)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PageKeyAllocator:
    """Hands out page keys unique within one workload (a counter; deterministic for a given input).

    Two ways to get keys: `fresh(n)` for content never seen before (synthetic workloads, TraceLab,
    where every new page is new by construction), and `chain(...)` for traces that name page
    contents (Weka `hash_ids`, Mooncake block ids): key_i = intern((key_{i-1}, content_i)) inside a
    namespace. Interning instead of hashing makes equal keys mean equal prefixes with no collision
    risk, and keeps keys small ints (cheap to hash in the cache's tree).
    """

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 1

    def fresh(self, num_keys: int) -> range:
        start = self._next
        self._next += num_keys
        return range(start, self._next)

    def namespace(self) -> "KeyNamespace":
        """A content namespace (Weka: one conversation incl. its subagents; Mooncake: global)."""
        return KeyNamespace(self, self.fresh(1)[0])


class KeyNamespace:
    """Interning table of one namespace: (parent key, content) -> key."""

    __slots__ = ("_alloc", "root", "_table")

    def __init__(self, alloc: PageKeyAllocator, root: int) -> None:
        self._alloc = alloc
        self.root = root  # parent of the first page
        self._table: dict = {}

    def chain(self, parent_key: int, contents) -> list:
        """Keys of pages with `contents` following the page whose key is `parent_key`."""
        table = self._table
        alloc = self._alloc
        out = []
        append = out.append
        for content in contents:
            pair = (parent_key, content)
            key = table.get(pair)
            if key is None:
                key = alloc._next
                alloc._next = key + 1
                table[pair] = key
            append(key)
            parent_key = key
        return out


PageKey = Hashable
