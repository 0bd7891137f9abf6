"""Replay driver and metrics: golden per-policy reuse on a fixed synthetic trace, determinism,
admission limits, subagent ordering, the paper's cohort definitions, and CLI errors."""
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from histate.cli import main as cli_main
from histate.core import available_policies
from histate.sim.metrics import (PolicyRun, RequestRecord, percentile, recovered_fraction, reuse_sensitive_uids,
                                 summarize)
from histate.sim.replay import GiB, ReplayConfig, admission_order, replay, replay_policies, sampled_roots
from histate.sim.request import Request, Session, Workload, WorkloadStats
from histate.sim.workloads import default_workload

GOLDEN = Path(__file__).with_name("golden_replay.json")
# Tight budgets so that every tier fills: 2 GiB GPU is 64K tokens of Qwen3.5-9B KV. No start-up
# stagger: the synthetic workload spreads each session's first request over 60 s itself, and the
# golden numbers pin the cache policies, not the admission ramp (tested on its own below).
TIGHT = ReplayConfig(gpu_cache_bytes=2 * GiB, cpu_cache_bytes=4 * GiB, ssd_cache_bytes=12 * GiB, max_live_sessions=8,
                     stagger_s=0.0)


@pytest.fixture(autouse=True)
def _default_out_dir_under_tmp_path(tmp_path, monkeypatch):
    """A replay creates its --out directory (default out/replay, relative to the current directory)
    before it reads its input, so even refused runs made one in the working tree: run from tmp_path."""
    monkeypatch.chdir(tmp_path)


def golden_numbers(run: PolicyRun) -> dict:
    s = run.cache_stats
    return {"reused_tokens": sum(r.reused_tokens for r in run.records),
            "kv_hit_tokens": sum(r.kv_hit_tokens for r in run.records),
            "requests": len(run.records), "evictions": sum(s.evictions.values())}


def golden_replay() -> dict:
    """What golden_replay.json pins: every policy on the seeded synthetic workload under TIGHT."""
    runs = replay_policies(default_workload(seed=0), available_policies(), TIGHT, progress=False)
    return {name: golden_numbers(run) for name, run in runs.items()}


def test_golden_reused_tokens_per_policy():
    """Exact integers per policy. The test only compares and never writes golden_replay.json: to accept
    new numbers, run `make golden` (test/update_golden.py, the only writer) and review the diff."""
    got = golden_replay()
    assert got == json.loads(GOLDEN.read_text()), \
        "golden numbers moved: if intended, run `make golden` and review the diff"
    assert all(g["reused_tokens"] <= got["unlimited"]["reused_tokens"] for g in got.values())
    # TIGHT's host KV pool (4 GiB less the staging slots) is under 1.8x its 2 GiB device: `histate` is the
    # server that picks write_back by itself (core/write_policy.py), request for request the same as the
    # policy that names write_back
    assert got["histate"] == got["histate-writeback"]


def test_histate_on_a_short_host_is_the_write_back_server_request_by_request():
    w = default_workload(seed=1)
    auto, named = replay(w, "histate", TIGHT), replay(w, "histate-writeback", TIGHT)
    key = lambda r: (r.uid, r.first_token_s, r.reused_tokens, r.kv_hit_tokens, r.miss_tokens)
    assert [key(r) for r in auto.records] == [key(r) for r in named.records]
    roomy = replace(TIGHT, cpu_cache_bytes=8 * GiB)  # 4x the device: write_through, as before
    assert [key(r) for r in replay(w, "histate", roomy).records] != \
        [key(r) for r in replay(w, "histate-writeback", roomy).records]


def test_replay_is_deterministic_for_a_seed():
    w = default_workload(seed=1)
    a, b = (replay(w, "histate", TIGHT) for _ in range(2))
    key = lambda r: (r.uid, r.arrival_s, r.first_token_s, r.reused_tokens, r.kv_hit_tokens)
    assert [key(r) for r in a.records] == [key(r) for r in b.records]
    assert len(a.records) == w.num_requests


def _session(sid, n, gap_s=10.0, keys_per_request=4, **kw):
    requests, keys = [], ()
    for i in range(n):
        keys = keys + tuple((sid, i, j) for j in range(keys_per_request))
        requests.append(Request(uid=hash((sid, i)) & 0xFFFFFFF, session_id=sid, index=i,
                                input_num_tokens=64 * len(keys), output_num_tokens=8, page_keys=keys,
                                gap_before_s=gap_s, **kw.get("req", {})))
    return Session(sid, tuple(requests), **{k: v for k, v in kw.items() if k != "req"})


def test_admission_never_exceeds_the_live_session_limit():
    sessions = [_session(f"s{i}", 3) for i in range(10)]
    w = Workload("t", sessions, WorkloadStats(sessions=10, requests=30))
    run = replay(w, "histate", ReplayConfig(max_live_sessions=3))
    spans = {}
    for r in run.records:
        lo, hi = spans.get(r.session_id, (math.inf, -math.inf))
        spans[r.session_id] = (min(lo, r.arrival_s), max(hi, r.completion_s))
    for t, _ in spans.values():
        live = sum(1 for lo, hi in spans.values() if lo <= t < hi)
        assert live <= 3
    assert len(run.records) == 30


def test_parent_waits_for_its_subagents():
    child = _session("child", 2, gap_s=1.0, parent_session_id="p", spawn_after_index=0)
    parent = _session("p", 2, gap_s=5.0)
    reqs = list(parent.requests)
    reqs[1] = Request(**{**{f: getattr(reqs[1], f) for f in Request.__slots__}, "after_sessions": ("child",)})
    parent = Session("p", tuple(reqs), subagents=(child,))
    w = Workload("t", [parent], WorkloadStats(sessions=1, requests=4))
    records = sorted(replay(w, "histate").records, key=lambda r: r.arrival_s)
    order = [r.session_id for r in records]
    assert order == ["p", "child", "child", "p"]
    assert records[3].arrival_s == pytest.approx(records[2].completion_s + 5.0)


def _run(name, rates):
    """Records with input 100 tokens and the given hit rates."""
    return PolicyRun(name, [RequestRecord(uid, "s", 0, 0.0, 100, 100, int(h * 100), first_token_s=1.0)
                            for uid, h in enumerate(rates)])


def test_reuse_sensitive_cohort_and_recovered_fraction_by_hand():
    runs = {"unlimited": _run("unlimited", [0.9, 0.9, 0.5, 0.8]),
            "vllm-disk": _run("vllm-disk", [0.9, 0.8, 0.5, 0.8]),
            "histate": _run("histate", [0.9, 0.9, 0.6, 0.8])}
    # uid 1: disk 10 points below unlimited; uid 2: histate and disk differ by 10 points
    assert reuse_sensitive_uids(runs) == [1, 2]
    assert recovered_fraction(runs, "histate", [1, 2]) == pytest.approx((90 + 60) / (90 + 50))
    assert recovered_fraction(runs, "vllm-disk", [1, 2]) == pytest.approx((80 + 50) / (90 + 50))


def test_percentile_matches_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile(list(range(101)), 99) == 99.0


def test_cli_rejects_unknown_policy_and_missing_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["replay", "--policies", "histate,nope"])
    assert "unknown policy nope" in capsys.readouterr().err
    assert cli_main(["replay", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file or directory" in capsys.readouterr().err


def test_cli_replays_and_writes_reports(tmp_path, capsys):
    assert cli_main(["replay", "--synthetic", "mutation", "--mutation-rate", "0.1", "--policies",
                     "histate,vllm-disk,unlimited", "--max-sessions", "6", "--no-progress", "--no-plots",
                     "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "histate" in out and "hit rate" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"histate", "vllm-disk", "unlimited"}
    assert (tmp_path / "requests.csv").read_text().count("\n") == 1 + 3 * 6 * 16


def test_cli_reports_bad_input_in_one_line_naming_file_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "t1", "requests": [{"t": 0, "in": "abc"}]}\n')
    assert cli_main(["replay", "--trace", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("histate replay: error: ") and f"{bad}:1: requests[0].in" in err
    assert cli_main(["replay", "--model", "nope", "--no-progress"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_the_first_wave_is_released_one_every_stagger_seconds():
    sessions = [_session(f"s{i}", 2, gap_s=30.0) for i in range(5)]
    w = Workload("t", sessions, WorkloadStats(sessions=5, requests=10))
    config = ReplayConfig(max_live_sessions=3, stagger_s=7.0)
    order = [root.session_id for root in admission_order(w, config)]
    firsts = {r.session_id: r.arrival_s for r in replay(w, "histate", config).records if r.session_index == 0}
    assert [firsts[sid] for sid in order[:3]] == [30.0, 37.0, 44.0]  # release k x 7 s, then its 30 s gap
    assert min(firsts[sid] for sid in order[3:]) > 90.0   # later admissions wait for a session to end
    unstaggered = replay(w, "histate", ReplayConfig(max_live_sessions=3, stagger_s=0.0)).records
    assert sorted(r.arrival_s for r in unstaggered if r.session_index == 0)[:3] == [30.0, 30.0, 30.0]


def test_sampling_from_all_roots_lets_empty_roots_take_a_slot_and_pairs_draws_across_clips():
    kept = {sid: _session(sid, 2) for sid in "abcdef"}
    root_ids = tuple("abcdef")
    full = Workload("t", list(kept.values()), WorkloadStats(), root_ids=root_ids)
    clipped = Workload("t", [kept[s] for s in "ace"], WorkloadStats(), root_ids=root_ids)  # b, d, f emptied
    for seed in range(8):
        config = ReplayConfig(max_sessions=3, seed=seed)
        drawn_full = [r.session_id for r in sampled_roots(full, config)]
        drawn_clipped = sampled_roots(clipped, config)
        assert len(drawn_full) == len(drawn_clipped) == 3
        # the same roots, in the same order; the emptied ones are None and not admitted
        assert [r.session_id if r else None for r in drawn_clipped] == [s if s in "ace" else None for s in drawn_full]
        assert [r.session_id for r in admission_order(clipped, config)] == [s for s in drawn_full if s in "ace"]
        non_empty = admission_order(clipped, ReplayConfig(max_sessions=3, seed=seed, session_sampling="non-empty"))
        assert sorted(r.session_id for r in non_empty) == ["a", "c", "e"]
    with pytest.raises(ValueError, match="session_sampling"):
        ReplayConfig(session_sampling="some")


def test_non_first_percentiles_leave_out_each_sessions_first_request():
    records = [RequestRecord(uid, "s", 0, 0.0, 100, 0, 0, first_token_s=ttft, session_index=index)
               for uid, (ttft, index) in enumerate([(9.0, 0), (1.0, 1), (2.0, 2), (3.0, 3), (8.0, 0)])]
    s = summarize(PolicyRun("p", records))
    assert (s["requests"], s["non_first_requests"]) == (5, 3)
    assert s["ttft_p99_s"] == pytest.approx(8.0 + 0.96 * 1.0)      # over 1, 2, 3, 8, 9
    assert s["ttft_p99_non_first_s"] == pytest.approx(2.0 + 0.98)  # over 1, 2, 3
    assert s["ttft_p95_non_first_s"] == pytest.approx(2.0 + 0.90)
