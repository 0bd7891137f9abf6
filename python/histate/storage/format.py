"""On-disk object format: one file per key = header block(s) + zero-padded payload.

Layout (little-endian), version 1::

    [0, header_bytes)       header, zero-padded to a multiple of ALIGN_BYTES
        magic "HSTSTORE" | u16 version | u16 flags (low 4 bits: payload checksum algorithm)
        | u32 header_bytes | u64 payload_bytes | u32 chunk_bytes | u32 num_chunks | u16 key_len
        | u16 dtype_len | u16 ndim | u16 reserved | key (UTF-8) | dtype name (ASCII) | shape (ndim x u64)
        | checksum of every payload chunk (u32 each) | u32 CRC32 of all header bytes before it
    [header_bytes, +padded) payload, zero-padded to a multiple of ALIGN_BYTES

Why this shape: both regions are block aligned so the same file can be read and written with O_DIRECT
by NIXL and by plain pread/pwrite; the payload checksum is a list of per-chunk checksums (not one) so
each chunk can be verified as soon as its I/O lands and on several threads, overlapping checksum work
with the disk; the key is stored so a file can never be served under the wrong name (hashed file
names, renamed files). Payload checksums are the low 32 bits of XXH3-64 (xxhash, ~4x faster than
zlib's CRC-32 and GIL-free) when xxhash is installed, CRC-32 otherwise; the header says which.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import cached_property

try:
    import xxhash
except ImportError:  # the storage extra installs it; CRC-32 keeps the store working without it
    xxhash = None

MAGIC = b"HSTSTORE"
FORMAT_VERSION = 1
ALIGN_BYTES = 4096  # O_DIRECT alignment of buffer address, file offset and length (safe for 512e/4Kn)
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_KEY_BYTES = 1024
MAX_NDIM = 32
CHECKSUM_CRC32 = 0  # zlib CRC-32
CHECKSUM_XXH3 = 1  # low 32 bits of XXH3-64
CHECKSUM_NAMES = {"crc32": CHECKSUM_CRC32, "xxh3": CHECKSUM_XXH3}
DEFAULT_CHECKSUM = CHECKSUM_XXH3 if xxhash is not None else CHECKSUM_CRC32
_FLAG_CHECKSUM_MASK = 0xF

_FIXED = struct.Struct("<8sHHIQIIHHHH")  # 40 bytes
_CRC = struct.Struct("<I")


class FormatError(ValueError):
    """A header that is not a valid version-1 header (torn, corrupt, foreign or future file)."""


def align_up(num_bytes: int, align_bytes: int = ALIGN_BYTES) -> int:
    return -(-num_bytes // align_bytes) * align_bytes


@dataclass(frozen=True)
class Header:
    key: str
    payload_bytes: int
    dtype_name: str  # numpy dtype.str ("<f4") or a foreign name such as "torch.bfloat16"
    shape: tuple[int, ...]
    chunk_bytes: int
    chunk_checksums: tuple[int, ...]
    checksum_algo: int = CHECKSUM_CRC32

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_checksums)

    @cached_property  # frozen dataclass: cached in the instance __dict__, not a field
    def header_bytes(self) -> int:
        return header_bytes_for(self.key, self.dtype_name, len(self.shape), self.num_chunks)

    @cached_property
    def file_bytes(self) -> int:
        return self.header_bytes + align_up(self.payload_bytes)


def num_chunks_for(payload_bytes: int, chunk_bytes: int) -> int:
    return -(-payload_bytes // chunk_bytes)


def header_bytes_for(key: str, dtype_name: str, ndim: int, num_chunks: int) -> int:
    raw = _FIXED.size + len(key.encode()) + len(dtype_name.encode()) + 8 * ndim + 4 * num_chunks + 4
    return align_up(raw)


def file_bytes_for(key: str, dtype_name: str, ndim: int, payload_bytes: int, chunk_bytes: int) -> int:
    """Bytes a file will occupy (capacity accounting happens before the payload is checksummed)."""
    n = num_chunks_for(payload_bytes, chunk_bytes)
    return header_bytes_for(key, dtype_name, ndim, n) + align_up(payload_bytes)


def chunk_checksum(chunk, algo: int) -> int:
    """32-bit checksum of one payload chunk with the file's algorithm."""
    if algo == CHECKSUM_XXH3:
        if xxhash is None:
            raise FormatError("file uses XXH3 checksums but xxhash is not installed (pip install xxhash)")
        return xxhash.xxh3_64_intdigest(chunk) & 0xFFFFFFFF
    return zlib.crc32(chunk)


def encode_header(header: Header) -> bytes:
    """Serialize, zero-padded to exactly `header.header_bytes`."""
    key_b = header.key.encode()
    dtype_b = header.dtype_name.encode("ascii")
    if len(key_b) > MAX_KEY_BYTES or len(header.shape) > MAX_NDIM:
        raise FormatError(f"key of {len(key_b)} bytes or ndim {len(header.shape)} out of range")
    if header.checksum_algo not in CHECKSUM_NAMES.values():
        raise FormatError(f"unknown checksum algorithm {header.checksum_algo}")
    if header.num_chunks != num_chunks_for(header.payload_bytes, header.chunk_bytes):
        raise FormatError(f"{header.num_chunks} chunk CRCs for {header.payload_bytes} bytes")
    size = header.header_bytes
    body = b"".join((
        _FIXED.pack(MAGIC, FORMAT_VERSION, header.checksum_algo, size, header.payload_bytes, header.chunk_bytes,
                    header.num_chunks, len(key_b), len(dtype_b), len(header.shape), 0),
        key_b,
        dtype_b,
        struct.pack(f"<{len(header.shape)}Q", *header.shape),
        struct.pack(f"<{header.num_chunks}I", *header.chunk_checksums),
    ))
    body += _CRC.pack(zlib.crc32(body))
    return body + bytes(size - len(body))


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


def decode_header(buf) -> Header:
    """Parse and validate a full header; raises FormatError on any inconsistency."""
    buf = memoryview(buf).cast("B")
    header_bytes = header_bytes_from_prefix(buf)
    if len(buf) < header_bytes:
        raise FormatError(f"header needs {header_bytes} bytes, got {len(buf)}")
    (_m, _v, flags, _hb, payload_bytes, chunk_bytes, num_chunks,
     key_len, dtype_len, ndim, _r) = _FIXED.unpack_from(buf)
    end = _FIXED.size + key_len + dtype_len + 8 * ndim + 4 * num_chunks
    if end + 4 > header_bytes or ndim > MAX_NDIM or key_len > MAX_KEY_BYTES:
        raise FormatError("header fields overflow the header block")
    (stored_crc,) = _CRC.unpack_from(buf, end)
    if zlib.crc32(buf[:end]) != stored_crc:
        raise FormatError("header checksum mismatch")
    algo = flags & _FLAG_CHECKSUM_MASK
    if flags & ~_FLAG_CHECKSUM_MASK or algo not in CHECKSUM_NAMES.values():
        raise FormatError(f"unknown flags {flags:#x}")
    if chunk_bytes <= 0 or num_chunks != num_chunks_for(payload_bytes, chunk_bytes):
        raise FormatError(f"{num_chunks} chunks of {chunk_bytes} bytes cannot hold {payload_bytes} bytes")
    pos = _FIXED.size
    try:
        key = bytes(buf[pos: pos + key_len]).decode()
        dtype_name = bytes(buf[pos + key_len: pos + key_len + dtype_len]).decode("ascii")
    except UnicodeDecodeError as exc:
        raise FormatError(f"undecodable key or dtype: {exc}") from None
    pos += key_len + dtype_len
    shape = struct.unpack_from(f"<{ndim}Q", buf, pos)
    pos += 8 * ndim
    sums = struct.unpack_from(f"<{num_chunks}I", buf, pos)
    header = Header(key, payload_bytes, dtype_name, tuple(shape), chunk_bytes, tuple(sums), algo)
    if header.header_bytes != header_bytes:
        raise FormatError(f"header length field {header_bytes} != computed {header.header_bytes}")
    return header
