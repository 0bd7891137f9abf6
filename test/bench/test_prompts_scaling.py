"""Prompts carry exactly the workload's prefix sharing; token scaling coarsens it exactly."""
import pytest

from histate.bench.prompts import PromptBuilder
from histate.bench.scaling import pages_per_scaled_page, scale_workload
from histate.sim.request import Request, Session, Workload, WorkloadStats, common_prefix_pages


def _request(uid, keys, input_num_tokens, output_num_tokens=9, gap_s=2.0, output_keys=()):
    return Request(uid, "s", uid, input_num_tokens, output_num_tokens, tuple(keys), gap_s, offset_s=uid * 10.0,
                   output_page_keys=tuple(output_keys))


def _workload(*requests):
    stats = WorkloadStats(sessions=1, requests=len(requests))
    return Workload("w", [Session("s", tuple(requests))], stats)


def test_block_tokens_are_a_fixed_function_of_salt_and_key():
    # Golden: prompts of a published run must be reproducible from its seed.
    assert PromptBuilder(64, 512, salt=0).block(1)[:8] == (157, 86, 336, 52, 12, 216, 506, 21)
    assert PromptBuilder(64, 512, salt=0).block(1) == PromptBuilder(64, 512, salt=0).block(1)
    assert PromptBuilder(64, 512, salt=1).block(1) != PromptBuilder(64, 512, salt=0).block(1)
    assert all(0 <= t < 512 for t in PromptBuilder(64, 512).block(7))


def test_prompts_share_exactly_the_pages_whose_keys_they_share():
    builder = PromptBuilder(64, 512)
    a = builder.prompt(_request(0, (1, 2, 3), 3 * 64 + 20))
    b = builder.prompt(_request(1, (1, 2, 4, 5), 4 * 64 + 5))
    assert (len(a), len(b)) == (212, 261)
    assert a[:128] == b[:128]
    assert a[128:192] != b[128:192]          # different key at page 3: different block
    # Tails are per request: the same uid twice gives the same prompt, other requests never share it.
    assert builder.prompt(_request(0, (1, 2, 3), 212)) == a
    c = builder.prompt(_request(2, (1, 2, 3), 212))
    assert c[:192] == a[:192] and c[192:] != a[192:]


def test_prompt_with_more_keys_than_tokens_is_refused():
    with pytest.raises(ValueError, match="request 0: 2 page keys"):
        PromptBuilder(64, 512).prompt(_request(0, (1, 2), 100))


def test_token_scale_merges_pages_keeping_the_group_end_key():
    w = _workload(_request(0, range(1, 8), 7 * 64 + 10, output_num_tokens=9, output_keys=(8, 9, 10)))
    scaled = scale_workload(w, 0.5, 0.5)
    (r,) = scaled.sessions[0].requests
    assert r.page_keys == (2, 4, 6)
    assert r.input_num_tokens == 229 and r.input_num_tokens // 64 == len(r.page_keys)
    assert r.output_num_tokens == 4          # round(9 / 2), banker's rounding
    assert r.output_page_keys == (8, 10)     # prompt pages 0..6, output pages 7, 8, 9: groups end at 7 and 9
    assert (r.gap_before_s, r.offset_s) == (1.0, 0.0)
    assert (scaled.stats.input_tokens, scaled.stats.output_tokens) == (229, 4)
    assert scaled.params["token_scale"] == 0.5 and scale_workload(w) is w


@pytest.mark.parametrize("k", [1, 2, 3, 16])
def test_scaled_inputs_keep_one_key_per_full_page(k):
    for num_tokens in range(0, 64 * 3 * k + 70):
        keys = tuple(range(1, num_tokens // 64 + 1))
        (r,) = scale_workload(_workload(_request(0, keys, num_tokens)), 1 / k).sessions[0].requests
        assert r.input_num_tokens // 64 == len(r.page_keys), (k, num_tokens)


def test_scaled_requests_share_n_pages_iff_they_shared_n_groups():
    base = tuple(range(1, 40))
    for cut in range(0, 40):
        a = _request(0, base, len(base) * 64)
        b = _request(1, base[:cut] + tuple(range(100, 100 + 39 - cut)), len(base) * 64)
        ra, rb = scale_workload(_workload(a, b), 0.25).sessions[0].requests
        assert common_prefix_pages(ra.page_keys, rb.page_keys) == cut // 4


@pytest.mark.parametrize("scale", [0.3, 0.0, 1.5, float("nan")])
def test_token_scale_must_be_one_over_an_integer(scale):
    with pytest.raises(ValueError, match="token scale"):
        pages_per_scaled_page(scale)
