"""Where things live inside a store root: key validation, file names, fan-out, and the naming scheme.

A single object lives at ``<root>/<fanout>/<encoded key>.hs`` and a pack of several items at
``<root>/<fanout>/<seq as 16 hex digits>.hsp``; `fanout` is one of 256 two-hex-digit directories.
Key encoding keeps ``[A-Za-z0-9_-]`` and percent-encodes every other UTF-8 byte (``.``, ``/``, ``%``,
NUL included), so a name never contains a separator, never starts with a dot and never escapes its
directory; keys whose encoding would exceed the file-name limit get a SHA-256 name (the key stored in
the header disambiguates). Temp files share the final file's directory (rename stays atomic) and are
named ``<stem>.tmp-<root id>-<pid>-<n>`` (the root id as 16 hex digits: the proof that the store made
the file in this root, ownership.py). The scheme is exact (`classify_name`): the store reads, indexes
or removes only names it matches, and only inside fan-out directories of a root it owns.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re
import zlib
from dataclasses import dataclass

from histate.storage.format import MAX_KEY_BYTES

OBJECT_SUFFIX = ".hs"
PACK_SUFFIX = ".hsp"
TEMP_MARKER = ".tmp-"
FANOUT_DIRS = 256
_MAX_ENCODED_CHARS = 200  # under NAME_MAX (255) with suffixes: a temp name adds 5 + 16 + 2 + pid + counter
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_ALL_SAFE = re.compile(r"[A-Za-z0-9_-]+", re.ASCII)
_OBJECT_STEM = r"(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+|~[0-9a-f]{64}"
_PACK_STEM = r"[0-9a-f]{16}"
_NAME_KINDS = (
    ("object", re.compile(rf"(?:{_OBJECT_STEM}){re.escape(OBJECT_SUFFIX)}")),
    ("pack", re.compile(rf"{_PACK_STEM}{re.escape(PACK_SUFFIX)}")),
    ("temp", re.compile(rf"(?:{_OBJECT_STEM}){re.escape(TEMP_MARKER)}[0-9a-f]{{16}}-[0-9]+-[0-9]+")),
)
_TEMP_ROOT_ID = re.compile(rf"{re.escape(TEMP_MARKER)}([0-9a-f]{{16}})-[0-9]+-[0-9]+$")
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
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
    if len(key) <= _MAX_ENCODED_CHARS and _ALL_SAFE.fullmatch(key):  # the common case, without a per-byte loop
        return key
    raw = key.encode()
    out = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(out) > _MAX_ENCODED_CHARS:
        out = "~" + hashlib.sha256(raw).hexdigest()
    return out


def pack_stem(seq: int) -> str:
    return f"{seq:016x}"


def classify_name(name: str) -> str | None:
    """'object' | 'pack' | 'temp' for names of the store's scheme, None for anything else."""
    for kind, pattern in _NAME_KINDS:
        if pattern.fullmatch(name):
            return kind
    return None


def temp_root_id(name: str) -> int | None:
    """The root id a temp file's name carries (None for any other name)."""
    found = _TEMP_ROOT_ID.search(name)
    return int(found.group(1), 16) if found else None


def is_fanout_name(name: str) -> bool:
    return _FANOUT_NAME.fullmatch(name) is not None


@dataclass(frozen=True)
class Location:
    """A file of the store: root index, fan-out directory name, file name (all relative)."""

    root: int
    fanout: str
    name: str

    def temp(self, root_id: int) -> "Location":
        """A fresh temp name next to this one, carrying the id of its root (pid + counter: unique
        within the directory)."""
        stem = self.name.rsplit(".", 1)[0]
        return Location(self.root, self.fanout,
                        f"{stem}{TEMP_MARKER}{root_id:016x}-{os.getpid()}-{next(_temp_counter)}")


class Layout:
    """Maps keys (and pack sequence numbers) to locations under one or more roots."""

    def __init__(self, roots: list[str]):
        if not roots:
            raise ValueError("at least one storage directory is required")
        self.roots = [os.path.abspath(r) for r in roots]

    def object_location(self, key: str) -> Location:
        h = zlib.crc32(key.encode())
        return Location((h >> 8) % len(self.roots), f"{h & (FANOUT_DIRS - 1):02x}", encode_key(key) + OBJECT_SUFFIX)

    def pack_location(self, seq: int) -> Location:
        h = zlib.crc32(seq.to_bytes(8, "little"))
        return Location(seq % len(self.roots), f"{h & (FANOUT_DIRS - 1):02x}", pack_stem(seq) + PACK_SUFFIX)

    def path(self, loc: Location) -> str:
        return os.path.join(self.roots[loc.root], loc.fanout, loc.name)

    def final_path(self, key: str) -> str:
        """Path of `key` stored as a single object (where `put` writes it)."""
        return self.path(self.object_location(key))

    def dir_for(self, key: str) -> str:
        return os.path.dirname(self.final_path(key))
