"""Reading trace files: paths, gzip, JSON lines, and errors that name file, line and field.

Owns `TraceFormatError`, `LoadOptions` (the options every loader shares, including the max-context
clipping rule) and the streaming record reader. Loaders never skip a bad record silently: they raise
`TraceFormatError`, or with `on_error="skip"` count it in `WorkloadStats.malformed_skipped` and keep
its message in `WorkloadStats.errors`.
"""
from __future__ import annotations

import gzip
import math
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional

import orjson

from ..request import PAGE_NUM_TOKENS, WorkloadStats

DEFAULT_MAX_CONTEXT_NUM_TOKENS = 131072
OVERFLOW_RULES = ("truncate_session", "drop_request")
MAX_KEPT_ERRORS = 20
MAX_INPUT_NUM_TOKENS = 1 << 24
"""Largest prompt a trace record may name (16.8M tokens, above every served model's context):
page keys are built per 64-token page, so an unbounded `in` (or `--max-context`) would allocate
without bound; a record above it is malformed."""


class TraceFormatError(ValueError):
    """A trace record is malformed. The message names the file, the line and the field."""

    def __init__(self, path: str, line: Optional[int], field: str, message: str) -> None:
        self.path, self.line, self.field = str(path), line, field
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {field}: {message}")


@dataclass(frozen=True)
class LoadOptions:
    """Options shared by every trace loader.

    Max-context clipping rule: a request whose *input* exceeds `max_context_num_tokens` cannot be
    served by the model. With `overflow="truncate_session"` (default; kv-cache-tester's
    `--max-context`, whose sessions end TRUNCATED) the session ends before its first such request:
    that request and every later one are dropped, and subagents spawned after it with them. With
    `overflow="drop_request"` only the over-long requests are dropped and the session continues
    (the next request keeps its own gap). Either way the counts land in `WorkloadStats`.
    `max_context_num_tokens=None` disables clipping. Outputs are not counted against the limit.
    """

    page_num_tokens: int = PAGE_NUM_TOKENS
    max_context_num_tokens: Optional[int] = DEFAULT_MAX_CONTEXT_NUM_TOKENS
    overflow: str = "truncate_session"
    max_gap_s: Optional[float] = None     # cap every closed-loop gap (counted in gaps_capped)
    on_error: str = "raise"               # "raise" | "skip": skip the malformed record (a Weka
                                          # conversation, a TraceLab round, a Mooncake request), counted
    progress: bool = False                # tqdm progress bar over sessions

    def __post_init__(self) -> None:
        if self.page_num_tokens <= 0:
            raise ValueError(f"page_num_tokens must be positive, got {self.page_num_tokens}")
        if self.max_context_num_tokens is not None and not 0 < self.max_context_num_tokens <= MAX_INPUT_NUM_TOKENS:
            raise ValueError(f"max_context_num_tokens must be in [1, {MAX_INPUT_NUM_TOKENS}] or None, "
                             f"got {self.max_context_num_tokens}")
        if self.overflow not in OVERFLOW_RULES:
            raise ValueError(f"overflow must be one of {OVERFLOW_RULES}, got {self.overflow!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.max_gap_s is not None and not (math.isfinite(self.max_gap_s) and self.max_gap_s >= 0):
            raise ValueError(f"max_gap_s must be a finite number >= 0 or None, got {self.max_gap_s}")

    def fits(self, input_num_tokens: int) -> bool:
        return self.max_context_num_tokens is None or input_num_tokens <= self.max_context_num_tokens

    def cap_gap(self, gap_s: float, stats: WorkloadStats) -> float:
        if self.max_gap_s is not None and gap_s > self.max_gap_s:
            stats.gaps_capped += 1
            return self.max_gap_s
        return gap_s


def record_error(err: TraceFormatError, options: LoadOptions, stats: WorkloadStats) -> None:
    """Raise, or count and remember the error when skipping is allowed."""
    if options.on_error == "raise":
        raise err
    stats.malformed_skipped += 1
    if len(stats.errors) < MAX_KEPT_ERRORS:
        stats.errors.append(str(err))


def trace_files(path: str, suffixes: tuple) -> list:
    """The files a path names: itself, or the matching files of a directory in name order."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if n.endswith(suffixes))
        if not names:
            raise FileNotFoundError(f"{path}: no trace files ({', '.join(suffixes)}) in this directory")
        return [os.path.join(path, n) for n in names]
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such trace file or directory")
    return [path]


GZIP_MAGIC = b"\x1f\x8b"


def iter_json_records(path: str) -> Iterator[tuple]:
    """Yield (line_number, value) for every JSON value in a file.

    JSON Lines (one value per line, blank lines ignored) or a single JSON document (a `.json` file,
    possibly pretty-printed; its records carry line number None). gzip is detected by its magic
    bytes, sniffed with `peek` on the one open file, so pipes and process substitutions
    (`/dev/stdin`, `<(zcat ...)`) lose nothing. A truncated or corrupt gzip stream raises
    `TraceFormatError` at the line where it breaks.
    """
    line_number = 0
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if raw.peek(2)[:2] == GZIP_MAGIC else raw
        try:
            if path.endswith(".json") or path.endswith(".json.gz"):
                data = f.read()
                try:
                    value = orjson.loads(data)
                except orjson.JSONDecodeError as e:
                    raise TraceFormatError(path, getattr(e, "lineno", None), "<json>", f"invalid JSON: {e}") from None
                yield None, value
                return
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = orjson.loads(line)
                except orjson.JSONDecodeError as e:
                    raise TraceFormatError(path, line_number, "<json>", f"invalid JSON: {e}") from None
                yield line_number, value
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # the stream ends or breaks mid-file
            raise TraceFormatError(path, line_number + 1, "<gzip>", f"truncated or corrupt gzip stream ({e})") from None


_KIND_CHECKS = {
    "int": lambda v: type(v) is int,
    "num": lambda v: type(v) is float or type(v) is int,
    "str": lambda v: type(v) is str,
    "list": lambda v: type(v) is list,
    "obj": lambda v: type(v) is dict,
}


class FieldReader:
    """Typed access to one record's fields; every failure names path, line and field path."""

    __slots__ = ("path", "line")

    def __init__(self, path: str, line: Optional[int]) -> None:
        self.path, self.line = path, line

    def fail(self, field: str, message: str) -> TraceFormatError:
        return TraceFormatError(self.path, self.line, field, message)

    def obj(self, value, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(field, f"expected a JSON object, got {type(value).__name__}")
        return value

    def get(self, record: dict, key: str, prefix: str, kind, *, required: bool = True, default=None,
            minimum=None, maximum=None):
        """record[key] checked against `kind` ("int", "num", "str", "list", "obj") and the bounds."""
        field = f"{prefix}{key}"
        if key not in record or record[key] is None:
            if required:
                raise self.fail(field, "missing")
            return default
        value = record[key]
        if not _KIND_CHECKS[kind](value):
            raise self.fail(field, f"expected {kind}, got {type(value).__name__} {value!r:.40}")
        if minimum is not None and value < minimum:
            raise self.fail(field, f"must be >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise self.fail(field, f"must be <= {maximum}, got {value!r}")
        return value

    def num_tokens(self, record: dict, key: str, prefix: str) -> int:
        """A prompt length: an int in [0, MAX_INPUT_NUM_TOKENS]."""
        return self.get(record, key, prefix, "int", minimum=0, maximum=MAX_INPUT_NUM_TOKENS)


def progress_bar(iterable, options: LoadOptions, desc: str):
    if not options.progress:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, unit="session")
