"""`histate bench` end to end against the real CPU server (conftest.histate_server).

The strongest check: with one live session and budgets nothing is evicted from, the server's cache
(histate.core driven by the reference executor, keyed on the prompts' token ids) and the simulator's
(the same core keyed on the workload's page keys) must reuse exactly the same number of tokens for
every request -- which holds only if the prompts share exactly the prefixes the workload says, the
closed loop sends requests in the replay's order, and the server reports what it reused.
"""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import threading

import pytest

from histate.bench.run import BenchOptions, report, run_bench
from histate.core import MISS_REASONS
from histate.cli import main
from histate.sim.engine import EngineConfig
from histate.sim.replay import ReplayConfig, replay
from histate.sim.traces import LoadOptions, load_weka
from histate.sim.workloads import AgentWorkloadConfig, agent_workload
from test.bench.test_backends import closed_port_url
from test.sim.helpers import ids, weka_request, weka_session, weka_subagent, write_jsonl

MiB = 2**20


def run_cli(argv):
    """`histate ARGV`'s exit status, whether main returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code
BIG = dict(gpu_cache_bytes=64 * MiB, cpu_cache_bytes=256 * MiB, ssd_cache_bytes=1024 * MiB)  # the server's defaults


def _small_agent_workload():
    return agent_workload(AgentWorkloadConfig(
        num_sessions=3, num_turns=5, system_prompt_num_tokens=256, first_input_num_tokens=(200, 600),
        append_num_tokens=(64, 300), output_num_tokens=(2, 6), tool_gap_s=(0.01, 0.05), human_gap_probability=0.0,
        session_start_spread_s=0.1, truncation_rate=0.2, rewind_edit_rate=0.2, fork_rate=0.1, compaction_rate=0.0,
        seed=3))


def _assert_same_reuse_as_the_simulator(workload, live_run):
    # The server caches no output (its greedy tokens are not the trace's), so neither does this replay.
    engine = EngineConfig(caches_outputs=False)
    sim = replay(workload, "histate", ReplayConfig(model="tiny-qwen3.5", max_live_sessions=1, engine=engine,
                                                   **BIG)).by_uid()
    live = live_run.by_uid()
    assert sorted(live) == sorted(sim)
    # A prompt of a whole number of pages has one page fewer on the server (its last token is always
    # computed, so its page is never keyed): those requests can only reuse less there.
    exact = [u for u in live if live[u].input_tokens % 64]
    assert len(exact) >= len(live) - 1
    assert [(u, live[u].reused_tokens, live[u].kv_hit_tokens) for u in exact] == \
        [(u, sim[u].reused_tokens, sim[u].kv_hit_tokens) for u in exact]
    assert sum(live[u].reused_tokens for u in exact) > 0


def test_live_reuse_equals_the_simulators_request_by_request(histate_server):
    workload = _small_agent_workload()
    result = run_bench(workload, BenchOptions(histate_server.url, admission=ReplayConfig(max_live_sessions=1),
                                              progress=False))
    assert not result.interrupted and len(result.run.records) == workload.num_requests == 15
    assert result.summary["bench"]["cache_flushed"] is True
    _assert_same_reuse_as_the_simulator(workload, result.run)


def test_subagents_run_closed_loop_in_the_replays_order(histate_server, tmp_path):
    """A parent request, a subagent of two requests spawned after it, then the parent resumes."""
    child = weka_subagent(t=3.0, duration_s=2.0, requests=[weka_request(1.2, 200, ids(500, 3), out=3),
                                                           weka_request(2.0, 330, ids(500, 5), out=2, think=0.05)])
    parent = weka_session("p", [weka_request(0.0, 300, ids(1, 4), out=3, api=1.0), child,
                                weka_request(3.1, 500, ids(1, 7), out=2, think=0.05)])
    path = write_jsonl(tmp_path / "t.jsonl", [parent])
    workload = load_weka(path, LoadOptions())
    result = run_bench(workload, BenchOptions(histate_server.url, admission=ReplayConfig(max_live_sessions=1),
                                              progress=False))
    records = sorted(result.run.records, key=lambda r: r.arrival_s)
    assert [(r.session_id, r.input_tokens) for r in records] == \
        [("p", 300), ("p/agent_001", 200), ("p/agent_001", 330), ("p", 500)]
    for before, after in zip(records, records[1:]):
        assert after.arrival_s >= before.completion_s  # each waits for the one it depends on
    _assert_same_reuse_as_the_simulator(workload, result.run)


def test_bench_cli_writes_replays_schema_with_ttft_and_hits(histate_server, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--base-url", histate_server.url, "--synthetic", "agent", "--max-sessions", "1",
               "--token-scale", "0.03125", "--time-scale", "0.0001", "--out", str(out), "--no-progress",
               "--no-plots"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    stats = summary["policies"]["histate"]
    assert stats["requests"] == 16 and summary["bench"]["completed_requests"] == 16
    for key in ("ttft_p50_s", "ttft_p95_s", "ttft_p99_s", "ttft_mean_s"):
        assert 0 < stats[key] < 60
    assert stats["ttft_p50_s"] <= stats["ttft_p95_s"] <= stats["ttft_p99_s"]
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["policy", "uid", "session_id", "session_index", "flags", "arrival_s", "input_tokens",
                             "kv_hit_tokens", "reused_tokens", "restore_s", "ttft_s",
                             *(f"miss_tokens_{r}" for r in MISS_REASONS)]  # histate replay's schema
    assert all(row[f"miss_tokens_{r}"] == "" for row in rows for r in MISS_REASONS)  # `histate serve` sends none
    # Every turn after the first extends its context: the server reports reuse on all of them.
    turns = sorted(rows, key=lambda r: float(r["arrival_s"]))
    assert int(turns[0]["reused_tokens"]) == 0
    assert all(int(r["reused_tokens"]) > 0 for r in turns[1:])
    assert 0.5 < stats["token_hit_rate"] < 1
    # Each request's position in its session, so the non-first percentiles are defined (issue 19: all 0).
    assert [int(r["session_index"]) for r in turns] == list(range(16))
    assert stats["non_first_requests"] == 15 and 0 < stats["ttft_p95_non_first_s"] < 60
    assert "histate: completed 16 of 16 requests" in capsys.readouterr().out


def test_ctrl_c_stops_cleanly_with_partial_results(histate_server, tmp_path):
    # 200 turns with >= 20 ms tool gaps take >= 4 s however fast the server is, so the Ctrl-C at 1.5 s
    # always lands mid-run (40 turns of 10 ms gaps could finish first on a warm server).
    workload = agent_workload(AgentWorkloadConfig(num_sessions=2, num_turns=200, system_prompt_num_tokens=256,
                                                  first_input_num_tokens=(300, 400), append_num_tokens=(64, 128),
                                                  output_num_tokens=(8, 8), tool_gap_s=(0.02, 0.04),
                                                  human_gap_probability=0.0, session_start_spread_s=0.01))
    # A shell that starts pytest in the background (`cmd &`) hands it SIGINT ignored, and Python then
    # installs no KeyboardInterrupt handler: install it for this test, as an interactive run has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        result = run_bench(workload, BenchOptions(histate_server.url, progress=False))
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert result.interrupted
    assert 0 < len(result.run.records) < workload.num_requests
    assert all(not math.isnan(r.completion_s) for r in result.run.records)  # only completed requests
    report(result, tmp_path, plots=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["bench"]["interrupted"] is True
    assert summary["policies"]["histate"]["requests"] == len(result.run.records)


@pytest.mark.parametrize("flags, message", [
    (["--base-url", "ftp://example"], "--base-url: expected http://HOST:PORT, got 'ftp://example'"),
    (["--base-url", "http://127.0.0.1:99999"], "--base-url: bad port"),
    (["--base-url", "URL", "--token-scale", "0.3"], "token scale must be 1/k for an integer k"),
    (["--base-url", "URL", "--trace", "/nonexistent/trace.jsonl"], "--trace /nonexistent/trace.jsonl: no such file"),
    (["--base-url", "URL", "--vocab-size", "1000"], "--vocab-size 1000 exceeds the server's vocabulary (512)"),
    (["--base-url", "URL", "--retries", "-1"], "--retries must be >= 0"),
    (["--base-url", "CLOSED", "--retries", "0"], "cannot reach http://127.0.0.1:"),
])
def test_bad_urls_and_flags_are_one_line_exit_2(histate_server, capsys, flags, message):
    flags = [histate_server.url if f == "URL" else closed_port_url() if f == "CLOSED" else f for f in flags]
    workload = [] if "--trace" in flags else ["--synthetic", "agent"]  # replay refuses both together
    assert run_cli(["bench", *flags, *workload, "--max-sessions", "1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("histate bench: error: ") and message in err


def _long_prompt_trace(tmp_path, long_num_tokens):
    """One session: a 300-token turn, then one of `long_num_tokens`."""
    session = weka_session("s", [weka_request(0.0, 300, ids(1, 4), out=2, api=0.1),
                                 weka_request(1.0, long_num_tokens, ids(1, long_num_tokens // 64), out=2, think=0.01)])
    return write_jsonl(tmp_path / "long.jsonl", [session])


def test_a_workload_over_the_servers_max_context_is_refused_before_anything_is_sent(histate_server, tmp_path, capsys):
    """The server reports max_context_num_tokens (16,384); the bench checks every admitted request
    against it first and says which --max-context fits -- which then runs."""
    trace = str(_long_prompt_trace(tmp_path, 20506))
    out = tmp_path / "out"
    assert run_cli(["bench", "--base-url", histate_server.url, "--trace", trace, "--out", str(out),
                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("histate bench: error: 1 of the 2 admitted requests have prompts over "
                                              "the server's max context of 16,384 tokens")
    assert "the longest has 20,506" in err and "nothing was sent: pass --max-context 16384" in err
    assert not (out / "requests.csv").exists()
    # With token scale 1/2 the limit is 32,768 trace tokens.
    assert run_cli(["bench", "--base-url", histate_server.url, "--trace", str(_long_prompt_trace(tmp_path, 40000)),
                    "--token-scale", "0.5", "--out", str(out), "--no-progress"]) == 2
    assert "pass --max-context 32768" in capsys.readouterr().err
    assert run_cli(["bench", "--base-url", histate_server.url, "--trace", trace, "--max-context", "16384",
                    "--out", str(out), "--no-progress", "--no-plots"]) == 0
    assert json.loads((out / "summary.json").read_text())["bench"]["completed_requests"] == 1


def test_a_server_dying_mid_run_keeps_every_completed_request(tmp_path, capsys):
    """The server goes away after its 4th request: the run ends with one error line and exit 2, and
    requests.csv / summary.json hold the requests that completed."""
    from histate.serve.engine import ServeConfig, ServingEngine
    from histate.serve.http import ServerThread

    server = ServerThread(ServingEngine(ServeConfig("none")))
    submit, submitted, closer = server.engine.submit, [], threading.Thread(target=server.close)

    def submit_then_die(job):
        submitted.append(job)
        submit(job)
        if len(submitted) == 4:
            closer.start()

    server.engine.submit = submit_then_die
    out = tmp_path / "out"
    try:
        rc = run_cli(["bench", "--base-url", server.url, "--synthetic", "agent", "--max-sessions", "1",
                      "--token-scale", "0.03125", "--time-scale", "0.0001", "--retries", "0", "--out", str(out),
                      "--no-progress", "--no-plots"])
    finally:
        if closer.is_alive() or closer.ident:
            closer.join(timeout=120)
        else:
            server.close()
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("histate bench: error: ")
    with (out / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert 3 <= len(rows) < 16 and f"wrote the {len(rows)} requests completed before it" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bench"]["completed_requests"] == len(rows) and summary["bench"]["error"]
    assert summary["bench"]["interrupted"] is False and summary["policies"]["none"]["requests"] == len(rows)
    assert f"stopped by an error after {len(rows)} of 16 requests" in captured.out


def test_an_unusable_out_is_refused_before_the_server_is_asked(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert run_cli(["bench", "--base-url", closed_port_url(), "--synthetic", "agent", "--out", str(blocker / "sub"),
                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"histate bench: error: --out {blocker / 'sub'}: cannot write")


def test_an_empty_trace_is_an_error(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run_cli(["bench", "--base-url", closed_port_url(), "--trace", str(empty), "--out", str(tmp_path / "o"),
                    "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "histate bench: error: no requests to send: the workload has none (an empty trace?)"


def test_ctrl_c_while_the_trace_loads_is_one_line(tmp_path, capsys, monkeypatch):
    import histate.cli.plan

    def interrupted(args, settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(histate.cli.plan, "load_workload", interrupted)
    trace = _long_prompt_trace(tmp_path, 1000)
    assert run_cli(["bench", "--base-url", closed_port_url(), "--trace", str(trace), "--out", str(tmp_path / "o"),
                    "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert err == "histate bench: interrupted before the run; nothing was sent or written\n"


def test_trace_dash_reads_standard_input(tmp_path):
    """`--trace -` (advertised in --help): the trace comes from a pipe."""
    trace = _long_prompt_trace(tmp_path, 1000).read_bytes()
    done = subprocess.run([sys.executable, "-m", "histate.cli", "bench", "--base-url", closed_port_url(),
                           "--trace", "-", "--retries", "0", "--out", str(tmp_path / "o"), "--no-progress"],
                          input=trace, capture_output=True, timeout=120)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert "1 sessions (+0 subagents), 2 requests" in out, err  # read from stdin, then the (closed) server
    assert done.returncode == 2 and "cannot reach" in err
