"""Keys that name a token prefix in the server, for miss attribution (core/misses.py).

The simulator names a prefix by its prefix-chained page key; SGLang's tree has no such key (its page
hashes exist only with HiCache storage on, and cost a SHA-256 per page). `--histate-miss-reasons` needs
one for each state-grid page end of a prompt (at match) and of a node that leaves (at eviction), so a
request can look up what happened to the pages it did not find. The key of the prefix of length d is
(d, H(d)) with H(d) = sum_{j<d} (t_j + 1) * B^j mod 2^64 for a fixed odd B: a polynomial hash, so
H(d2) = H(d1) + sum_{d1<=j<d2} (t_j + 1) * B^j and a node's keys follow from its parent's H and its
own tokens in one numpy pass. A node keeps H at its end once computed (`CoreNode.prefix_hash`): its
prefix never changes (SGLang splits cut an edge from the front, the child keeps its end), so the cost
is one pass over the tokens a key is asked for, not one per eviction of a deep node. A collision makes a
diagnosis wrong, never a cache decision: these keys feed only the attribution.

SGLang keeps one tree per namespace (a LoRA's `extra_key`, a tenant's `cache_salt`): H(0) is a seed
drawn from the namespace (`namespace_seed`), so equal tokens under two salts have different keys and one
tenant's departures never explain another's misses.
"""
from __future__ import annotations

import hashlib
from typing import Any, Optional, Sequence

import numpy as np

from .core_nodes import CoreNode, core_of

_BASE = 0x9E3779B97F4A7C15  # odd: B^j never reaches 0 mod 2^64


def namespace_seed(extra_key: Optional[str] = None, cache_salt: Optional[str] = None) -> int:
    """H(0) of a namespace: 0 for the default one, else 64 bits of BLAKE2b of (extra_key, cache_salt)."""
    if extra_key is None and cache_salt is None:
        return 0
    digest = hashlib.blake2b(repr((extra_key, cache_salt)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def key_seed(key: Any) -> int:
    """The namespace seed of an SGLang `RadixKey` (a node's edge or a request's match key)."""
    return namespace_seed(getattr(key, "extra_key", None), getattr(key, "cache_salt", None))


class PrefixHasher:
    """Powers of B, grown on demand (8 bytes per token of the longest prefix seen)."""

    def __init__(self) -> None:
        self._powers = np.ones(1, dtype=np.uint64)

    def _powers_from(self, start: int, count: int) -> np.ndarray:
        need = start + count
        if len(self._powers) < need:
            size = max(need, 2 * len(self._powers))
            grow = np.full(size - len(self._powers), _BASE, dtype=np.uint64)
            grow = np.cumprod(grow, dtype=np.uint64) * self._powers[-1]
            self._powers = np.concatenate([self._powers, grow])
        return self._powers[start:need]

    def prefix_hashes(self, start_hash: int, start: int, tokens: Sequence[int]) -> np.ndarray:
        """H(start + 1), ..., H(start + len(tokens)), given H(start) = `start_hash`."""
        if len(tokens) == 0:
            return np.zeros(0, dtype=np.uint64)
        terms = (np.asarray(tokens, dtype=np.uint64) + np.uint64(1)) * self._powers_from(start, len(tokens))
        return np.cumsum(terms, dtype=np.uint64) + np.uint64(start_hash)

    def page_keys(self, tokens: Sequence[int], grid_tokens: int, num_pages: int, seed: int = 0,
                  start_pages: int = 0) -> list:
        """Keys of grid page ends start_pages+1 .. num_pages of a prompt, [(g, H(g))], given `tokens` from
        token start_pages * G on and H there = `seed` (the namespace seed when starting at 0)."""
        start = start_pages * grid_tokens
        hashes = self.prefix_hashes(seed, start, tokens[:(num_pages - start_pages) * grid_tokens])
        return [(g, int(hashes[g - start - 1]))
                for g in range(start + grid_tokens, num_pages * grid_tokens + 1, grid_tokens)]

    def node_page_keys(self, node: CoreNode, grid_tokens: int) -> list:
        """Keys of the grid page ends inside `node`'s edge (start, end], and H at its end memoized."""
        end = node.depth_pages
        start = end - len(node.sg.key)
        seed = key_seed(node.sg.key)
        start_hash = self.end_hash(node.parent, seed) if node.sg.parent is not None else seed
        hashes = self.prefix_hashes(start_hash, start, _edge_tokens(node.sg))
        if len(hashes):
            node.prefix_hash = int(hashes[-1])
        first = (start // grid_tokens + 1) * grid_tokens
        return [(g, int(hashes[g - start - 1])) for g in range(first, end + 1, grid_tokens)]

    def end_hash(self, node: CoreNode, seed: Optional[int] = None) -> int:
        """H at `node`'s end (the namespace seed at the root: `seed`, else read off `node`'s own key),
        computing the missing ones on its path top down."""
        if seed is None:
            seed = key_seed(node.sg.key) if node.sg.parent is not None else 0
        pending = []
        while node.prefix_hash is None and node.sg.parent is not None:
            pending.append(node)
            node = core_of(node.sg.parent)
        value = seed if node.sg.parent is None else node.prefix_hash
        for n in reversed(pending):
            end = n.depth_pages
            tokens = _edge_tokens(n.sg)
            hashes = self.prefix_hashes(value, end - len(tokens), tokens)
            value = n.prefix_hash = int(hashes[-1]) if len(hashes) else value
        return value

    def key_at_end(self, node: CoreNode) -> tuple:
        """The key of the prefix through `node`'s end (where its checkpoint sits)."""
        return (node.depth_pages, self.end_hash(node))


def _edge_tokens(sg: Any) -> Any:
    key = sg.key
    return key.token_ids[:len(key)]
