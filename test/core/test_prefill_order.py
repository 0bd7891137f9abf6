"""The short-prefill-first chunk limit with aging (core/prefill_order.py), expectations by hand."""
import pytest

from histate.core import DEFAULT_MAX_YIELDS, ShortPrefillFirst, Tier, prefill_work_tokens

RULE = ShortPrefillFirst(max_yields=2)


def test_reserves_the_leading_run_of_shorts_in_whole_pages():
    # budget 8192, pages of 64: shorts of 100 and 300 tokens take 128 + 320 = 448 tokens;
    # the long one (50,000 left) keeps 8192 - 448 = 7744.
    assert RULE.chunk_limit(50_000, [100, 300], 8192, 64, 0) == 7744


def test_stops_at_the_first_request_that_is_not_short():
    # 9000 > one pass's budget: not short; the 10 behind it gets nothing reserved (SGLang's break).
    assert RULE.chunk_limit(50_000, [100, 9000, 10], 8192, 64, 0) == 8192 - 128
    assert RULE.chunk_limit(50_000, [9000, 10], 8192, 64, 0) is None


def test_a_request_longer_than_what_the_long_one_has_left_is_not_short():
    assert RULE.chunk_limit(500, [600], 8192, 64, 0) is None
    assert RULE.chunk_limit(500, [499], 8192, 64, 0) is None  # 8192 - 512 >= 500 left: no real cap


def test_short_max_tokens_bounds_what_is_short():
    rule = ShortPrefillFirst(max_yields=2, short_max_tokens=256)
    assert rule.chunk_limit(50_000, [256, 257, 1], 8192, 64, 0) == 8192 - 256


def test_leaves_the_long_request_at_least_a_page():
    # 8 pages of budget: shorts may reserve at most 7 pages (448); the third 192-token short does not fit.
    assert RULE.chunk_limit(50_000, [192, 192, 192], 512, 64, 0) == 512 - 384


def test_ages_out_after_max_yields_capped_passes():
    counts, limits = 0, []
    for _ in range(6):
        limit = RULE.chunk_limit(50_000, [100], 8192, 64, counts)
        limits.append(limit)
        counts = RULE.next_yields(counts, limit is not None)
    # yields on 2 passes, runs one uncapped, yields on 2 again ...
    assert limits == [8064, 8064, None, 8064, 8064, None]  # 100 tokens = 2 pages


def test_zero_max_yields_never_caps_and_bad_arguments_are_refused():
    assert ShortPrefillFirst(max_yields=0).chunk_limit(50_000, [100], 8192, 64, 0) is None
    assert RULE.chunk_limit(50_000, [100], 100, 64, 0) is None  # under two pages of budget
    with pytest.raises(ValueError):
        ShortPrefillFirst(max_yields=-1)
    with pytest.raises(ValueError):
        RULE.chunk_limit(50_000, [100], 8192, 0, 0)
    assert DEFAULT_MAX_YIELDS >= 1


def test_work_counts_restores_below_the_gpu_in_recompute_tokens():
    # 1000 tokens from CPU at 0.0134 and 2000 from SSD at 0.186 recompute-tokens each, 64 to compute.
    assert prefill_work_tokens(64, {Tier.CPU: 1000, Tier.SSD: 2000}) == pytest.approx(64 + 13.4 + 372)
    assert prefill_work_tokens(0) == 1  # a full hit still computes its last token
    assert prefill_work_tokens(10, {Tier.GPU: 10_000}) == 10


def test_min_tokens_keeps_a_cap_the_grid_floor_cannot_empty():
    # pages of 1: shorts of 100 and 150 leave 1000 - 250 = 750; a 16-token budget left would be raised to
    # one 64-token grid, and a long request with no more than that left is not capped at all.
    assert RULE.chunk_limit(5000, [100, 150], 1000, 1, 0, min_tokens=64) == 750
    assert RULE.chunk_limit(5000, [500, 484], 1000, 1, 0) == 16
    assert RULE.chunk_limit(5000, [500, 484], 1000, 1, 0, min_tokens=64) == 64
    assert RULE.chunk_limit(64, [30], 100, 1, 0, min_tokens=64) is None
