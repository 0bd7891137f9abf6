"""Loader for Mooncake / kvcache-ai request traces (FAST'25 release), JSON lines, gzip or not.

One request per line: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}` with one id
per `block_size`-token block (512 in the release; the last block may be partial, so
`len(hash_ids) == ceil(input_length / block_size)`). The ids are already prefix-chained and global
("two hash_ids sharing the same integers represent the prefix overlap"), so all requests share one
key namespace; a block spans block_size / page pages, page j of block id h has content (h, j).
There are no sessions: every request is a one-request session, replayed open loop at
`start_offset_s = timestamp / 1000` (`Workload.open_loop`).
"""
from __future__ import annotations

import itertools
import os

from ..request import PageKeyAllocator, Request, Session, Workload, WorkloadStats
from ._source import FieldReader, LoadOptions, TraceFormatError, iter_json_records, record_error, trace_files

MOONCAKE_BLOCK_NUM_TOKENS = 512
MOONCAKE_SUFFIXES = (".jsonl", ".jsonl.gz")


def load_mooncake(path, options: LoadOptions = LoadOptions(), *,
                  block_num_tokens: int = MOONCAKE_BLOCK_NUM_TOKENS) -> Workload:
    page = options.page_num_tokens
    if block_num_tokens % page != 0:
        raise ValueError(f"block_num_tokens {block_num_tokens} is not a multiple of the page ({page} tokens)")
    pages_per_block = block_num_tokens // page
    stats = WorkloadStats()
    keys, uids = PageKeyAllocator(), itertools.count()
    namespace = keys.namespace()
    sessions = []
    for file_path in trace_files(path, MOONCAKE_SUFFIXES):
        name = os.path.basename(file_path)
        for line, record in iter_json_records(file_path):
            reader = FieldReader(file_path, line)
            try:
                record = reader.obj(record, "<request>")
                timestamp_ms = reader.get(record, "timestamp", "", "num", minimum=0)
                num_in = reader.num_tokens(record, "input_length", "")
                num_out = reader.get(record, "output_length", "", "int", minimum=0)
                hash_ids = reader.get(record, "hash_ids", "", "list")
                expected = -(-num_in // block_num_tokens)
                if len(hash_ids) != expected:
                    raise reader.fail("hash_ids", f"has {len(hash_ids)} ids, expected ceil(input_length / "
                                                  f"{block_num_tokens}) = {expected}")
                for j, h in enumerate(hash_ids):
                    if type(h) is not int:
                        raise reader.fail(f"hash_ids[{j}]", f"expected int, got {h!r:.40}")
            except TraceFormatError as err:
                record_error(err, options, stats)
                continue
            if not options.fits(num_in):
                stats.requests_over_context += 1
                stats.input_tokens_over_context += num_in
                stats.sessions_dropped_empty += 1
                continue
            contents = [(hash_ids[p // pages_per_block], p % pages_per_block) for p in range(num_in // page)]
            page_keys = tuple(namespace.chain(namespace.root, contents))
            session_id = f"{name}:{line}"
            request = Request(uid=next(uids), session_id=session_id, index=0, input_num_tokens=num_in,
                              output_num_tokens=num_out, page_keys=page_keys, gap_before_s=0.0)
            sessions.append(Session(session_id=session_id, requests=(request,),
                                    start_offset_s=timestamp_ms / 1000.0))
            stats.sessions += 1
            stats.requests += 1
            stats.input_tokens += num_in
            stats.output_tokens += num_out
    params = {"path": str(path), "format": "mooncake", "block_num_tokens": block_num_tokens, **options.__dict__}
    return Workload(name=f"mooncake:{path}", sessions=sessions, stats=stats, page_num_tokens=page,
                    open_loop=True, params=params)
