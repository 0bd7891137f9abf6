"""Prefix-chained page keys: key_i = H(key_{i-1} || tokens of page i).

Each key identifies its page *and everything before it*, as SGLang's page hashes and Mooncake's
hash_ids do, so a key is a globally unique name for one page of KV and for the checkpoint that ends
there -- the executor stores both under it in every tier, and the SSD object name derives from it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PageKey = bytes
_ROOT = b"histate-reference-v1"


def page_keys(token_ids: Sequence[int], page_num_tokens: int) -> list[PageKey]:
    """One 16-byte key per *full* page of `token_ids` (a trailing partial page gets none)."""
    keys, prev = [], _ROOT
    for start in range(0, len(token_ids) - page_num_tokens + 1, page_num_tokens):
        page = array("q", token_ids[start : start + page_num_tokens]).tobytes()
        prev = hashlib.blake2b(prev + page, digest_size=16).digest()
        keys.append(prev)
    return keys


def key_name(key: PageKey) -> str:
    """Printable name of a key (SSD object names, error messages)."""
    return key.hex()
