"""Header codec: exact round trips, and every corruption of the meaningful header bytes is rejected."""
import struct

import numpy as np
import pytest

from histate.storage.format import (ALIGN_BYTES, CHECKSUM_CRC32, CHECKSUM_XXH3, DEAD, LIVE, FileHeader, FormatError,
                                    ItemSpec, build_header, chunk_checksum, chunk_seed, claimed_root_id, decode_header,
                                    encode_header, file_bytes_for, header_bytes_for, item_seed, num_chunks_for)


def _sums(spec, chunk_bytes, algo, seq):
    data = np.arange(spec.payload_bytes, dtype=np.uint64).astype(np.uint8)
    seed = item_seed(spec.key, seq)
    return [chunk_checksum(data[i: i + chunk_bytes], algo, chunk_seed(seed, i // chunk_bytes))
            for i in range(0, spec.payload_bytes, chunk_bytes)]


def _header(specs=(ItemSpec("ckpt/α β", 3 * (1 << 20) + 5, "<f4", (3, 7)),), chunk_bytes=1 << 20,
            algo=CHECKSUM_CRC32, seq=77):
    return build_header(seq, chunk_bytes, algo, specs, [_sums(s, chunk_bytes, algo, seq) for s in specs])


@pytest.mark.parametrize("algo", [CHECKSUM_CRC32, CHECKSUM_XXH3])
def test_round_trip_and_sizes(algo):
    if algo == CHECKSUM_XXH3:
        pytest.importorskip("xxhash")
    h = _header(algo=algo)
    raw = encode_header(h)
    assert len(raw) == h.header_bytes == ALIGN_BYTES
    assert decode_header(raw) == (h, (True,))
    (item,) = h.items
    assert len(item.chunk_checksums) == 4 and item.offset == ALIGN_BYTES
    assert h.file_bytes == ALIGN_BYTES + 3 * (1 << 20) + ALIGN_BYTES  # payload padded to the next block
    assert file_bytes_for(h.items, h.chunk_bytes) == h.file_bytes


def test_a_pack_lays_items_out_block_aligned_in_order():
    specs = [ItemSpec(f"kv/{i}", n, "|u1", (n,)) for i, n in enumerate([5000, 0, 4096, 1])]
    h = _header(specs, chunk_bytes=4096)
    assert [i.offset for i in h.items] == [4096, 4096 + 8192, 4096 + 8192, 4096 + 8192 + 4096]
    assert h.file_bytes == 4096 + 8192 + 0 + 4096 + 4096
    assert decode_header(encode_header(h, live=[True, False, True, False])) == (h, (True, False, True, False))


def test_liveness_bytes_are_outside_the_crc_and_only_live_reads_as_live():
    h = _header([ItemSpec("a", 10, "|u1", (10,)), ItemSpec("b", 10, "|u1", (10,))], chunk_bytes=4096)
    raw = bytearray(encode_header(h))
    assert raw[h.liveness_offset: h.liveness_offset + 2] == bytes([LIVE, LIVE])
    raw[h.liveness_offset + 1] = DEAD
    assert decode_header(bytes(raw))[1] == (True, False)
    raw[h.liveness_offset] = 0x4D  # damage: anything but LIVE is deleted (a miss, never a wrong hit)
    assert decode_header(bytes(raw))[1] == (False, False)


def test_empty_payload_and_scalar_shape():
    h = build_header(1, 1 << 20, CHECKSUM_CRC32, [ItemSpec("k", 0, "<f8", ())], [[]])
    assert decode_header(encode_header(h))[0] == h
    assert h.file_bytes == ALIGN_BYTES


def test_long_header_spans_several_blocks():
    spec = ItemSpec("ckpt/α β", 2100 * 4096, "<f4", (3, 7))
    h = _header([spec], chunk_bytes=4096)  # 2100 checksums = 8400 bytes
    raw = encode_header(h)
    assert len(raw) == 3 * ALIGN_BYTES == header_bytes_for([spec], 4096)
    assert decode_header(raw)[0] == h


def test_every_single_byte_flip_in_the_checked_header_is_detected():
    h = _header()
    raw = bytearray(encode_header(h))
    for i in range(h.liveness_offset):  # everything up to and including the CRC
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
    for version in (2, 4):  # older stores (no root id) and future ones
        other = bytearray(raw)
        struct.pack_into("<H", other, 8, version)
        with pytest.raises(FormatError, match=f"version {version}"):
            decode_header(bytes(other))


def test_chunk_count_must_match_payload():
    h = _header()
    (item,) = h.items
    short = FileHeader(h.seq, h.chunk_bytes, h.checksum_algo,
                       (type(item)(item.key, item.payload_bytes, item.dtype_name, item.shape, item.chunk_checksums[:-1],
                                   item.offset),))
    with pytest.raises(FormatError):
        encode_header(short)
    assert num_chunks_for(0, 4096) == 0 and num_chunks_for(4097, 4096) == 2


def test_unknown_flags_are_rejected():
    raw = bytearray(encode_header(_header()))
    struct.pack_into("<H", raw, 10, 0x0100)
    with pytest.raises(FormatError):
        decode_header(bytes(raw))


def test_checksums_differ_by_algorithm_seed_and_detect_one_bit():
    xxhash = pytest.importorskip("xxhash")
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    flipped = data.copy()
    flipped[12345] ^= 0x10
    for algo in (CHECKSUM_CRC32, CHECKSUM_XXH3):
        assert chunk_checksum(data, algo) != chunk_checksum(flipped, algo)
        # the same bytes under another key, another write or at another chunk index do not verify
        seeds = {item_seed("a", 1), item_seed("b", 1), item_seed("a", 2), chunk_seed(item_seed("a", 1), 1)}
        assert len({chunk_checksum(data, algo, s) for s in seeds}) == 4
    assert chunk_checksum(data, CHECKSUM_XXH3) == xxhash.xxh3_64_intdigest(data.tobytes()) & 0xFFFFFFFF


def test_the_root_id_round_trips_and_reads_from_a_damaged_header():
    """The root id is the file's proof of ownership (ownership.py): it must survive the codec and stay
    readable at its fixed offset when the header around it no longer decodes."""
    spec = ItemSpec("k", 10, "|u1", (10,))
    sums = [_sums(spec, 4096, CHECKSUM_CRC32, 5)]
    h = build_header(5, 4096, CHECKSUM_CRC32, [spec], sums, root_id=0xDEADBEEF12345678)
    raw = bytearray(encode_header(h))
    assert decode_header(bytes(raw))[0].root_id == 0xDEADBEEF12345678
    raw[:8] = b"GARBAGE!"  # magic gone: the header no longer decodes
    raw[60] ^= 0xFF
    with pytest.raises(FormatError):
        decode_header(bytes(raw))
    assert claimed_root_id(bytes(raw)) == 0xDEADBEEF12345678
    assert claimed_root_id(b"short") is None
