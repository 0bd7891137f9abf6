"""Eq. 7, H = t_last + tau * C / M, on small hand-built trees, every expected number worked out by hand.

Why this file exists: the eviction-order oracle (test_eviction_order.py) checks the heaps against the
same `score` function it guards, and the golden counts are regenerated from the code they check, so a
wrong eq. 7 (e.g. one without its `/M`) passed every other behavioural test. Here the expectations are
literals derived in the comments from the paper's definitions (docs/policies.md, "Cost terms of eq. 7
as implemented"), never computed by the code under test.

Sizes are chosen so the arithmetic stays exact: a page is 64 tokens of 1 byte, a checkpoint is 64
bytes, so N_s = 64 tokens (M of a checkpoint). tau = 60 s (the default).
"""
import pytest

from histate.core import CacheConfig, CacheObserver, PolicyState, Tier, UnitKind, make_cache

from .helpers import serve

PAGE_TOKENS = 64
TAU_S = 60.0


def config(gpu_pages: int, terminal_prob: float, **kw) -> CacheConfig:
    """1 byte per KV token, one checkpoint = 64 bytes = one page of KV (N_s = 64 tokens)."""
    capacity = {Tier.GPU: gpu_pages * PAGE_TOKENS, **kw.pop("capacity", {})}
    return CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=PAGE_TOKENS,
                       capacity_bytes=capacity, tau_s=TAU_S, initial_terminal_hit_prob=terminal_prob, **kw)


def node_at(cache, keys):
    """The node whose edge ends exactly after `keys`."""
    path, matched, _ = cache.tree.walk(list(keys))
    assert matched == len(keys) and path[-1].depth_pages == len(keys)
    return path[-1]


X = [("x", i) for i in range(3)]  # one request, terminal checkpoint at page 3
Y = [("y", i) for i in range(4)]  # one request, checkpoints at pages 2 and 4


def two_sessions(cfg):
    """At t = 0: X (3 pages, checkpoint at 3) and Y (4 pages, checkpoints at 2 and 4). Disjoint keys:
    no match, so q keeps its prior and no near-end mass is learned."""
    cache = make_cache("histate", cfg)
    serve(cache, X, 0.0, [3])
    serve(cache, Y, 0.0, [2, 4])
    return cache


def score(cache, keys, unit, tier=Tier.GPU):
    return cache.evictor.state.score(node_at(cache, keys), unit, 1 << tier)


def test_eq7_scores_of_bundles_and_an_interior_checkpoint_by_hand():
    """GPU only (every eviction drops: C is the paper's recompute), q = 0.5.

    X bundle (leaf KV of 3 pages + its terminal checkpoint): C = q * gap = 0.5 * 3 * 64 = 96 tokens,
      M = 3 * 64 + 64 = 256 tokens, H = 0 + 60 * 96 / 256 = 22.5.
    Y leaf bundle at 4 (gap 2 back to the checkpoint at 2): C = 0.5 * 2 * 64 = 64, M = 2 * 64 + 64 = 192,
      H = 60 * 64 / 192 = 20.
    Y checkpoint at 2 (interior): C = (1 - q) * gap * span / D = 0.5 * (2 * 64) * 2 / 4 = 32 tokens
      (span: 2 pages below it to the next checkpoint, D = 2 + 2 the trajectory), M = 64,
      H = 60 * 32 / 64 = 30.
    """
    cache = two_sessions(config(gpu_pages=100, terminal_prob=0.5))
    assert score(cache, X, UnitKind.BUNDLE) == pytest.approx(22.5)
    assert score(cache, Y, UnitKind.BUNDLE) == pytest.approx(20.0)
    assert score(cache, Y[:2], UnitKind.CHECKPOINT) == pytest.approx(30.0)


def test_eq7_with_the_default_prior_and_a_recency_offset():
    """q = 0.9 (the default prior), requests at t = 100 s, checkpoint = 256 bytes (N_s = 256 tokens).

    One request of 10 pages with checkpoints at 4 and 10:
      leaf bundle at 10: C = 0.9 * 6 * 64 = 345.6, M = 6 * 64 + 256 = 640, H = 100 + 60 * 345.6 / 640 = 132.4;
      checkpoint at 4: C = 0.1 * (4 * 64) * 6 / 10 = 15.36, M = 256, H = 100 + 60 * 15.36 / 256 = 103.6.
    """
    cfg = CacheConfig(page_num_tokens=PAGE_TOKENS, kv_bytes_per_token=1, checkpoint_size_bytes=256,
                      capacity_bytes={Tier.GPU: 100 * PAGE_TOKENS}, tau_s=TAU_S)
    cache = make_cache("histate", cfg)
    keys = [("k", i) for i in range(10)]
    serve(cache, keys, 100.0, [4, 10])
    assert score(cache, keys, UnitKind.BUNDLE) == pytest.approx(132.4)
    assert score(cache, keys[:4], UnitKind.CHECKPOINT) == pytest.approx(103.6)


def test_eq7_charges_a_demotion_its_transfer_per_byte():
    """GPU + CPU, restoring from the CPU costs 0.5 recompute-tokens per token of KV, q = 0.5. A bundle
    evicted from the GPU still has its KV on the CPU, so C = share of hits needing it * M * (0.5 - 0)
    and C / M is the share times 0.5, whatever the bundle's size:
      X bundle: share q = 0.5, C = 0.25 * 256 = 64 tokens, H = 60 * 64 / 256 = 15;
      Y bundle at 4: C = 0.25 * 192 = 48 tokens, H = 60 * 48 / 192 = 15 as well.
    Without the division by M the two would differ by their sizes (60 * 64 against 60 * 48). (Where a
    checkpoint leaving the GPU goes is a placement decision, not eq. 7's: not pinned here.)"""
    cfg = config(gpu_pages=100, terminal_prob=0.5, capacity={Tier.CPU: 100 * PAGE_TOKENS},
                 restore_cost_tokens={Tier.CPU: 0.5})
    cache = two_sessions(cfg)
    assert score(cache, X, UnitKind.BUNDLE) == pytest.approx(15.0)
    assert score(cache, Y, UnitKind.BUNDLE) == pytest.approx(15.0)


class FirstVictims(CacheObserver):
    """Records (depth, unit) of every unit the evictor takes, in order."""

    def __init__(self) -> None:
        self.taken = []

    def on_unit_evicted(self, node, unit, tier, now_s, terms) -> None:
        self.taken.append((node.depth_pages, unit))


def test_eviction_takes_the_lowest_hand_computed_eq7_score_not_the_lowest_cost():
    """The GPU holds exactly X and Y (10 pages: 7 of KV, 3 checkpoints); a new request of one page
    plus its checkpoint needs room. Hand-computed scores (first test): Y bundle 20 < X bundle 22.5 <
    Y checkpoint 30, so the Y bundle goes first -- although the Y checkpoint has the smallest C (32
    tokens against 64 and 96): only C / M ranks it last. Evicting the Y bundle frees 3 pages, enough."""
    cache = two_sessions(config(gpu_pages=10, terminal_prob=0.5))
    seen = FirstVictims()
    cache.observer = seen
    serve(cache, [("z", 0)], 1.0, [1])
    assert seen.taken == [(4, UnitKind.BUNDLE)]
    assert node_at(cache, Y[:2]).ckpt_mask and node_at(cache, X).kv_mask


def test_recency_outweighs_a_small_cost_per_byte(monkeypatch):
    """Same trees, but Y is used again at t = 40 (a terminal hit refreshes its path; learning frozen so
    q stays 0.5): the X bundle, H = 22.5, is now below every Y unit (each >= 40) and goes first."""
    monkeypatch.setattr(PolicyState, "observe_match", lambda self, *args: None)
    cache = two_sessions(config(gpu_pages=12, terminal_prob=0.5))
    assert serve(cache, Y, 40.0, []).num_reused_pages == 4
    seen = FirstVictims()
    cache.observer = seen
    serve(cache, [("z", 0), ("z", 1)], 41.0, [2])
    assert seen.taken[0] == (3, UnitKind.BUNDLE)
