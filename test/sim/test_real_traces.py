"""The Weka loader on the first conversations of the shared dev split (skipped without ../shared)."""
import gzip
import itertools
import json
import os

import pytest

from histate.sim.presets import PRESETS
from histate.sim.replay import ReplayConfig, admission_order, sampled_roots
from histate.sim.request import common_prefix_pages
from histate.sim.traces import LoadOptions, iter_weka_sessions, load_weka

WEKA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces", "cc-traces-weka-042026")
WEKA = os.path.join(WEKA_DIR, "traces.jsonl.gz")
NUM_SESSIONS = 25

pytestmark = pytest.mark.skipif(not os.path.exists(WEKA), reason="../shared/traces not present")


def raw_sessions(n):
    with gzip.open(WEKA, "rt") as f:
        return [json.loads(line) for line in itertools.islice(f, n)]


def manifest():
    with open(os.path.join(WEKA_DIR, "manifest.tsv")) as f:
        rows = [line.rstrip("\n").split("\t") for line in f][1:]
    return {trace_id: int(count) for trace_id, count, _ in rows}


def test_keys_agree_with_raw_hash_ids_and_counts_with_the_manifest():
    options = LoadOptions(max_context_num_tokens=None)
    sessions = list(itertools.islice(iter_weka_sessions(WEKA, options), NUM_SESSIONS))
    raws = raw_sessions(NUM_SESSIONS)
    counts = manifest()
    for session, raw in zip(sessions, raws):
        assert session.session_id == raw["id"]
        assert sum(len(s.requests) for s in session.iter_sessions()) == counts[raw["id"]]
        raw_requests = [r for r in raw["requests"] if r["type"] != "subagent"]
        assert [r.input_num_tokens for r in session.requests] == [r["in"] for r in raw_requests]
        for (a, b), (ra, rb) in zip(itertools.pairwise(session.requests), itertools.pairwise(raw_requests)):
            lcp = 0
            for x, y in zip(ra["hash_ids"], rb["hash_ids"]):
                if x != y:
                    break
                lcp += 1
            assert common_prefix_pages(a.page_keys, b.page_keys) == lcp
            assert b.gap_before_s >= 0


def test_default_clipping_drops_nothing_silently(tmp_path):
    raws = raw_sessions(NUM_SESSIONS)
    path = tmp_path / "head.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in raws))
    w = load_weka(path)                                      # default: 131,072 tokens, truncate_session
    counts = manifest()
    assert w.stats.requests + w.stats.requests_over_context == sum(counts[r["id"]] for r in raws)
    kept = {s.session_id: [r.input_num_tokens for r in s.requests] for s in w.sessions}
    for raw in raws:
        sizes = list(itertools.takewhile(lambda n: n <= 131072,
                                         (r["in"] for r in raw["requests"] if r["type"] != "subagent")))
        assert kept.get(raw["id"], []) == sizes
    assert w.stats.sessions + w.stats.sessions_dropped_empty >= NUM_SESSIONS


def test_paper_preset_draws_125_of_all_roots_and_the_emptied_ones_take_a_slot():
    """The load docs/results.md reports for `--preset paper`, seed 0 (the paper: 3,784 requests)."""
    preset = PRESETS["paper"]
    w = load_weka(WEKA, LoadOptions(max_context_num_tokens=preset.max_context_num_tokens, max_gap_s=preset.max_gap_s))
    config = ReplayConfig(max_sessions=preset.max_sessions, session_sampling=preset.session_sampling, seed=0)
    drawn, admitted = sampled_roots(w, config), admission_order(w, config)
    assert (len(w.root_ids), len(w.sessions)) == (568, 439)
    assert (len(drawn), len(admitted)) == (125, 97)
    assert sum(len(s.requests) for root in admitted for s in root.iter_sessions()) == 3407
