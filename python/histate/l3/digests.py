"""BLAKE2b-128 digests beside SGLang's own Mooncake objects, so same-size garbage is a miss.

The SGLang plugin's L3 objects are stock SGLang's (`{prefix}_{page_hash}_{rank}_k` / `_v`, `_temporal`,
`_conv_i`, sglang_plugin/l3_tier.py): their bytes cannot carry a checksum without breaking stock
interop, and a same-size wrong object (a bit flip, a foreign writer of the same key) reads as a valid
page. So HiState writes, after each object it puts, a 16-byte digest object under
`digest_key(object key)`, a key stock SGLang never builds or reads, and checks every object it reads
against it:

  * digest present, equal   -> the page is used;
  * digest present, differs -> a miss (counted `l3_digest_mismatches`);
  * digest absent           -> the object was written by a stock server (or its digest was evicted):
                               used unverified (`l3_unverified`), unless `require` is set -- for a
                               fleet of HiState servers only, where an absent digest is a miss.

The digest is of the bytes as they sit in the host pool (what the object holds: MooncakeStore copies
the pool's memory zero-copy, mooncake_store.py `_get_batch_zero_copy_impl`, `batch_set_v1`).
"""
from __future__ import annotations

import ctypes
import hashlib
from typing import Any, List, Sequence

DIGEST_SUFFIX = "__histate_b2b128"
DIGEST_SIZE_BYTES = 16


def digest_key(object_key: str) -> str:
    return object_key + DIGEST_SUFFIX


def _spans(ptr: Any, size: Any) -> list:
    """(address, bytes) pieces of one object: MooncakeStore passes an int or, for multi-buffer
    layouts, lists of them (`_uses_multi_buffer`)."""
    if isinstance(ptr, (list, tuple)):
        return list(zip(ptr, size))
    return [(ptr, size)]


def memory_digest(ptr: Any, size: Any) -> bytes:
    """BLAKE2b-128 of the object's bytes in host memory."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE_BYTES)
    for address, num_bytes in _spans(ptr, size):
        h.update(ctypes.string_at(int(address), int(num_bytes)))
    return h.digest()


def put_digests(raw_store: Any, objects: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any],
                written: Sequence[bool]) -> int:
    """Write the digest of every written object (upsert: a digest is rewritten with its object's bytes).
    Returns how many digests were stored; a failed one only makes its object unverified."""
    stored = 0
    for key, ptr, size, ok in zip(objects, ptrs, sizes, written):
        if ok:
            try:
                stored += raw_store.upsert(digest_key(key), memory_digest(ptr, size)) == 0
            except Exception:
                pass
    return stored


def verify(raw_store: Any, objects: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[Any],
           loaded: Sequence[bool], require: bool) -> tuple:
    """(per-object verdicts, mismatches, unverified) for objects just read into `ptrs`: an object that
    was not loaded stays False; one whose digest differs (or is absent, with `require`) becomes False.
    A digest that cannot be read, or is not 16 bytes, counts as differing: only a clean absence may
    pass unverified."""
    verdicts: List[bool] = list(loaded)
    wanted = [i for i, ok in enumerate(verdicts) if ok]
    if not wanted:
        return verdicts, 0, 0
    try:
        blobs = list(raw_store.get_batch([digest_key(objects[i]) for i in wanted]))
    except Exception:
        blobs = [b"?"] * len(wanted)
    mismatches = unverified = 0
    for i, blob in zip(wanted, blobs):
        if not blob:
            unverified += 1
            verdicts[i] = not require
        elif bytes(blob) != memory_digest(ptrs[i], sizes[i]):
            mismatches += 1
            verdicts[i] = False
    return verdicts, mismatches, unverified
