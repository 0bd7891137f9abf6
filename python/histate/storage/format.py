"""On-disk file format (version 3): one header, then the payloads of one or more items.

A file holds one object (named by its key) or a pack of several (a batch of KV pages, named by its
sequence number). Layout, little-endian::

    [0, header_bytes)     header, zero-padded to a multiple of ALIGN_BYTES
        magic "HSTSTORE" | u16 version | u16 flags (low 4 bits: payload checksum algorithm)
        | u32 header_bytes | u64 seq | u32 chunk_bytes | u32 num_items | u64 root_id (at byte 32)
        | per item: u64 payload_bytes | u16 key_len | u16 dtype_len | u16 ndim | u16 reserved
        |           key (UTF-8) | dtype name (ASCII) | shape (ndim x u64) | u32 checksum per chunk
        | u32 CRC-32 of every header byte before it
        | liveness: one byte per item (LIVE, or anything else = deleted); not covered by the CRC
    then each item's payload in order, each starting block aligned and zero-padded to ALIGN_BYTES

Why this shape: every region is block aligned, so the same file is read and written with and without
O_DIRECT, by NIXL and by plain syscalls. Payload checksums are per chunk so each chunk is verified as
soon as its I/O lands, on several threads. Each chunk checksum is seeded with the item's key, the
file's sequence number and the chunk's index, so a page read alone from a pack (without its header)
can never be served under another key, from another version, or from another place. `seq` orders
writes: when two files hold the same key, the higher one is the later write. The liveness bytes let
one item of a pack be deleted durably (one byte written) while its neighbours stay; they sit outside
the CRC because they change after the file is published, and any value but LIVE reads as deleted, so
damage there can only turn a hit into a miss. `root_id` is the random id of the store root the file
was written in (its marker holds the same id, ownership.py): the proof that the store wrote the file,
which a copy of the marker in someone else's directory cannot give to their files. It sits at a fixed
offset so that it still reads when the rest of the header is damaged (`claimed_root_id`).
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

try:
    import xxhash
except ImportError:  # the storage extra installs it; CRC-32 keeps the store working without it
    xxhash = None

MAGIC = b"HSTSTORE"
FORMAT_VERSION = 3
ALIGN_BYTES = 4096  # O_DIRECT alignment of buffer address, file offset and length (safe for 512e/4Kn)
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_KEY_BYTES = 1024
MAX_NDIM = 32
MAX_ITEMS = 1 << 16
LIVE = 0x4C  # liveness byte of a stored item ('L'); zeros (a torn or never-written table) read as deleted
DEAD = 0x00
CHECKSUM_CRC32 = 0  # zlib CRC-32
CHECKSUM_XXH3 = 1  # low 32 bits of XXH3-64
CHECKSUM_NAMES = {"crc32": CHECKSUM_CRC32, "xxh3": CHECKSUM_XXH3}
DEFAULT_CHECKSUM = CHECKSUM_XXH3 if xxhash is not None else CHECKSUM_CRC32
_FLAG_CHECKSUM_MASK = 0xF

_FIXED = struct.Struct("<8sHHIQIIQ")  # 40 bytes
_ROOT_ID = struct.Struct("<Q")
ROOT_ID_OFFSET = 32  # where every version >= 3 keeps the root id
_ITEM = struct.Struct("<QHHHH")  # 16 bytes
_CRC = struct.Struct("<I")
_SHAPES = [struct.Struct(f"<{ndim}Q") for ndim in range(MAX_NDIM + 1)]


class FormatError(ValueError):
    """A header that is not a valid version-3 header (torn, corrupt, foreign, older or future file)."""


def align_up(num_bytes: int, align_bytes: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // align_bytes) * align_bytes


def num_chunks_for(payload_bytes: int, chunk_bytes: int) -> int:
    return -(-payload_bytes // chunk_bytes)


@dataclass(frozen=True, init=False)
class ItemSpec:
    """What the header needs to know about an item before its payload is checksummed."""

    key: str
    payload_bytes: int
    dtype_name: str  # numpy dtype.str ("<f4") or a foreign name such as "torch.bfloat16"
    shape: tuple[int, ...]

    def __init__(self, key: str, payload_bytes: int, dtype_name: str, shape: tuple[int, ...]):
        # what `record` could not encode fails here, when the caller builds the spec (loudly, at submit)
        if len(shape) > MAX_NDIM or not dtype_name.isascii() or len(key.encode()) > MAX_KEY_BYTES:
            raise FormatError(f"{key[:40]!r}: key over {MAX_KEY_BYTES} bytes, ndim {len(shape)} over "
                              f"{MAX_NDIM} or a non-ASCII dtype name {dtype_name!r}")
        # one spec per stored page: one dict update instead of the frozen dataclass's four
        # object.__setattr__ calls (0.4 instead of 1 us)
        self.__dict__.update(key=key, payload_bytes=payload_bytes, dtype_name=dtype_name, shape=shape)

    @property
    def record_bytes(self) -> int:
        """Length of `record`, without encoding it (sizing a file happens at submit, on the caller's
        thread; the record itself is built beside the payload's I/O)."""
        return _ITEM.size + len(self.key.encode()) + len(self.dtype_name) + 8 * len(self.shape)

    @cached_property  # frozen dataclass: cached in the instance __dict__, not a field
    def record(self) -> bytes:
        """The item's header record up to (not including) its chunk checksums."""
        key_b, dtype_b = self.key.encode(), self.dtype_name.encode("ascii")  # sizes checked in __init__
        return b"".join((_ITEM.pack(self.payload_bytes, len(key_b), len(dtype_b), len(self.shape), 0), key_b,
                         dtype_b, _SHAPES[len(self.shape)].pack(*self.shape)))


@dataclass(frozen=True)
class Item(ItemSpec):
    chunk_checksums: tuple[int, ...] = ()
    offset: int = 0  # file offset of the payload (block aligned), derived from the items before it

    @property
    def padded_bytes(self) -> int:
        return align_up(self.payload_bytes)


@dataclass(frozen=True)
class FileHeader:
    seq: int
    chunk_bytes: int
    checksum_algo: int
    items: tuple[Item, ...]
    root_id: int = 0  # the store root the file was written in (0: none; real ids are never 0)

    @cached_property
    def liveness_offset(self) -> int:
        return _body_bytes(self.items, self.chunk_bytes) + _CRC.size

    @cached_property
    def header_bytes(self) -> int:
        return align_up(self.liveness_offset + len(self.items))

    @cached_property
    def file_bytes(self) -> int:
        return self.header_bytes + sum(i.padded_bytes for i in self.items)

    @cached_property
    def item_seeds(self) -> tuple[int, ...]:
        """`item_seed` of every item (computed once per header: reads verify with them)."""
        return tuple(item_seed(i.key, self.seq) for i in self.items)

    @cached_property
    def body_crc(self) -> int:
        """The CRC-32 stored in this header's encoding (what `header_matches` compares)."""
        return _CRC.unpack_from(encode_header(self), self.liveness_offset - _CRC.size)[0]


def _body_bytes(items: Sequence[ItemSpec], chunk_bytes: int) -> int:
    return _FIXED.size + sum(i.record_bytes + 4 * num_chunks_for(i.payload_bytes, chunk_bytes) for i in items)


def header_bytes_for(items: Sequence[ItemSpec], chunk_bytes: int) -> int:
    return align_up(_body_bytes(items, chunk_bytes) + _CRC.size + len(items))


def file_bytes_for(items: Sequence[ItemSpec], chunk_bytes: int) -> int:
    """Bytes a file will occupy (capacity accounting happens before the payload is checksummed)."""
    return header_bytes_for(items, chunk_bytes) + sum(align_up(i.payload_bytes) for i in items)


def item_offsets(items: Sequence[ItemSpec], header_bytes: int) -> list[int]:
    offsets, pos = [], header_bytes
    for item in items:
        offsets.append(pos)
        pos += align_up(item.payload_bytes)
    return offsets


def item_seed(key: str, seq: int) -> int:
    """Per-item checksum seed: binds every chunk checksum to its key and to the file's write."""
    return zlib.crc32(seq.to_bytes(8, "little"), zlib.crc32(key.encode()))


def chunk_seed(item_seed_value: int, chunk_index: int) -> int:
    return (item_seed_value ^ (chunk_index * 0x9E3779B1)) & 0xFFFFFFFF


def chunk_checksum(chunk, algo: int, seed: int = 0) -> int:
    """32-bit checksum of one payload chunk with the file's algorithm."""
    if algo == CHECKSUM_XXH3:
        if xxhash is None:
            raise FormatError("file uses XXH3 checksums but xxhash is not installed (pip install xxhash)")
        return xxhash.xxh3_64_intdigest(chunk, seed) & 0xFFFFFFFF
    return zlib.crc32(chunk, seed)


def encode_header(header: FileHeader, live: Sequence[bool] | None = None) -> bytes:
    """Serialize, zero-padded to exactly `header.header_bytes`; every item live unless `live` says."""
    n = len(header.items)
    if not 1 <= n <= MAX_ITEMS:
        raise FormatError(f"{n} items per file (1..{MAX_ITEMS})")
    if header.checksum_algo not in CHECKSUM_NAMES.values():
        raise FormatError(f"unknown checksum algorithm {header.checksum_algo}")
    parts = [_FIXED.pack(MAGIC, FORMAT_VERSION, header.checksum_algo, header.header_bytes, header.seq,
                         header.chunk_bytes, n, header.root_id)]
    for item in header.items:
        if len(item.chunk_checksums) != num_chunks_for(item.payload_bytes, header.chunk_bytes):
            raise FormatError(f"{len(item.chunk_checksums)} checksums for {item.payload_bytes} bytes")
        parts += [item.record, struct.pack(f"<{len(item.chunk_checksums)}I", *item.chunk_checksums)]
    body = b"".join(parts)
    crc = zlib.crc32(body)
    header.__dict__["body_crc"] = crc  # cached_property storage: reads compare against it
    flags = bytes(LIVE if (live is None or live[i]) else DEAD for i in range(n))
    out = body + _CRC.pack(crc) + flags
    return out + bytes(header.header_bytes - len(out))


def header_bytes_from_prefix(prefix) -> int:
    """Total header length announced by the first block (to read the rest of a long header)."""
    if len(prefix) < _FIXED.size:
        raise FormatError(f"header prefix of {len(prefix)} bytes is too short")
    magic, version, _flags, header_bytes = _FIXED.unpack_from(prefix)[:4]
    if magic != MAGIC:
        raise FormatError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, this reader understands {FORMAT_VERSION}")
    if header_bytes < ALIGN_BYTES or header_bytes % ALIGN_BYTES:
        raise FormatError(f"header length {header_bytes} is not a positive multiple of {ALIGN_BYTES}")
    return header_bytes


def decode_header(buf) -> tuple[FileHeader, tuple[bool, ...]]:
    """Parse and validate a full header; returns it with each item's liveness. Raises FormatError."""
    buf = memoryview(buf).cast("B")
    header_bytes = header_bytes_from_prefix(buf)
    if len(buf) < header_bytes:
        raise FormatError(f"header needs {header_bytes} bytes, got {len(buf)}")
    _m, _v, flags, _hb, seq, chunk_bytes, n, root_id = _FIXED.unpack_from(buf)
    algo = flags & _FLAG_CHECKSUM_MASK
    if flags & ~_FLAG_CHECKSUM_MASK or algo not in CHECKSUM_NAMES.values():
        raise FormatError(f"unknown flags {flags:#x}")
    if chunk_bytes <= 0 or chunk_bytes % ALIGN_BYTES or not 1 <= n <= MAX_ITEMS:
        raise FormatError(f"chunk_bytes {chunk_bytes} / {n} items out of range")
    specs, pos = [], _FIXED.size
    for _ in range(n):
        if pos + _ITEM.size > header_bytes:
            raise FormatError("item records overflow the header")
        payload_bytes, key_len, dtype_len, ndim, _r = _ITEM.unpack_from(buf, pos)
        num_chunks = num_chunks_for(payload_bytes, chunk_bytes)
        end = pos + _ITEM.size + key_len + dtype_len + 8 * ndim + 4 * num_chunks
        if end > header_bytes or ndim > MAX_NDIM or key_len > MAX_KEY_BYTES:
            raise FormatError("item fields overflow the header")
        p = pos + _ITEM.size
        try:
            key = bytes(buf[p: p + key_len]).decode()
            dtype_name = bytes(buf[p + key_len: p + key_len + dtype_len]).decode("ascii")
        except UnicodeDecodeError as exc:
            raise FormatError(f"undecodable key or dtype: {exc}") from None
        p += key_len + dtype_len
        shape = struct.unpack_from(f"<{ndim}Q", buf, p)
        sums = struct.unpack_from(f"<{num_chunks}I", buf, p + 8 * ndim)
        specs.append((key, payload_bytes, dtype_name, tuple(shape), tuple(sums)))
        pos = end
    if pos + _CRC.size + n > header_bytes:
        raise FormatError("header checksum overflows the header")
    (stored_crc,) = _CRC.unpack_from(buf, pos)
    if zlib.crc32(buf[:pos]) != stored_crc:
        raise FormatError("header checksum mismatch")
    offsets = item_offsets([ItemSpec(k, b, d, s) for k, b, d, s, _ in specs], header_bytes)
    items = tuple(Item(k, b, d, s, sums, off) for (k, b, d, s, sums), off in zip(specs, offsets))
    header = FileHeader(seq, chunk_bytes, algo, items, root_id)
    if header.header_bytes != header_bytes:
        raise FormatError(f"header length field {header_bytes} != computed {header.header_bytes}")
    header.__dict__["body_crc"] = stored_crc  # cached_property storage
    live_at = pos + _CRC.size
    return header, tuple(b == LIVE for b in bytes(buf[live_at: live_at + n]))


def claimed_root_id(prefix) -> int | None:
    """The root id stored at ROOT_ID_OFFSET of a file's first bytes, read without any other check (the
    rest of the header may be damaged), or None when the file is too short. Equal to a root's own random
    64-bit id, it proves the store wrote the file there: nothing else carries that value by chance."""
    if len(prefix) < ROOT_ID_OFFSET + _ROOT_ID.size:
        return None
    return _ROOT_ID.unpack_from(prefix, ROOT_ID_OFFSET)[0]


def header_matches(buf, header: FileHeader) -> bool:
    """Whether `buf` holds `header`'s encoding, liveness bytes aside: its stored CRC is the one
    `header` was encoded with and it matches the bytes before it. A read of a single object uses this
    instead of decoding the header again (about 20x cheaper); together with the payload checksums,
    seeded with the key and the write's `seq`, it proves the file is the one that was indexed."""
    crc_at = header.liveness_offset - _CRC.size
    if len(buf) < crc_at + _CRC.size:
        return False
    (stored,) = _CRC.unpack_from(buf, crc_at)
    return stored == header.body_crc and zlib.crc32(memoryview(buf)[:crc_at]) == stored


def build_header(seq: int, chunk_bytes: int, algo: int, specs: Sequence[ItemSpec],
                 checksums: Sequence[Sequence[int]], root_id: int = 0) -> FileHeader:
    """The header of a file about to be completed in the root `root_id`: specs in file order with
    their chunk checksums."""
    records = [spec.record for spec in specs]
    liveness_offset = _FIXED.size + _CRC.size + sum(len(r) + 4 * len(c) for r, c in zip(records, checksums))
    header_bytes = align_up(liveness_offset + len(specs))
    offsets = item_offsets(specs, header_bytes)
    items = []
    for spec, record, sums, offset in zip(specs, records, checksums, offsets):
        # one Item per stored page: filled in one dict update, like ItemSpec.__init__ (the generated
        # frozen __init__ costs six object.__setattr__ calls); `record` is its cached_property's value
        item = object.__new__(Item)
        item.__dict__.update(key=spec.key, payload_bytes=spec.payload_bytes, dtype_name=spec.dtype_name,
                             shape=spec.shape, chunk_checksums=tuple(sums), offset=offset, record=record)
        items.append(item)
    header = FileHeader(seq, chunk_bytes, algo, tuple(items), root_id)
    header.__dict__.update(liveness_offset=liveness_offset, header_bytes=header_bytes)  # cached_property storage
    return header
