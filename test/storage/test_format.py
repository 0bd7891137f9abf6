"""Header codec: exact round trips, and every corruption of the meaningful header bytes is rejected."""
import struct

import numpy as np
import pytest

from histate.storage.format import (ALIGN_BYTES, FormatError, Header, CHECKSUM_CRC32, CHECKSUM_XXH3, chunk_checksum, decode_header, encode_header,
                                    file_bytes_for, header_bytes_for, num_chunks_for)


def _header(payload_bytes=3 * (1 << 20) + 5, chunk_bytes=1 << 20, key="ckpt/α β", shape=(3, 7),
            algo=CHECKSUM_CRC32):
    data = np.arange(payload_bytes, dtype=np.uint64).astype(np.uint8)
    sums = tuple(chunk_checksum(data[i: i + chunk_bytes], algo) for i in range(0, payload_bytes, chunk_bytes))
    return Header(key, payload_bytes, "<f4", shape, chunk_bytes, sums, algo)


@pytest.mark.parametrize("algo", [CHECKSUM_CRC32, CHECKSUM_XXH3])
def test_round_trip_and_sizes(algo):
    if algo == CHECKSUM_XXH3:
        pytest.importorskip("xxhash")
    h = _header(algo=algo)
    raw = encode_header(h)
    assert len(raw) == h.header_bytes == ALIGN_BYTES
    assert decode_header(raw) == h
    assert h.num_chunks == 4
    assert h.file_bytes == ALIGN_BYTES + 3 * (1 << 20) + ALIGN_BYTES  # payload padded to the next block
    assert file_bytes_for(h.key, h.dtype_name, len(h.shape), h.payload_bytes, h.chunk_bytes) == h.file_bytes


def test_empty_payload_and_scalar_shape():
    h = Header("k", 0, "<f8", (), 1 << 20, ())
    assert decode_header(encode_header(h)) == h
    assert h.file_bytes == ALIGN_BYTES


def test_long_header_spans_several_blocks():
    h = _header(payload_bytes=2100 * 4096, chunk_bytes=4096)  # 2100 CRCs = 8400 bytes
    raw = encode_header(h)
    assert len(raw) == 3 * ALIGN_BYTES == header_bytes_for(h.key, "<f4", 2, 2100)
    assert decode_header(raw) == h


def test_every_single_byte_flip_in_the_used_header_is_detected():
    h = _header()
    raw = bytearray(encode_header(h))
    used = 40 + len(h.key.encode()) + 3 + 8 * 2 + 4 * h.num_chunks + 4
    for i in range(used):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(FormatError):
            decode_header(bytes(bad))


def test_truncated_zeroed_and_foreign_headers_are_rejected():
    raw = encode_header(_header())
    with pytest.raises(FormatError, match="too short"):
        decode_header(raw[:20])
    with pytest.raises(FormatError, match="magic"):
        decode_header(bytes(len(raw)))
    future = bytearray(raw)
    struct.pack_into("<H", future, 8, 2)
    with pytest.raises(FormatError, match="version 2"):
        decode_header(bytes(future))


def test_chunk_count_must_match_payload():
    h = _header()
    with pytest.raises(FormatError):
        encode_header(Header(h.key, h.payload_bytes, h.dtype_name, h.shape, h.chunk_bytes, h.chunk_checksums[:-1]))
    assert num_chunks_for(0, 4096) == 0 and num_chunks_for(4097, 4096) == 2


def test_unknown_flags_are_rejected():
    raw = bytearray(encode_header(_header()))
    struct.pack_into("<H", raw, 10, 0x0100)
    with pytest.raises(FormatError):
        decode_header(bytes(raw))


def test_checksums_differ_by_algorithm_and_detect_one_bit():
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    flipped = data.copy()
    flipped[12345] ^= 0x10
    for algo in (CHECKSUM_CRC32, CHECKSUM_XXH3):
        assert chunk_checksum(data, algo) != chunk_checksum(flipped, algo)
    assert chunk_checksum(data, CHECKSUM_XXH3) == xxhash.xxh3_64_intdigest(data.tobytes()) & 0xFFFFFFFF
