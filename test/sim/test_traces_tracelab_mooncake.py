"""TraceLab and Mooncake loaders on inline fixtures; TraceLab's public schema example when present."""
import os

import pytest

from histate.sim.request import RequestFlag, common_prefix_pages
from histate.sim.traces import LoadOptions, TraceFormatError, load_mooncake, load_tracelab

from .helpers import write_jsonl

SCHEMA_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                              "tracelab-schema-example", "round_trace.sanitized.jsonl")


def tl_round(session, prefix, append, out, start, end, provider="codex", tool_ms=()):
    return {
        "provider": provider, "session_id": session, "round_index": 0,
        "input_tokens_total": prefix + append, "prefix_tokens": prefix, "newly_append_tokens": append,
        "output_tokens": out,
        "timing_events": [
            {"event_type": "user_message", "timestamp": start, "source": "user.message"},
            {"event_type": "text", "timestamp": end, "source": "assistant.content.text"}],
        "tools": [{"tool_index": i, "tool_wall_latency_ms": ms} for i, ms in enumerate(tool_ms)],
    }


def rounds_fixture():
    return [
        tl_round("A", 0, 1000, 100, "2026-03-21T10:00:00.000Z", "2026-03-21T10:00:05.000Z"),
        tl_round("B", 0, 640, 10, "2026-03-21T10:00:01.000Z", "2026-03-21T10:00:02.000Z", provider="claude"),
        # Provider cached 960 of the 1,100-token stream; 400 new tokens.
        tl_round("A", 960, 400, 50, "2026-03-21T10:00:25.500Z", "2026-03-21T10:00:30.000Z"),
        # Provider miss: only 512 cached although the stream holds 1,410 tokens.
        tl_round("A", 512, 1000, 20, "2026-03-21T10:01:00.000Z", "2026-03-21T10:01:01.000Z"),
    ]


def test_provider_prefix_keys_share_exactly_the_cached_pages(tmp_path):
    w = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rounds_fixture()))
    a, b = w.sessions
    assert (a.session_id, b.session_id) == ("A", "B")
    r0, r1, r2 = a.requests
    assert [r.input_num_tokens for r in a.requests] == [1000, 1360, 1512]
    assert [r.num_pages for r in a.requests] == [15, 21, 23]
    # Stream after round 0: 1,000 + 100 tokens = 17 full pages; round 1 keeps 960 tokens = 15 pages.
    assert len(r0.output_page_keys) == 2
    assert r1.page_keys[:15] == r0.page_keys and common_prefix_pages(r1.page_keys, r0.page_keys + r0.output_page_keys) == 15
    assert common_prefix_pages(r2.page_keys, r1.page_keys) == 8            # 512 // 64
    assert not set(r2.page_keys[8:]) & set(k for r in w.iter_requests() if r is not r2 for k in r.page_keys)
    # Gaps: arrival (latest input event) - end of the previous round (latest other event).
    assert [r.gap_before_s for r in a.requests] == [0.0, 20.5, 30.0]
    assert [r.offset_s for r in a.requests] == [0.0, 25.5, 60.0]
    assert (a.start_offset_s, b.start_offset_s) == (0.0, 1.0)


def test_growth_mode_reuses_the_whole_stream(tmp_path):
    w = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rounds_fixture()), prefix_source="growth")
    r0, r1, r2 = w.sessions[0].requests
    assert r1.page_keys[:17] == r0.page_keys + r0.output_page_keys          # 1,100 stream tokens
    assert common_prefix_pages(r2.page_keys, r1.page_keys + r1.output_page_keys) == 22  # 1,410 stream tokens


def test_provider_filter_and_compaction_breaks_the_prefix(tmp_path):
    rows = [
        tl_round("C", 0, 70000, 10, "2026-03-21T10:00:00Z", "2026-03-21T10:00:01Z"),
        tl_round("C", 69888, 100, 10, "2026-03-21T10:00:02Z", "2026-03-21T10:00:03Z"),
        tl_round("C", 3200, 200, 10, "2026-03-21T10:00:04Z", "2026-03-21T10:00:05Z"),   # >= 64K drop
    ] + rounds_fixture()
    w = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rows), provider="codex", prefix_source="growth")
    assert [s.session_id for s in w.sessions] == ["C", "A"]
    c0, c1, c2 = w.sessions[0].requests
    assert c2.flags == RequestFlag.COMPACTION | RequestFlag.MUTATION and not c1.flags
    assert common_prefix_pages(c1.page_keys, c0.page_keys) == 1093           # growth: whole 69,988 -> 1,093 pages
    assert common_prefix_pages(c2.page_keys, c1.page_keys) == 50             # compaction: 3,200 // 64
    assert w.stats.compactions == 1


def test_provider_prefix_beyond_the_stream_is_capped_and_counted(tmp_path):
    rows = [tl_round("A", 27000, 5000, 10, "2026-03-21T10:00:00Z", "2026-03-21T10:00:01Z")]
    w = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rows))
    assert w.stats.prefix_tokens_unmatched == 27000 and w.sessions[0].requests[0].num_pages == 500


def test_tool_latency_is_the_gap_without_timestamps(tmp_path):
    rows = [dict(tl_round("A", 0, 100, 10, "x", "x", tool_ms=(1500, 500)), timing_events=[]),
            dict(tl_round("A", 64, 100, 10, "x", "x"), timing_events=[])]
    reqs = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rows)).sessions[0].requests
    assert reqs[1].gap_before_s == 2.0


def test_tracelab_clipping_and_errors(tmp_path):
    w = load_tracelab(write_jsonl(tmp_path / "r.jsonl", rounds_fixture()), LoadOptions(max_context_num_tokens=1400))
    assert [r.input_num_tokens for r in w.sessions[0].requests] == [1000, 1360]
    assert (w.stats.requests_over_context, w.stats.sessions_truncated) == (1, 1)
    bad = rounds_fixture()
    bad[2]["input_tokens_total"] = 5
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(TraceFormatError) as exc:
        load_tracelab(path)
    assert (exc.value.line, exc.value.field) == (3, "input_tokens_total")
    bad = rounds_fixture()
    bad[1]["timing_events"][0]["timestamp"] = "yesterday"
    with pytest.raises(TraceFormatError, match=r"bad2\.jsonl:2: timing_events\[0\]\.timestamp: not an ISO-8601"):
        load_tracelab(write_jsonl(tmp_path / "bad2.jsonl", bad))
    with pytest.raises(ValueError, match="prefix_source"):
        load_tracelab(path, prefix_source="magic")


@pytest.mark.skipif(not os.path.exists(SCHEMA_EXAMPLE), reason="../shared/traces not present")
def test_public_schema_example_loads():
    w = load_tracelab(SCHEMA_EXAMPLE)
    assert len(w.sessions) == 2 and w.num_requests == 19 and w.stats.malformed_skipped == 0
    codex = load_tracelab(SCHEMA_EXAMPLE, provider="codex")
    assert codex.num_requests == 9
    r0, r1 = codex.sessions[0].requests[:2]
    # Round 1 keeps 9,600 provider-cached tokens of round 0's 9,324 + 444 token stream: all 145 prompt
    # pages and 5 of round 0's 7 output pages.
    assert common_prefix_pages(r1.page_keys, r0.page_keys) == 145
    assert common_prefix_pages(r1.page_keys, r0.page_keys + r0.output_page_keys) == 150
    assert codex.stats.prefix_tokens_unmatched == 6912     # round 0's prefix came from another session


# ---------------------------------------------------------------------------------------- Mooncake
def test_mooncake_blocks_expand_to_pages_and_share_globally(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 9]},
    ]
    w = load_mooncake(write_jsonl(tmp_path / "m.jsonl", rows))
    r0, r1 = (s.requests[0] for s in w.sessions)
    assert (r0.num_pages, r1.num_pages) == (17, 9)
    assert common_prefix_pages(r0.page_keys, r1.page_keys) == 8            # block 0 = pages 0..7
    assert w.open_loop and [s.start_offset_s for s in w.sessions] == [0.0, 3.0]
    with pytest.raises(TraceFormatError, match=r"m2\.jsonl:1: hash_ids: has 2 ids, expected ceil"):
        load_mooncake(write_jsonl(tmp_path / "m2.jsonl", [dict(rows[0], hash_ids=[0, 1])]))
    clipped = load_mooncake(tmp_path / "m.jsonl", LoadOptions(max_context_num_tokens=1000))
    assert clipped.num_requests == 1 and clipped.stats.requests_over_context == 1
