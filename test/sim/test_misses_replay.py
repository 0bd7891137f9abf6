"""Miss attribution in `histate replay` (core/misses.py): per request, per policy, in the report.

The reasons of every request add up to its uncached tokens; they are the ones an independent record
of the same replay's cache events (`explain.EvictionLog`, attached through the replay's observer)
gives by the rule, at the moment the request matched; `unlimited` evicts nothing, so it has no
eviction reasons; the CLI writes one requests.csv column per reason and the stacked plot."""
from __future__ import annotations

import csv
import json

import pytest

from histate.cli import main as cli_main
from histate.core import MISS_REASONS
from histate.sim.explain import EvictionLog
from histate.sim.replay import replay
from histate.sim.workloads import default_workload

from ..core.helpers import expected_reasons
from .test_replay import TIGHT


@pytest.mark.parametrize("policy", ["histate", "vllm-disk", "vllm-marconi", "sglang-hicache", "unlimited"])
def test_every_requests_reasons_add_up_and_match_an_independent_record(policy):
    workload = default_workload(seed=0)
    log = EvictionLog()
    run = replay(workload, policy, TIGHT, observer=log)
    requests = {r.uid: r for r in workload.iter_requests()}
    P = workload.page_num_tokens
    totals = dict.fromkeys(MISS_REASONS, 0)
    keys_of = {rec.uid: list(requests[rec.uid].keys_through(rec.input_tokens // P)) for rec in run.records}
    left = sorted(run.records, key=lambda r: r.completion_s)  # a context is seen once its request leaves
    seen: set = set()
    for rec in sorted(run.records, key=lambda r: r.matched_s):
        while left and left[0].completion_s < rec.matched_s:
            request = requests[left.pop(0).uid]
            seen.update(request.keys_through((request.input_num_tokens + request.output_num_tokens) // P))
        misses = rec.miss_tokens
        assert set(misses) == set(MISS_REASONS)
        assert sum(misses.values()) == rec.input_tokens - rec.reused_tokens, rec.uid
        # the simulator's engines match every full prompt page (EngineConfig.matches_last_prompt_token)
        keys = keys_of[rec.uid]
        expected = expected_reasons(log, keys, rec.input_tokens, P, rec.kv_hit_tokens // P, rec.reused_tokens // P,
                                    rec.matched_s, seen, rec.kv_held_tokens // P)
        assert misses == expected, (rec.uid, misses, expected)
        for reason, tokens in misses.items():
            totals[reason] += tokens
    assert totals["no_prefix"] > 0 and totals["page_boundary"] > 0
    if policy == "unlimited":
        assert totals["kv_evicted"] == totals["state_evicted"] == totals["not_restored"] == 0
        # never_cached is not 0 even here: the last output token has no KV (the engine never computes it),
        # so a page it completes was in a context and never cached
    else:  # TIGHT fills every tier
        assert totals["kv_evicted"] > 0 or totals["state_evicted"] > 0, totals


def test_the_cli_writes_a_column_per_reason_and_the_plot(tmp_path, capsys):
    assert cli_main(["replay", "--synthetic", "agent", "--policies", "histate,vllm-disk,unlimited",
                     "--max-sessions", "6", "--no-progress", "--gpu-gib", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no_checkpoint" in out and "page_boundary" in out
    with (tmp_path / "requests.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert rows
    for row in rows:
        misses = sum(int(row[f"miss_tokens_{reason}"]) for reason in MISS_REASONS)
        assert misses == int(row["input_tokens"]) - int(row["reused_tokens"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name, s in summary["policies"].items():
        assert sum(s["miss_tokens_by_reason"].values()) == s["input_tokens"] - s["reused_tokens"], name
    assert (tmp_path / "miss_reasons.png").stat().st_size > 10_000


def test_a_cluster_replay_with_l3_attributes_every_request():
    from histate.sim.cluster import ClusterConfig, replay_cluster
    from histate.sim.l3 import L3StoreConfig

    run = replay_cluster(default_workload(seed=0), "histate", TIGHT,
                         ClusterConfig(num_servers=2, l3_store=L3StoreConfig(20 * 10**9), fail_server=(0, 1800.0)))
    assert run.records and sum(run.l3_hit_tokens_by_uid.values()) > 0  # L3 served the moved sessions
    for rec in run.records:
        assert sum(rec.miss_tokens.values()) == rec.input_tokens - rec.reused_tokens, rec.uid
