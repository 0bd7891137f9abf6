"""Synthetic workloads: determinism, and the exact page-key relationship of every mutation kind."""
import pytest

from histate.sim.request import RequestFlag, common_prefix_pages
from histate.sim.workloads import AgentWorkloadConfig, agent_workload, default_workload, mutation_microbenchmark

P = 64


def shape(w):
    return [(r.session_id, r.input_num_tokens, r.output_num_tokens, r.page_keys, r.output_page_keys,
             r.gap_before_s, r.flags) for r in w.iter_requests()]


def fixed(**kw):
    """Fixed sizes so every expected length is computable: 1,000-token first input after a 1,024-token
    system prompt, 300 new tokens per turn, 70 output tokens."""
    base = dict(num_sessions=3, num_turns=10, system_prompt_num_tokens=1024, first_input_num_tokens=(1000, 1000),
                append_num_tokens=(300, 300), output_num_tokens=(70, 70), truncation_rate=0.0,
                rewind_edit_rate=0.0, fork_rate=0.0, compaction_rate=0.0, max_context_num_tokens=None)
    base.update(kw)
    return agent_workload(AgentWorkloadConfig(**base))


def seen_before(w, upto_request):
    """Every key (prompt or output page) of requests issued before `upto_request` in the workload."""
    keys = set()
    for r in w.iter_requests():
        if r is upto_request:
            return keys
        keys.update(r.page_keys)
        keys.update(r.output_page_keys)
    raise AssertionError("request not in workload")


def test_generation_is_deterministic_and_seeded():
    assert shape(default_workload()) == shape(default_workload())
    assert shape(default_workload(seed=1)) != shape(default_workload())


def test_sessions_do_not_depend_on_how_many_are_generated():
    few, many = fixed(num_sessions=2, rewind_edit_rate=0.3), fixed(num_sessions=5, rewind_edit_rate=0.3)
    for a, b in zip(few.sessions, many.sessions):
        assert [(r.input_num_tokens, r.gap_before_s, r.flags) for r in a.requests] == \
               [(r.input_num_tokens, r.gap_before_s, r.flags) for r in b.requests]


def test_append_turns_extend_prompt_plus_output():
    w = fixed()
    system = tuple(w.sessions[0].requests[0].page_keys[:16])
    for s in w.sessions:
        reqs = s.requests
        assert reqs[0].input_num_tokens == 2024 and reqs[0].page_keys[:16] == system   # shared system prompt
        for prev, cur in zip(reqs, reqs[1:]):
            assert cur.flags == RequestFlag.NONE
            assert cur.input_num_tokens == prev.input_num_tokens + 70 + 300
            full = prev.page_keys + prev.output_page_keys
            assert len(full) == (prev.input_num_tokens + 70) // P
            assert cur.page_keys[:len(full)] == full
            assert not set(cur.page_keys[len(full):]) & seen_before(w, cur)
    assert len({r.page_keys[16] for r in w.iter_requests() if r.index == 0}) == 3      # users differ


def test_truncation_cuts_the_previous_prompt_at_an_internal_256_boundary():
    w = fixed(truncation_rate=1.0)
    count = 0
    for s in w.sessions:
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert cur.flags == RequestFlag.TRUNCATION | RequestFlag.MUTATION
            cut = cur.input_num_tokens - 300
            assert cut % 256 == 0 and 0 < cut < prev.input_num_tokens
            assert common_prefix_pages(cur.page_keys, prev.page_keys) == cut // P
            assert not set(cur.page_keys[cut // P:]) & seen_before(w, cur)
            count += 1
    assert w.stats.mutations["TRUNCATION"] == count == 27


def test_rewind_edit_cuts_inside_an_earlier_turns_message():
    w = fixed(rewind_edit_rate=1.0, append_num_tokens=(700, 700))
    for s in w.sessions:
        reqs = s.requests
        for r, cur in enumerate(reqs[1:], start=1):
            assert cur.flags == RequestFlag.REWIND_EDIT | RequestFlag.MUTATION
            cut = cur.input_num_tokens - 700
            assert cut % 256 == 0
            # Some earlier turn k has its appended message around the cut: start_k < cut < prompt_k.
            matches = [k for k in range(r) if common_prefix_pages(cur.page_keys, reqs[k].page_keys) == cut // P
                       and reqs[k].input_num_tokens > cut]
            assert matches, (r, cut)
            assert not set(cur.page_keys[cut // P:]) & seen_before(w, cur)


def test_fork_continues_from_an_earlier_turn_end():
    w = fixed(fork_rate=1.0)
    for s in w.sessions:
        reqs = s.requests
        assert reqs[1].flags == RequestFlag.NONE                      # no earlier turn to fork from yet
        for r, cur in enumerate(reqs[2:], start=2):
            assert cur.flags == RequestFlag.FORK | RequestFlag.MUTATION
            ends = [k for k in range(r - 1) if
                    cur.page_keys[:len(reqs[k].page_keys) + len(reqs[k].output_page_keys)]
                    == reqs[k].page_keys + reqs[k].output_page_keys
                    and cur.input_num_tokens == reqs[k].input_num_tokens + 70 + 300]
            assert ends, r


def test_compaction_keeps_only_the_system_prompt():
    w = fixed(compaction_rate=1.0)
    for s in w.sessions:
        reqs = s.requests
        for r, cur in enumerate(reqs[1:], start=1):
            assert cur.flags == RequestFlag.COMPACTION | RequestFlag.MUTATION
            assert cur.input_num_tokens == 1024 + 2048 + 300
            for earlier in reqs[:r]:
                assert common_prefix_pages(cur.page_keys, earlier.page_keys) == 16
    assert w.stats.compactions == 27


def test_context_limit_forces_a_compaction():
    w = fixed(num_sessions=1, num_turns=40, max_context_num_tokens=8192)
    reqs = w.sessions[0].requests
    assert max(r.input_num_tokens for r in reqs) <= 8192
    forced = [r for r in reqs if r.flags & RequestFlag.COMPACTION]
    assert forced and all(r.input_num_tokens == 1024 + 2048 + 300 for r in forced)


def test_microbenchmark_matches_the_paper_setup_and_pairs_rates():
    base = mutation_microbenchmark(0.0)
    assert len(base.sessions) == 48 and base.num_requests == 48 * 16
    for s in base.sessions:
        reqs = s.requests
        assert [r.input_num_tokens for r in reqs] == [8192 + i * (8192 + 256) for i in range(16)]
        assert all(r.output_num_tokens == 256 for r in reqs)
        assert all(r.gap_before_s == 180.0 for r in reqs[1:]) and 0 <= reqs[0].gap_before_s < 180
    mutated = {}
    for rate in (0.02, 0.05, 0.10):
        w = mutation_microbenchmark(rate)
        mutated[rate] = {(r.session_id, r.index) for r in w.iter_requests() if r.is_mutation}
        assert w.stats.mutations["TRUNCATION"] == len(mutated[rate])
        assert all(r.flags & RequestFlag.TRUNCATION for r in w.iter_requests() if r.is_mutation)
    assert mutated[0.02] <= mutated[0.05] <= mutated[0.10]            # common random numbers
    assert (len(mutated[0.02]), len(mutated[0.05]), len(mutated[0.10])) == (12, 39, 82)   # of 720 turns


def test_default_workload_is_small_and_has_every_mutation_kind():
    w = default_workload()
    assert w.num_requests == 384 and w.stats.input_tokens < 10_000_000
    assert all(count > 0 for count in w.stats.mutations.values())


def test_config_validation():
    with pytest.raises(ValueError, match="sum to <= 1"):
        AgentWorkloadConfig(truncation_rate=0.7, fork_rate=0.5)
    with pytest.raises(ValueError, match="multiple of page_num_tokens"):
        AgentWorkloadConfig(cut_granularity_num_tokens=100)
    with pytest.raises(ValueError, match="append_num_tokens"):
        AgentWorkloadConfig(append_num_tokens=(10, 5))
