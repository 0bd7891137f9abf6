"""prefix_keys.py: the server's prefix keys for miss attribution.

The key of a prefix must not depend on how the tree cut it into nodes: a node's keys, computed from its
parent's memoized hash and its own tokens, equal the keys a request computes over its whole prompt. The
expectation is a plain Python polynomial hash, independent of the numpy code."""
from __future__ import annotations

import random
from types import SimpleNamespace

from histate.sglang_plugin import prefix_keys
from histate.sglang_plugin.core_nodes import core_of
from histate.sglang_plugin.prefix_keys import PrefixHasher

GRID = 16


def _reference(tokens: list, depth: int) -> int:
    return sum((t + 1) * pow(prefix_keys._BASE, j, 1 << 64) for j, t in enumerate(tokens[:depth])) % (1 << 64)


class _Key:
    def __init__(self, token_ids):
        self.token_ids = token_ids

    def __len__(self):
        return len(self.token_ids)


def _chain(tokens: list, cuts: list):
    """SGLang-shaped nodes root -> ... cut at `cuts` (token positions)."""
    root = SimpleNamespace(parent=None, key=None, children={})
    nodes, parent, start = [], root, 0
    for end in cuts + [len(tokens)]:
        node = SimpleNamespace(parent=parent, key=_Key(tokens[start:end]), children={})
        nodes.append(node)
        parent, start = node, end
    return nodes


def test_node_keys_equal_the_prompts_keys_however_the_tree_cuts_it():
    rng = random.Random(5)
    for _ in range(20):
        tokens = [rng.randrange(500) for _ in range(rng.randrange(1, 300))]
        cuts = sorted(rng.sample(range(1, len(tokens)), min(4, len(tokens) - 1))) if len(tokens) > 1 else []
        hasher = PrefixHasher()
        pages = len(tokens) // GRID
        want = [(g, _reference(tokens, g)) for g in range(GRID, pages * GRID + 1, GRID)]
        assert hasher.page_keys(tokens, GRID, pages) == want
        nodes = _chain(tokens, cuts)
        got = []
        for node in reversed(nodes):  # deepest first: the memo fills in from whichever is asked first
            got = hasher.node_page_keys(core_of(node), GRID) + got
        assert got == want
        assert all(hasher.key_at_end(core_of(n)) == (core_of(n).depth_pages, _reference(tokens, core_of(n).depth_pages))
                   for n in nodes)


def test_a_namespace_seeds_the_keys_so_two_tenants_never_share_one():
    """SGLang keeps one tree per (extra_key, cache_salt): equal tokens under another salt must not find
    this tenant's departures (miss_tracker.py reads them by key)."""
    from histate.sglang_plugin.prefix_keys import namespace_seed

    tokens = list(range(3 * GRID))
    hasher = PrefixHasher()
    plain = hasher.page_keys(tokens, GRID, 3)
    salted = hasher.page_keys(tokens, GRID, 3, namespace_seed(None, "tenant-b"))
    assert namespace_seed() == 0 and not set(plain) & set(salted)
    (node,) = _chain(tokens, [])
    node.key.cache_salt = "tenant-b"
    assert hasher.node_page_keys(core_of(node), GRID) == salted


def test_a_context_extends_the_prompts_keys_without_hashing_the_prompt_again():
    tokens = [7 * i % 500 for i in range(5 * GRID + 3)]
    hasher = PrefixHasher()
    whole = hasher.page_keys(tokens, GRID, 5)
    prompt = hasher.page_keys(tokens, GRID, 2)
    rest = hasher.page_keys(tokens[2 * GRID:], GRID, 5, prompt[-1][1], 2)
    assert prompt + rest == whole
