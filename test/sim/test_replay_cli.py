"""`histate replay` driven as a user would: presets and where their values show, the report files,
and bad input (one line naming the flag or file:line:field, exit status 2, nothing replayed)."""
import gzip
import json

import pytest

from histate.cli import main as cli_main
from histate.core import DEFAULT_MAX_YIELDS
from histate.sim.presets import PRESETS

from .helpers import ids, weka_request, weka_session, write_jsonl

FAST = ["--no-progress", "--no-plots"]


@pytest.fixture(autouse=True)
def _default_out_dir_under_tmp_path(tmp_path, monkeypatch):
    """A replay creates its --out directory (default out/replay, relative to the current directory)
    before it reads its input, so even refused runs made one in the working tree: run from tmp_path."""
    monkeypatch.chdir(tmp_path)


def run(argv, capsys):
    try:
        rc = cli_main(["replay", *argv])
    except SystemExit as stop:
        rc = stop.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_refused(argv, capsys, *words):
    rc, out, err = run([*argv, *FAST], capsys)
    assert (rc, out) == (2, ""), err            # refused before anything is loaded or replayed
    assert err.startswith("histate replay: error: ") and err.count("\n") == 1, err
    for word in words:
        assert word in err


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def small_trace(tmp_path, name="t.jsonl", gz=False):
    """Two sessions: s1 grows 1,000 -> 70,000 tokens (over tiny-qwen3.5's 65,536 context), s2 has
    three short turns."""
    s1 = weka_session("s1", [weka_request(0, 1000, ids(1, 15), think=0, api=1),
                             weka_request(5, 70000, ids(1, 1093), think=3, api=1)])
    s2 = weka_session("s2", [weka_request(0, 640, ids(1, 10), think=0, api=1),
                             weka_request(4, 1280, ids(1, 20), think=2, api=1),
                             weka_request(9, 1920, ids(1, 30), think=2, api=1)])
    return write_jsonl(tmp_path / name, [s1, s2], gz=gz)


@pytest.mark.parametrize("argv, flag", [
    (["--max-sessions", "-1"], "--max-sessions"),
    (["--max-sessions", "0"], "--max-sessions"),
    (["--max-live-sessions", "0"], "--max-live-sessions"),
    (["--h2d-gbps", "0"], "--h2d-gbps"),
    (["--h2d-gbps", "-64"], "--h2d-gbps"),
    (["--h2d-gbps", "nan"], "--h2d-gbps"),
    (["--ssd-gbps", "inf"], "--ssd-gbps"),
    (["--gpu-gib", "0"], "--gpu-gib"),
    (["--gpu-gib", "nan"], "--gpu-gib"),
    (["--gpu-gib", "inf"], "--gpu-gib"),
    (["--cpu-gib", "inf"], "--cpu-gib"),
    (["--ssd-gib", "-1"], "--ssd-gib"),
    (["--tau", "nan"], "--tau"),
    (["--tau", "inf"], "--tau"),
    (["--stagger", "-5"], "--stagger"),
    (["--synthetic", "mutation", "--mutation-rate", "nan"], "--mutation-rate"),
    (["--synthetic", "mutation", "--mutation-rate", "1.5"], "--mutation-rate"),
    (["--mutation-rate", "0.1"], "--mutation-rate"),            # ignored without --synthetic mutation
    (["--max-context", "1e15"], "--max-context"),
    (["--max-context", "1000000000000000"], "--max-context"),
    (["--max-gap", "60"], "--max-gap"),                          # ignored without --trace
    (["--preset", "paper"], "--preset paper"),                    # ignored without --trace
])
def test_bad_flags_are_refused_in_one_line_naming_the_flag(argv, flag, capsys):
    assert_refused(argv, capsys, flag)


@pytest.mark.parametrize("argv, flag", [
    (["--max-gap", "nan"], "--max-gap"),
    (["--max-gap", "-1"], "--max-gap"),
    (["--max-context", "0"], "--max-context"),
])
def test_bad_trace_flags_are_refused(argv, flag, tmp_path, capsys):
    assert_refused(["--trace", str(small_trace(tmp_path)), *argv], capsys, flag)


def test_synthetic_and_trace_together_are_refused(tmp_path, capsys):
    assert_refused(["--synthetic", "mutation", "--trace", str(small_trace(tmp_path))], capsys, "--trace", "--synthetic")


def test_an_unusable_out_is_refused_before_the_replay(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):
        assert_refused(["--synthetic", "mutation", "--max-sessions", "2", "--out", str(out)], capsys, f"--out {out}")
    (tmp_path / "out" / "summary.json").mkdir(parents=True)
    assert_refused(["--synthetic", "mutation", "--max-sessions", "2", "--out", str(tmp_path / "out")], capsys,
                   "summary.json")


def test_a_truncated_gzip_trace_names_the_file_and_line(tmp_path, capsys):
    path = small_trace(tmp_path, "t.jsonl.gz", gz=True)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(["--trace", str(path)], capsys, f"{path}:1: <gzip>: truncated or corrupt gzip")


def test_a_trace_whose_sessions_the_clip_empties_is_refused(tmp_path, capsys):
    assert_refused(["--trace", str(small_trace(tmp_path)), "--max-context", "100"], capsys,
                   "no requests to replay")


def test_summary_json_is_strict_json_with_null_for_undefined_numbers(tmp_path, capsys):
    rc, out, err = run(["--synthetic", "mutation", "--max-sessions", "2", "--policies", "histate,vllm-disk",
                        "--out", str(tmp_path), *FAST], capsys)
    assert rc == 0, err
    summary = strict_json((tmp_path / "summary.json").read_text())
    # no `unlimited` replayed: no reuse-sensitive cohort, so the recovered share is undefined
    assert summary["policies"]["histate"]["cohort_recovered_fraction"] is None
    assert summary["reuse_sensitive_requests"] == 0


def test_default_max_context_is_the_models_native_context(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    for model, native, requests in (("qwen3.5-9b", 262144, 5), ("tiny-qwen3.5", 65536, 4)):
        rc, out, err = run(["--trace", trace, "--model", model, "--policies", "unlimited",
                            "--out", str(tmp_path / model), *FAST], capsys)
        assert rc == 0, err
        settings = strict_json((tmp_path / model / "summary.json").read_text())["settings"]
        assert (settings["max_context_num_tokens"], settings["admitted_requests"]) == (native, requests)


def test_preset_values_show_in_help_and_summary_and_flags_override_them(tmp_path, capsys):
    rc, out, _ = run(["--help"], capsys)
    assert rc == 0
    help_text = " ".join(out.split())
    for preset in PRESETS.values():
        assert preset.describe() in help_text
    trace = str(small_trace(tmp_path))
    rc, _, err = run(["--trace", trace, "--preset", "paper", "--policies", "unlimited", "--out", str(tmp_path / "p"),
                      *FAST], capsys)
    assert rc == 0, err
    settings = strict_json((tmp_path / "p" / "summary.json").read_text())["settings"]
    assert {k: settings[k] for k in ("preset", "max_context_num_tokens", "max_gap_s", "max_sessions",
                                     "session_sampling", "stagger_s")} == \
        {"preset": "paper", "max_context_num_tokens": 110000, "max_gap_s": 120.0, "max_sessions": 125,
         "session_sampling": "all", "stagger_s": 20.0}
    rc, _, err = run(["--trace", trace, "--preset", "paper", "--max-gap", "none", "--max-sessions", "all",
                      "--stagger", "0", "--policies", "unlimited", "--out", str(tmp_path / "q"), *FAST], capsys)
    assert rc == 0, err
    settings = strict_json((tmp_path / "q" / "summary.json").read_text())["settings"]
    assert (settings["max_gap_s"], settings["max_sessions"], settings["stagger_s"]) == (None, None, 0.0)


def test_table_and_csv_carry_non_first_percentiles(tmp_path, capsys):
    rc, out, err = run(["--trace", str(small_trace(tmp_path)), "--policies", "histate,unlimited",
                        "--out", str(tmp_path), *FAST], capsys)
    assert rc == 0, err
    assert "p95 nf" in out and "p99 nf" in out and "nf p99 x" in out
    summary = strict_json((tmp_path / "summary.json").read_text())
    assert summary["policies"]["histate"]["non_first_requests"] == 3
    rows = (tmp_path / "requests.csv").read_text().splitlines()
    header = rows[0].split(",")
    index = header.index("session_index")
    assert sorted(int(r.split(",")[index]) for r in rows[1:] if r.startswith("histate,")) == [0, 0, 1, 1, 2]


def test_engine_what_if_serves_every_policy_with_one_scheduler(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    for engine, expected in ((None, {"histate": "sglang", "vllm-disk": "vllm"}),
                             ("vllm", {"histate": "vllm", "vllm-disk": "vllm"})):
        out_dir = tmp_path / str(engine)
        rc, _, err = run(["--trace", trace, "--policies", "histate,vllm-disk", "--out", str(out_dir), *FAST]
                         + (["--engine", engine] if engine else []), capsys)
        assert rc == 0, err
        summary = strict_json((out_dir / "summary.json").read_text())
        assert {name: p["engine"] for name, p in summary["policies"].items()} == expected
        assert summary["settings"]["engine_name"] == engine
    assert_refused(["--engine", "trt"], capsys, "--engine")


def test_token_scale_replays_the_workload_bench_sends(tmp_path, capsys):
    """--token-scale means what it means for `histate bench` (histate.bench.scaling): the same requests,
    so `histate compare out/live out/sim` pairs a scaled live run with its simulation."""
    from histate.bench.scaling import scale_workload
    from histate.sim.traces import LoadOptions, load_weka

    trace = small_trace(tmp_path)
    rc, _, err = run(["--trace", str(trace), "--model", "tiny-qwen3.5", "--token-scale", "0.5", "--policies", "histate",
                      "--out", str(tmp_path / "out"), *FAST], capsys)
    assert rc == 0, err
    summary = strict_json((tmp_path / "out" / "summary.json").read_text())
    assert summary["settings"]["token_scale"] == 0.5 and "tokens x0.5" in summary["settings"]["workload"]
    rows = (tmp_path / "out" / "requests.csv").read_text().splitlines()
    header = rows[0].split(",")
    got = {int(r.split(",")[header.index("uid")]): int(r.split(",")[header.index("input_tokens")]) for r in rows[1:]}
    bench = scale_workload(load_weka(trace, LoadOptions(max_context_num_tokens=65536)), 0.5)
    want = {r.uid: r.input_num_tokens for s in bench.sessions for r in s.requests}
    assert got == want and sorted(got.values()) == [320, 500, 640, 960]
    assert_refused(["--token-scale", "0.3"], capsys, "--token-scale", "1/k")


def test_ctrl_c_during_a_policy_writes_the_policies_that_finished(tmp_path, capsys, monkeypatch):
    import histate.sim.replay

    real = histate.sim.replay.replay_policies

    def interrupted_at_the_second(workload, policies, *args, **kwargs):
        if policies == ["vllm-disk"]:
            raise KeyboardInterrupt
        return real(workload, policies, *args, **kwargs)

    monkeypatch.setattr(histate.sim.replay, "replay_policies", interrupted_at_the_second)
    rc, out, err = run(["--trace", str(small_trace(tmp_path)), "--policies", "histate,vllm-disk,unlimited",
                        "--out", str(tmp_path / "out"), *FAST], capsys)
    assert rc == 130 and err.count("\n") == 1
    assert err == (f"histate replay: interrupted during vllm-disk; wrote the 1 policies that finished (histate) "
                   f"to {tmp_path / 'out'}\n")
    summary = strict_json((tmp_path / "out" / "summary.json").read_text())
    assert list(summary["policies"]) == ["histate"]
    assert summary["interrupted"] == {"policy": "vllm-disk", "not_replayed": ["vllm-disk", "unlimited"]}
    assert "histate" in out


def test_ctrl_c_while_loading_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    import histate.cli.plan

    def interrupted(args, settings):
        raise KeyboardInterrupt

    monkeypatch.setattr(histate.cli.plan, "load_workload", interrupted)
    out_dir = tmp_path / "out"
    rc, _, err = run(["--trace", str(small_trace(tmp_path)), "--out", str(out_dir), *FAST], capsys)
    assert rc == 130
    assert err == "histate replay: interrupted while loading the workload; nothing was replayed or written\n"
    assert not (out_dir / "summary.json").exists()


def test_trace_dash_reads_standard_input(tmp_path):
    import subprocess
    import sys

    trace = small_trace(tmp_path).read_bytes()
    done = subprocess.run([sys.executable, "-m", "histate.cli", "replay", "--trace", "-", "--model", "tiny-qwen3.5",
                           "--policies", "unlimited", "--out", str(tmp_path / "out"), *FAST],
                          input=trace, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    settings = strict_json((tmp_path / "out" / "summary.json").read_text())["settings"]
    assert (settings["trace"], settings["admitted_requests"]) == ("-", 4)


def _plot_runs(names):
    from histate.sim.metrics import PolicyRun, RequestRecord

    def run_of(name, reused):
        return PolicyRun(name, [RequestRecord(uid, "s", 0, float(uid), 100, r, r, 0.0, uid + 0.1 * (1 + i))
                                for i, (uid, r) in enumerate(zip(range(3), reused))])

    return {name: run_of(name, {"vllm-disk": (0, 10, 50)}.get(name, (0, 80, 50))) for name in names}


def test_ttft_cdf_gives_every_policy_its_own_colour_and_line_style():
    """11 policies, 10 colours: histate and unlimited used to share blue."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from histate.core import available_policies
    from histate.sim.report import ttft_cdf_figure

    names = available_policies()
    assert len(names) > 10
    fig = ttft_cdf_figure(_plot_runs(names), plt)
    styles = [(matplotlib.colors.to_hex(line.get_color()), line.get_linestyle()) for line in fig.axes[0].get_lines()]
    plt.close(fig)
    assert len(styles) == len(names) and len(set(styles)) == len(names)


def test_per_request_plot_has_a_title_that_defines_reuse_sensitive():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from histate.sim.metrics import reuse_sensitive_uids
    from histate.sim.report import per_request_figure

    runs = _plot_runs(["histate", "vllm-disk", "unlimited"])
    cohort = reuse_sensitive_uids(runs)
    assert cohort == [1]
    fig = per_request_figure(runs, cohort, plt)
    title = fig._suptitle.get_text()
    plt.close(fig)
    assert "reuse-sensitive" in title
    assert "vllm-disk hit rate >= 5 points below unlimited's, or histate and vllm-disk hit rates >= 5 points apart" \
        in title


def test_short_prefill_first_is_recorded_and_refuses_fewer_than_one_yield(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    out_dir = tmp_path / "spf"
    rc, _, err = run(["--trace", trace, "--policies", "histate", "--out", str(out_dir), "--short-prefill-first", *FAST],
                     capsys)
    assert rc == 0, err
    settings = strict_json((out_dir / "summary.json").read_text())["settings"]
    assert settings["engine"]["short_prefill_first"] == {"max_yields": DEFAULT_MAX_YIELDS, "short_max_tokens": None}
    assert_refused(["--short-prefill-first", "-1"], capsys, "--short-prefill-first")
    # 0 yields would never let a short prefill pass: the plugin's --histate-short-prefill-max-yields refuses it too
    assert_refused(["--short-prefill-first", "0"], capsys, "--short-prefill-first")


def test_chunked_prefill_size_sets_every_engines_step_budget(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    out_dir = tmp_path / "cps"
    rc, _, err = run(["--trace", trace, "--policies", "histate,vllm-disk", "--out", str(out_dir),
                      "--chunked-prefill-size", "4096", *FAST], capsys)
    assert rc == 0, err
    assert strict_json((out_dir / "summary.json").read_text())["settings"]["engine"]["token_budget_per_step"] == 4096
    assert_refused(["--chunked-prefill-size", "0"], capsys, "--chunked-prefill-size")


def test_the_ttft_plot_draws_histate_the_ceiling_and_each_engines_best_baseline():
    from histate.sim.report import compared_policies

    p95 = {"histate": 1.4, "vllm-disk": 2.0, "histate-paper": 1.0, "vllm-disk-turns": 1.5, "sglang-hicache": 3.0,
           "sglang-tuned": 2.5, "unlimited": 1.3, "vllm-marconi": float("nan")}
    summary = {"policies": {name: {"ttft_p95_s": v} for name, v in p95.items()}}
    # per engine the lowest p95 among its baselines (HiState's ablations are not baselines), run order kept
    assert compared_policies(summary) == ["histate", "vllm-disk-turns", "sglang-tuned", "unlimited"]


def test_plot_policies_must_be_replayed(tmp_path, capsys):
    from histate.cli import main as cli_main

    assert cli_main(["replay", "--policies", "histate,vllm-disk", "--plot-policies", "unlimited", "--max-sessions", "2",
                     "--no-progress", "--out", str(tmp_path)]) == 2
    assert "--plot-policies unlimited: not among --policies" in capsys.readouterr().err
