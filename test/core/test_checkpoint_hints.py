"""Application-placed checkpoints in the core (docs/hints.md), and the split a match makes inside a node.

Expectations are computed here from how each stream is built: a hint at an odd page far from the
prompt's end is a position eq. 5's grid (even page counts from the segment start) and the learned
priors (near the end, or a depth bin's first page) cannot plan on a fresh cache, which each test checks
first, so a hint that is dropped fails it.
"""
from __future__ import annotations

from histate.core import CacheConfig, Tier, make_cache

PAGE_TOKENS = 64


def _cache(policy: str = "histate"):
    config = CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=8 * PAGE_TOKENS,
                         capacity_bytes={Tier.GPU: 10_000 * PAGE_TOKENS, Tier.CPU: 10_000 * PAGE_TOKENS,
                                         Tier.SSD: 10_000 * PAGE_TOKENS})
    return make_cache(policy, config)


def _keys(tag: str, n: int) -> list:
    return [(tag, i) for i in range(n)]


HINT = 21  # odd, 41 pages before the end of a 62-page prompt


def test_a_named_position_joins_the_plan_and_a_later_prompt_resumes_there():
    cache = _cache()
    prompt = _keys("a", 62)
    plain = cache.plan_checkpoints(cache.begin_request(_keys("x", 62), 0.0))
    assert HINT not in plain  # the precondition: the policy's own rule does not plan it
    lease = cache.begin_request(prompt, 1.0, hint_pages=(HINT,))
    plan = cache.plan_checkpoints(lease)
    assert HINT in plan and set(plain) <= set(plan) | {HINT}
    cache.finish_request(lease, prompt, 2.0, plan)
    # a prompt sharing exactly the first HINT pages resumes at the named state
    second = cache.begin_request(prompt[:HINT] + _keys("b", 10), 3.0)
    assert (second.match.num_kv_pages, second.match.num_reused_pages) == (HINT, HINT)
    cache.check_invariants()


def test_named_positions_outside_the_computed_segment_are_not_planned():
    cache = _cache()
    prompt = _keys("a", 62)
    first = cache.begin_request(prompt, 0.0)
    cache.finish_request(first, prompt, 1.0, cache.plan_checkpoints(first))
    resumed = cache.begin_request(prompt + _keys("b", 30), 2.0, hint_pages=(HINT, 62, 62 + 31, 62 + 30 + 5))
    c = resumed.match.num_reused_pages
    assert c == 62  # the terminal state of the first prompt
    plan = cache.plan_checkpoints(resumed)
    assert all(c < p <= 92 for p in plan)
    assert 62 + 31 not in plan and 62 + 35 not in plan  # past the prompt
    cache.abort_request(resumed)


def test_policies_without_the_api_ignore_named_positions():
    for policy in ("vllm-disk", "sglang-hicache", "marconi"):
        cache = _cache(policy)
        plain = cache.plan_checkpoints(cache.begin_request(_keys("a", 62), 0.0))
        hinted = cache.plan_checkpoints(cache.begin_request(_keys("b", 62), 0.0, hint_pages=(HINT,)))
        assert hinted == plain, policy


def test_every_histate_variant_takes_named_positions():
    for policy in ("histate", "histate-no-detector", "histate-paper", "histate-lru-disk"):
        cache = _cache(policy)
        assert HINT in cache.plan_checkpoints(cache.begin_request(_keys("a", 62), 0.0, hint_pages=(HINT,))), policy


def test_a_match_ending_inside_a_node_splits_it_and_leaves_the_rest_as_it_was():
    """SGLang's match splits the node where a match ends inside it and pins the matched prefix; the rest
    keeps its own access time and stays evictable. Refreshing the whole node made the rest look
    recently used (the plugin/simulator differential test's learned priors diverged on it)."""
    cache = _cache("histate")
    prompt = _keys("a", 40)
    first = cache.begin_request(prompt, 0.0)
    cache.finish_request(first, prompt, 1.0, [40])  # KV is kept up to the deepest state (SGLang's insert)
    (node,) = cache.tree.root.children.values()
    assert node.depth_pages == 40 and node.kv_access_s == 1.0
    lease = cache.begin_request(prompt[:25] + _keys("b", 5), 7.0)
    assert lease.match.num_kv_pages == 25
    (head,) = cache.tree.root.children.values()
    (rest,) = head.children.values()
    assert (head.depth_pages, rest.depth_pages) == (25, 40)
    assert head.kv_access_s == 7.0 and rest.kv_access_s == 1.0
    assert head.lock_count == 1 and rest.lock_count == 0
    cache.check_invariants()
    cache.abort_request(lease)
    cache.check_invariants()
