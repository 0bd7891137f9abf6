"""One PolicyState for a token-granular tree (SGLang's): scores and near-end evidence in tokens equal the
core's in pages.

The SGLang plugin scores SGLang's nodes, whose edges count tokens, with `PolicyState(...,
node_unit_tokens=1)` while admission stays in checkpoint-grid pages. Here every node of a core tree
with learned statistics is shown through a view that counts tokens (keys and depths x page); the
token-granular state must give each unit exactly the score the core gives it, and classify every hit
position the way the core does.
"""
import pytest

from histate.core import ConfigError, PolicyState, UnitKind, make_cache, make_policy
from histate.core.units import units_of

from .helpers import PAGE_TOKENS, serve, tiny_config


class TokenView:
    """A core node as an executor with a token-granular tree shows it (lengths in tokens)."""

    def __init__(self, node):
        self.node = node

    def __getattr__(self, name):
        return getattr(self.node, name)

    @property
    def parent(self):
        return None if self.node.parent is None else TokenView(self.node.parent)

    @property
    def children(self):
        return {k: TokenView(c) for k, c in self.node.children.items()}

    @property
    def keys(self):
        return range(len(self.node.keys) * PAGE_TOKENS)

    @property
    def depth_pages(self):
        return self.node.depth_pages * PAGE_TOKENS


def _trained_cache():
    """Sessions that append, rewrite their last page and fork: a tree with interior checkpoints,
    bundles and checkpoint-less branch points in three tiers."""
    cache = make_cache("histate", tiny_config(gpu_pages=120, cpu_pages=60, ssd_pages=400))
    now, ctx = 0.0, {s: [(s, "sys", i) for i in range(12)] for s in "abc"}
    for turn in range(14):
        for s in ctx:
            now += 1.0
            ctx[s] = ctx[s][:-1] + [(s, turn, i) for i in range(5)] if turn % 3 else ctx[s] + [(s, turn, 0)]
            serve(cache, ctx[s], now)
        if turn == 6:
            ctx["d"] = ctx["a"][:9] + [("d", 0, i) for i in range(7)]
    return cache


def test_token_granular_scores_equal_the_cores():
    cache = _trained_cache()
    pages = PolicyState(make_policy("histate"), cache.config)
    tokens = PolicyState(make_policy("histate"), cache.config, node_unit_tokens=1)
    for offset in (0, 1, 1, None, 0, 2, 1, 3, 0, 1, None, 1):  # the same evidence for both
        pages.observe_match(4, offset)
        tokens.observe_match(4, offset)
    assert tokens.near_end_probs == pages.near_end_probs and pages.near_end_probs[0] > 0.2
    scored = 0
    for node in cache.tree.iter_nodes():
        for unit, t in units_of(node, partitioned=False):
            bit = 1 << t
            assert tokens.score(TokenView(node), unit, bit) == pytest.approx(pages.score(node, unit, bit))
            scored += 1
    assert scored > 20 and {u for n in cache.tree.iter_nodes() for u, _ in units_of(n, False)} == set(UnitKind)


def test_token_granular_end_offsets_are_the_cores_pages():
    cache = make_cache("histate", tiny_config(gpu_pages=200))
    a = [("a", i) for i in range(20)]
    serve(cache, a, 1.0, checkpoint_pages=[10, 20])
    tokens = PolicyState(make_policy("histate"), cache.config, node_unit_tokens=1)
    (leaf,) = cache.tree.root.children.values()
    for match_pages in range(5, 21):
        expected = cache.match(a[:match_pages] + [("x", 0)]).end_offset_pages
        assert tokens.end_offset(TokenView(leaf), match_pages * PAGE_TOKENS) == expected
        assert cache.state.end_offset(leaf, match_pages) == expected
    # A hit inside a page counts from the page grid: 2 tokens past 18 pages is served by a checkpoint at
    # 18 pages, two pages before the end (20).
    assert tokens.end_offset(TokenView(leaf), 18 * PAGE_TOKENS + 2) == 2
    assert tokens.end_offset(TokenView(leaf), 19 * PAGE_TOKENS) == 1


def test_node_unit_must_divide_the_page():
    with pytest.raises(ConfigError, match="node_unit_tokens"):
        PolicyState(make_policy("histate"), tiny_config(gpu_pages=10), node_unit_tokens=48)
    assert PolicyState(make_policy("histate"), tiny_config(gpu_pages=10), node_unit_tokens=16).near_end_stride == 4
