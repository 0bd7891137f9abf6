"""Weka loader on small inline fixtures: keys, layouts, subagents, clipping, malformed input."""
import json
import os
import threading

import pytest

from histate.sim.request import RequestFlag, common_prefix_pages
from histate.sim.traces import (MAX_INPUT_NUM_TOKENS, LoadOptions, TraceFormatError, iter_weka_sessions, load_trace,
                                load_weka)

from .helpers import ids, weka_request, weka_session, weka_subagent, write_jsonl


def two_turn_session(session_id="s1"):
    return weka_session(session_id, [
        weka_request(0.0, 64 * 3 + 10, ids(1, 3), out=200, think=0.0, api=2.0),
        weka_request(10.0, 64 * 7, ids(1, 3) + ids(4, 4), out=5, think=8.0, api=1.0),
    ])


def test_pages_are_full_input_pages_and_extensions_share_the_whole_prefix(tmp_path):
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [two_turn_session()]))
    (s,) = w.sessions
    r0, r1 = s.requests
    assert (r0.input_num_tokens, r0.output_num_tokens, r0.num_pages) == (202, 200, 3)
    assert r1.num_pages == 7
    assert r1.page_keys[:3] == r0.page_keys
    assert len(set(r0.page_keys + r1.page_keys)) == 7
    assert (r0.gap_before_s, r1.gap_before_s) == (0.0, 8.0)
    assert (r0.offset_s, r1.offset_s) == (0.0, 10.0)
    assert r0.original_latency_s == 2.0
    # 202 input + 200 output tokens fill pages 3..5 (6 = 402 // 64); the next prompt names them.
    assert r0.output_page_keys == r1.page_keys[3:6]
    assert r1.output_page_keys == ()
    assert [r.uid for r in w.iter_requests()] == [0, 1]
    assert (w.stats.sessions, w.stats.requests, w.stats.input_tokens, w.stats.output_tokens) == (1, 2, 650, 205)


def test_divergent_prefixes_share_exactly_their_common_ids(tmp_path):
    sess = weka_session("s", [
        weka_request(0, 64 * 5, [1, 2, 3, 4, 5]),
        weka_request(1, 64 * 5, [1, 2, 9, 4, 5]),   # id 4 again, after a different prefix
        weka_request(2, 64 * 6, [1, 2, 3, 4, 5, 6]),
    ])
    r0, r1, r2 = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess])).sessions[0].requests
    assert common_prefix_pages(r0.page_keys, r1.page_keys) == 2
    assert r1.page_keys[3] != r0.page_keys[3]      # same id, different prefix -> different key
    assert r2.page_keys[:5] == r0.page_keys          # returning to the first branch
    assert r0.output_page_keys == ()                 # r1 does not extend r0


def test_output_pages_are_known_only_when_the_next_prompt_carries_the_whole_output(tmp_path):
    sess = weka_session("s", [
        weka_request(0, 64 * 2, ids(1, 2), out=128),
        weka_request(1, 64 * 3, ids(1, 3), out=130),     # 192 < 128 + 128: the output was not carried
        weka_request(2, 64 * 6, ids(1, 6), out=10),      # 384 >= 192 + 130: pages 3 and 4 are r1's output
    ])
    r0, r1, r2 = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess])).sessions[0].requests
    assert r0.output_page_keys == ()
    assert r1.output_page_keys == r2.page_keys[3:5]
    assert r0.keys_through(4) == r0.page_keys + (("out", r0.uid, 2), ("out", r0.uid, 3))


def test_sessions_do_not_share_keys_local_scope(tmp_path):
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [two_turn_session("a"), two_turn_session("b")]))
    a, b = (set(k for r in s.requests for k in r.page_keys) for s in w.sessions)
    assert a and b and not (a & b)


def test_gzip_jsonl_directory_of_json_and_pretty_json_load_identically(tmp_path):
    sessions = [two_turn_session("a"), two_turn_session("b")]
    plain = load_weka(write_jsonl(tmp_path / "t.jsonl", sessions))
    gz = load_weka(write_jsonl(tmp_path / "t.jsonl.gz", sessions, gz=True))
    folder = tmp_path / "traces"
    folder.mkdir()
    for s in sessions:
        (folder / f"{s['id']}.json").write_text(json.dumps(s, indent=2))
    per_file = load_weka(folder)

    def shape(w):
        return [(r.session_id, r.input_num_tokens, r.page_keys, r.gap_before_s) for r in w.iter_requests()]

    assert shape(plain) == shape(gz) == shape(per_file)


def test_subagents_become_child_sessions_released_by_the_parent(tmp_path):
    shared = ids(500, 4)
    sess = weka_session("p", [
        weka_request(0.0, 64 * 2, [1, 2], think=0.0, api=5.0),
        weka_subagent(t=36.0, duration_s=30.0, agent_id="agent_a", requests=[
            weka_request(0.0, 64 * 4, shared, think=0.0, api=3.0),
            weka_request(10.0, 64 * 5, shared + [504], think=7.0, api=2.0)]),
        weka_subagent(t=50.0, duration_s=44.0, agent_id="agent_b", requests=[
            weka_request(0.0, 64 * 4, shared, think=0.0, api=4.0)]),
        weka_request(60.0, 64 * 3, [1, 2, 3], think=55.0, api=1.0),
    ])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess]))
    (root,) = w.sessions
    a, b = root.subagents
    assert (a.session_id, b.session_id) == ("p/agent_a", "p/agent_b")
    assert (a.parent_session_id, a.spawn_after_index, b.spawn_after_index) == ("p", 0, 0)
    assert (a.start_offset_s, b.start_offset_s) == (6.0, 6.0)   # completion t - duration
    # Children start 1 s after the parent's request 0 ended (t 0 + api 5).
    assert a.requests[0].gap_before_s == 1.0 and b.requests[0].gap_before_s == 1.0
    assert a.requests[1].gap_before_s == 7.0 and a.requests[1].offset_s == 16.0
    assert all(r.flags & RequestFlag.SUBAGENT and r.parent_session_id == "p" for r in a.requests)
    parent_next = root.requests[1]
    assert parent_next.after_sessions == ("p/agent_a", "p/agent_b")
    assert parent_next.gap_before_s == 10.0                    # 60 - last completion (50)
    # One namespace: siblings with equal ids share keys; the parent's prefix differs.
    assert a.requests[0].page_keys == b.requests[0].page_keys
    assert not set(a.requests[0].page_keys) & set(root.requests[0].page_keys)
    assert (w.stats.sessions, w.stats.subagent_sessions, w.stats.requests) == (1, 2, 5)
    assert [s.session_id for s in w.iter_sessions()] == ["p", "p/agent_a", "p/agent_b"]
    assert sorted(r.uid for r in w.iter_requests()) == list(range(5))


def test_truncate_session_drops_the_rest_and_counts_it(tmp_path):
    sess = weka_session("s", [
        weka_request(0, 64 * 10, ids(1, 10)),
        weka_request(1, 64 * 30, ids(1, 30)),          # over the limit of 1,000 tokens
        weka_subagent(t=3, duration_s=1, requests=[weka_request(0, 64, [99])]),
        weka_request(2, 64 * 5, ids(1, 5)),             # would fit, but the session ended
    ])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess]), LoadOptions(max_context_num_tokens=1000))
    assert [r.input_num_tokens for r in w.iter_requests()] == [640]
    st = w.stats
    assert (st.requests_over_context, st.input_tokens_over_context) == (3, 1920 + 64 + 320)
    assert (st.sessions_truncated, st.sessions_dropped_empty, st.subagent_sessions) == (1, 1, 0)


def test_drop_request_keeps_the_session_going(tmp_path):
    sess = weka_session("s", [
        weka_request(0, 64 * 10, ids(1, 10)),
        weka_request(1, 64 * 30, ids(1, 30), think=4.0),
        weka_request(2, 64 * 5, ids(1, 5), think=6.0),
    ])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess]),
                  LoadOptions(max_context_num_tokens=1000, overflow="drop_request"))
    reqs = w.sessions[0].requests
    assert [r.input_num_tokens for r in reqs] == [640, 320]
    assert [r.index for r in reqs] == [0, 1]
    assert reqs[1].gap_before_s == 6.0
    assert reqs[1].page_keys == reqs[0].page_keys[:5]
    assert (w.stats.requests_over_context, w.stats.sessions_truncated) == (1, 0)


def test_a_session_whose_first_request_is_too_long_is_dropped_and_counted(tmp_path):
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [weka_session("s", [weka_request(0, 64 * 30, ids(1, 30))])]),
                  LoadOptions(max_context_num_tokens=1000))
    assert w.sessions == [] and w.stats.sessions_dropped_empty == 1 and w.stats.requests_over_context == 1


def test_no_limit_keeps_everything_and_gap_cap_counts(tmp_path):
    sess = weka_session("s", [weka_request(0, 64 * 3000, ids(1, 3000)),
                              weka_request(900, 64 * 3001, ids(1, 3001), think=800.0)])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess]),
                  LoadOptions(max_context_num_tokens=None, max_gap_s=60.0))
    assert w.num_requests == 2 and w.sessions[0].requests[1].gap_before_s == 60.0
    assert w.stats.gaps_capped == 1


def test_gap_falls_back_to_t_minus_previous_end_without_think_time(tmp_path):
    sess = weka_session("s", [weka_request(0.0, 64, [1], api=2.5), weka_request(10.0, 128, [1, 2])])
    r1 = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess])).sessions[0].requests[1]
    assert r1.gap_before_s == 7.5


def test_block_size_larger_than_the_page_expands_each_id(tmp_path):
    sess = weka_session("s", [weka_request(0, 256 * 2 + 100, [7, 8]), weka_request(1, 256 * 2, [7, 9])],
                        block_size=256)
    r0, r1 = load_weka(write_jsonl(tmp_path / "t.jsonl", [sess])).sessions[0].requests
    assert (r0.num_pages, r1.num_pages) == (9, 8)   # page 8 lies in the partial third block: fresh key
    assert common_prefix_pages(r0.page_keys, r1.page_keys) == 4


# ------------------------------------------------------------------------------------ malformed
@pytest.mark.parametrize("mutate, field, words", [
    (lambda s: s["requests"][1].pop("in"), "requests[1].in", "missing"),
    (lambda s: s["requests"][1].__setitem__("out", "12"), "requests[1].out", "expected int"),
    (lambda s: s["requests"][0].__setitem__("hash_ids", [1, 2]), "requests[0].hash_ids", "expected in // block_size"),
    (lambda s: s["requests"][1].__setitem__("hash_ids", [1, 2, 3, 4, 5, 6, "x"]), "requests[1].hash_ids",
     "expected int"),
    (lambda s: s["requests"][0].__setitem__("t", -1), "requests[0].t", ">= 0"),
    (lambda s: s.pop("id"), "id", "missing"),
])
def test_malformed_field_names_file_line_and_field(tmp_path, mutate, field, words):
    bad = two_turn_session("bad")
    mutate(bad)
    path = write_jsonl(tmp_path / "t.jsonl", [two_turn_session("ok"), bad])
    with pytest.raises(TraceFormatError) as exc:
        load_weka(path)
    assert (exc.value.path, exc.value.line, exc.value.field) == (str(path), 2, field)
    message = str(exc.value)
    assert message.startswith(f"{path}:2: {field}: ") and words in message


def test_invalid_json_line_and_skip_mode_counts(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(two_turn_session("a")) + "\n{not json\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: <json>: invalid JSON"):
        load_weka(path)
    bad = two_turn_session("b")
    bad["requests"][0]["in"] = None
    path2 = write_jsonl(tmp_path / "u.jsonl", [two_turn_session("a"), bad, two_turn_session("c")])
    w = load_weka(path2, LoadOptions(on_error="skip"))
    assert [s.session_id for s in w.sessions] == ["a", "c"]
    assert w.stats.malformed_skipped == 1 and "u.jsonl:2: requests[0].in: missing" in w.stats.errors[0]


def test_missing_path_and_empty_directory_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such trace"):
        load_weka(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no trace files"):
        load_weka(tmp_path / "empty")


def test_option_validation():
    with pytest.raises(ValueError, match="overflow"):
        LoadOptions(overflow="clip")
    with pytest.raises(ValueError, match="max_context_num_tokens"):
        LoadOptions(max_context_num_tokens=0)


def test_session_filter_streaming_and_format_dispatch(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [two_turn_session("a"), two_turn_session("b"), two_turn_session("c")])
    w = load_weka(path, session_ids=["c", "a"])
    assert [s.session_id for s in w.sessions] == ["a", "c"] and w.params["session_ids"] == ["a", "c"]
    stream = iter_weka_sessions(path)
    assert next(stream).session_id == "a"                  # lazily, one conversation at a time
    assert [s.session_id for s in load_trace(path, "weka").sessions] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(path, "sharegpt")


def test_a_skipped_conversation_leaves_no_partial_counts_or_uid_gaps(tmp_path):
    bad = weka_session("bad", [
        weka_request(0, 64, [1]),
        weka_subagent(t=2, duration_s=1, requests=[weka_request(0, 64 * 2, [5, 6])]),
        weka_request(3, 64 * 2, [1, "two"]),            # found while building, after the subagent
    ])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [two_turn_session("a"), bad, two_turn_session("c")]),
                  LoadOptions(on_error="skip"))
    assert [r.uid for r in w.iter_requests()] == [0, 1, 2, 3]
    assert (w.stats.sessions, w.stats.subagent_sessions, w.stats.requests, w.stats.malformed_skipped) == (2, 0, 4, 1)
    assert "t.jsonl:2: requests[2].hash_ids: entry for page 1 is 'two'" in w.stats.errors[0]


def _feed_fifo(path, data, done: threading.Event):
    """Write `data` into the FIFO at `path` from a thread, then, until `done`, keep answering any
    further open of the FIFO with an empty stream: a reader that opens it twice sees the data
    truncated and fails instead of blocking forever."""
    def writer():
        with open(path, "wb") as f:
            f.write(data)
        while not done.wait(0.05):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # no reader has it open: nothing to answer
                pass
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("gz", [False, True])
def test_a_pipe_loads_completely(tmp_path, gz):
    """`--trace /dev/stdin` or `<(zcat ...)`: a non-seekable input is read once, nothing lost."""
    sessions = [two_turn_session(f"s{i}") for i in range(300)]  # ~190 KiB of JSON, far above any buffer
    data = write_jsonl(tmp_path / "t.jsonl", sessions, gz=gz).read_bytes()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = threading.Event()
    thread = _feed_fifo(fifo, data, done)
    try:
        w = load_weka(str(fifo))
    finally:
        done.set()
        thread.join(timeout=10)
    assert [s.session_id for s in w.sessions] == [f"s{i}" for i in range(300)]
    assert w.stats.requests == 600


def test_a_truncated_gzip_raises_naming_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl.gz", [two_turn_session(f"s{i}") for i in range(50)], gz=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(TraceFormatError, match=r"t\.jsonl\.gz:\d+: <gzip>: truncated or corrupt gzip"):
        load_weka(path)


def test_an_input_longer_than_any_model_context_is_malformed_even_unclipped(tmp_path):
    """Page keys are built per page: an unbounded `in` would allocate without bound."""
    num_in = MAX_INPUT_NUM_TOKENS + 64
    sess = weka_session("s", [weka_request(0, num_in, ids(1, num_in // 64))])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:1: requests\[0\]\.in: must be <= {MAX_INPUT_NUM_TOKENS}"):
        load_weka(write_jsonl(tmp_path / "t.jsonl", [sess]), LoadOptions(max_context_num_tokens=None))
    with pytest.raises(ValueError, match="max_context_num_tokens"):
        LoadOptions(max_context_num_tokens=MAX_INPUT_NUM_TOKENS + 1)
    with pytest.raises(ValueError, match="max_gap_s"):
        LoadOptions(max_gap_s=float("nan"))


def test_root_ids_keep_the_roots_the_clip_empties_in_file_order(tmp_path):
    long_first = weka_session("long", [weka_request(0, 64 * 20, ids(1, 20))])
    w = load_weka(write_jsonl(tmp_path / "t.jsonl", [two_turn_session("a"), long_first, two_turn_session("b")]),
                  LoadOptions(max_context_num_tokens=1000))
    assert [s.session_id for s in w.sessions] == ["a", "b"]
    assert w.root_ids == ("a", "long", "b")
