"""Where a key lives on disk: key validation, file-name encoding, directory fan-out, temp names.

Every key maps to exactly one final path ``<root>/<fanout>/<encoded>.hs``. Encoding keeps
``[A-Za-z0-9_-]`` and percent-encodes every other UTF-8 byte (``.``, ``/``, ``%``, NUL included), so a
name never contains a separator, never starts with a dot and never escapes its directory. Keys whose
encoding would exceed the file-name limit get a SHA-256 name instead; the key stored in the header
disambiguates. Temp files share the directory (rename stays atomic) and carry a ``.tmp-`` marker that
the index rebuild deletes on sight.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import zlib

from histate.storage.format import MAX_KEY_BYTES

FINAL_SUFFIX = ".hs"
TEMP_MARKER = ".tmp-"
LOCK_NAME = "LOCK"
FANOUT_DIRS = 256
_MAX_ENCODED_CHARS = 200  # well under NAME_MAX (255) with suffixes
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_temp_counter = itertools.count()


class InvalidKeyError(ValueError):
    """A key the store refuses (wrong type, empty, too long, NUL byte)."""


def validate_key(key: object) -> str:
    if not isinstance(key, str):
        raise InvalidKeyError(f"store keys are str, got {type(key).__name__}: {key!r:.80}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(f"key is not encodable as UTF-8 ({exc.reason}): {key!r:.80}") from None
    if not raw:
        raise InvalidKeyError("store keys must be non-empty")
    if len(raw) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"key of {len(raw)} UTF-8 bytes exceeds {MAX_KEY_BYTES}: {key[:40]!r}...")
    if b"\0" in raw:
        raise InvalidKeyError(f"key contains a NUL byte: {key!r:.80}")
    return key


def encode_key(key: str) -> str:
    """File-name stem for `key` (injective for short keys; hashed for long ones)."""
    raw = key.encode()
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > _MAX_ENCODED_CHARS:
        out = "~" + hashlib.sha256(raw).hexdigest()
    return out


def _key_hash(key: str) -> int:
    return zlib.crc32(key.encode())


class Layout:
    """Maps keys to paths under one or more root directories (spread by a stable key hash)."""

    def __init__(self, roots: list[str]):
        if not roots:
            raise ValueError("at least one storage directory is required")
        self.roots = [os.path.abspath(r) for r in roots]
        self._made: set[str] = set()

    def dir_for(self, key: str) -> str:
        h = _key_hash(key)
        root = self.roots[(h >> 8) % len(self.roots)]
        return os.path.join(root, f"{h & (FANOUT_DIRS - 1):02x}")

    def final_path(self, key: str) -> str:
        return os.path.join(self.dir_for(key), encode_key(key) + FINAL_SUFFIX)

    def temp_path(self, key: str) -> str:
        """A fresh temp name next to the final path (pid + counter: unique within the directory)."""
        stem = encode_key(key)
        return os.path.join(self.dir_for(key), f"{stem}{TEMP_MARKER}{os.getpid()}-{next(_temp_counter)}")

    def ensure_dir(self, path: str) -> None:
        d = os.path.dirname(path)
        if d not in self._made:
            os.makedirs(d, exist_ok=True)
            self._made.add(d)

    def is_expected_path(self, key: str, path: str) -> bool:
        return os.path.abspath(path) == self.final_path(key)


def is_temp_name(name: str) -> bool:
    return TEMP_MARKER in name


def is_final_name(name: str) -> bool:
    return name.endswith(FINAL_SUFFIX) and not is_temp_name(name)
