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

