"""`histate compare`: runs rebuilt from requests.csv, ratios against each policy's first run."""
import pytest

from histate.bench.compare import compare, format_comparison, load_runs, write_comparison
from histate.cli import main
from histate.sim.metrics import PolicyRun, RequestRecord
from histate.sim.report import build_summary, write_outputs


def _run(policy, ttfts, reused):
    records = [RequestRecord(uid, "s", 0, float(uid), 100, r, r, 0.0, uid + t) for uid, (t, r) in
               enumerate(zip(ttfts, reused))]
    return PolicyRun(policy, records)


def _write(directory, *runs):
    runs = {r.policy: r for r in runs}
    write_outputs(runs, build_summary(runs), directory, plots=False)
    return directory


def test_ratios_and_hit_rate_differences_against_the_first_run(tmp_path):
    live = _write(tmp_path / "live", _run("histate", [0.1, 0.2, 0.3], [50, 50, 80]), _run("none", [1.0, 1.0], [0, 0]))
    sim = _write(tmp_path / "sim", _run("histate", [0.2, 0.4, 0.6], [50, 50, 50]))
    table = compare([live, sim])
    assert list(table) == ["histate", "none"]
    ref, other = table["histate"]
    assert (ref["run"], other["run"]) == ("live", "sim")
    assert ref["ttft_p50_s"] == pytest.approx(0.2) and other["ttft_p50_s"] == pytest.approx(0.4)
    assert other["ttft_p50_ratio"] == pytest.approx(2.0) and other["ttft_mean_ratio"] == pytest.approx(2.0)
    assert ref["token_hit_rate"] == pytest.approx(0.6) and other["hit_rate_diff"] == pytest.approx(-0.1)
    assert "ttft_p50_ratio" not in ref and len(table["none"]) == 1
    text = format_comparison(table)
    assert "  2.00" in text and "-10.0p" in text


def test_labels_outputs_and_plot(tmp_path):
    a = _write(tmp_path / "a", _run("histate", [0.1, 0.2], [10, 20]))
    b = _write(tmp_path / "b", _run("histate", [0.1, 0.4], [10, 20]))
    table = compare([a, b], ["live", "sim"])
    assert [r["run"] for r in table["histate"]] == ["live", "sim"]
    written = write_comparison(table, [a, b], ["live", "sim"], tmp_path / "out")
    assert {p.name for p in written} >= {"compare.json"}
    with pytest.raises(ValueError, match="2 labels for 1"):
        compare([a], ["x", "y"])


def test_records_round_trip_through_the_csv(tmp_path):
    run = _run("histate", [0.125, 0.5], [64, 0])
    runs = load_runs(_write(tmp_path / "r", run))
    got = runs["histate"].records
    assert [(r.uid, r.reused_tokens, r.input_tokens) for r in got] == [(0, 64, 100), (1, 0, 100)]
    assert [r.ttft_s for r in got] == pytest.approx([0.125, 0.5])


def test_bad_inputs_name_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "requests.csv").write_text("policy,uid,session_id,flags,arrival_s,input_tokens,kv_hit_tokens,"
                                      "reused_tokens,restore_s,ttft_s\nhistate,0,s,0,0.0,100,x,0,0,0.1\n")
    with pytest.raises(ValueError, match=r"requests.csv:2: "):
        load_runs(bad)
    assert main(["compare", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("histate compare: error:") and "no requests.csv" in err and "\n" not in err
    assert main(["compare", str(bad)]) == 2
    assert "requests.csv:2:" in capsys.readouterr().err



def test_single_policy_runs_are_compared_whatever_their_names(tmp_path, capsys):
    """Live runs hold one policy each (named by --label or the server): the first DIR is the reference."""
    a = _write(tmp_path / "a", _run("histate", [0.1, 0.2, 0.3], [50, 50, 80]))
    b = _write(tmp_path / "b", _run("live", [0.2, 0.4, 0.6], [50, 50, 50]))
    table = compare([a, b])
    assert list(table) == ["histate"]
    ref, other = table["histate"]
    assert (ref["policy"], other["policy"]) == ("histate", "live")
    assert other["ttft_p50_ratio"] == pytest.approx(2.0) and other["hit_rate_diff"] == pytest.approx(-0.1)
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "live" in out and "  2.00" in out


def test_runs_of_different_workloads_are_compared_with_a_warning(tmp_path, capsys):
    a = _write(tmp_path / "a", _run("histate", [0.1, 0.2], [10, 20]))
    same = _write(tmp_path / "same", _run("histate", [0.3, 0.4], [0, 0]))
    warnings = []
    compare([a, same], warnings=warnings)
    assert warnings == []
    other = tmp_path / "other"
    other.mkdir()
    rows = (a / "requests.csv").read_text().replace(",100,", ",90,")  # same uids, other prompts
    (other / "requests.csv").write_text(rows)
    fewer = _write(tmp_path / "fewer", _run("histate", [0.1], [10]))
    compare([a, other, fewer], warnings=warnings)
    assert len(warnings) == 2
    assert "run 'other' is not the workload of the reference run 'a': 2 of 2 common requests differ" in warnings[0]
    assert "run 'fewer' is not the workload of the reference run 'a': 1 requests against 2" in warnings[1]
    assert main(["compare", str(a), str(other)]) == 0  # the table is still printed, after the warning
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: run 'other'") and "p50 x" in captured.out


@pytest.mark.parametrize("ttft", ["nan", "inf", "-0.5"])
def test_a_ttft_that_is_not_a_finite_time_is_an_error(tmp_path, capsys, ttft):
    run_dir = _write(tmp_path / "r", _run("histate", [0.1, 0.2], [10, 20]))
    path = run_dir / "requests.csv"
    lines = path.read_text().splitlines()
    column = lines[0].split(",").index("ttft_s")
    cells = lines[2].split(",")
    cells[column] = str(ttft)
    lines[2] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    assert main(["compare", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"requests.csv:3: ttft_s is '{ttft}', expected a finite number of seconds >= 0" in err


def test_a_header_only_csv_is_an_error(tmp_path, capsys):
    run_dir = _write(tmp_path / "r", _run("histate", [0.1], [10]))
    path = run_dir / "requests.csv"
    path.write_text(path.read_text().splitlines()[0] + "\n")
    assert main(["compare", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"histate compare: error: {path}: no requests (a header and no rows)"


def test_session_index_round_trips_so_non_first_percentiles_are_defined(tmp_path):
    records = [RequestRecord(uid, "s", 0, float(uid), 100, 0, 0, 0.0, uid + 0.1, session_index=uid)
               for uid in range(3)]
    runs = load_runs(_write(tmp_path / "r", PolicyRun("histate", records)))
    assert [r.session_index for r in runs["histate"].records] == [0, 1, 2]
    assert compare([tmp_path / "r"])["histate"][0]["non_first_requests"] == 2


def test_miss_reasons_survive_the_csv_and_a_run_without_them_has_none(tmp_path):
    from histate.core import MISS_REASONS

    run = _run("histate", [0.1, 0.2], [10, 20])
    for k, record in enumerate(run.records):
        record.miss_tokens = {reason: (i + 1) * (k + 1) for i, reason in enumerate(MISS_REASONS)}
    loaded = load_runs(_write(tmp_path / "with", run))["histate"].records
    assert [r.miss_tokens for r in loaded] == [r.miss_tokens for r in run.records]
    plain = load_runs(_write(tmp_path / "without", _run("histate", [0.1], [10])))["histate"].records
    assert plain[0].miss_tokens is None
