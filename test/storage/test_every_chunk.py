"""Every chunk of every read piece is verified: one flipped byte anywhere in a payload is a miss.

Why this file exists: the fault tests flipped a byte in the first and in the last chunk of a 3 MiB
object only. A read cuts that object into a 2 MiB piece (chunks 0 and 1) and a 1 MiB one (chunk 2),
so a verifier that checked only the first chunk of each piece passed them all while serving a flipped
byte in chunk 1 as a hit. Here a byte is flipped in each chunk in turn, at its start, middle and end,
for single objects, packed items, caller destinations (aligned and bounced) and several piece sizes.
"""
import os

import numpy as np
import pytest

from histate.storage import Fault

MiB = 1 << 20
HEADER_BYTES = 4096  # one header block for these small headers: payloads start here


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x20]))


def _payload(num_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


WHERE_IN_CHUNK = {"start": 0, "middle": MiB // 2 + 123, "end": MiB - 1}


@pytest.mark.parametrize("where", list(WHERE_IN_CHUNK))
@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_a_flipped_byte_in_any_chunk_of_a_3_mib_object_is_a_miss(make_store, chunk, where):
    store = make_store()
    data = _payload(3 * MiB)
    assert store.put("victim", data).stored and store.put("other", _payload(MiB, 1)).stored
    _flip(store.layout.final_path("victim"), HEADER_BYTES + chunk * MiB + WHERE_IN_CHUNK[where])
    r = store.get("victim")
    assert r.fault is Fault.CORRUPT and r.buffer is None
    assert store.stats_snapshot()["misses"] == {"corrupt": 1}
    assert store.get("other").hit  # the store keeps serving


@pytest.mark.parametrize("destination", ["aligned", "unaligned"])
def test_the_middle_chunk_is_verified_in_a_caller_destination(make_store, destination):
    """An unaligned destination takes the bounce-buffer path under O_DIRECT: verified all the same."""
    store = make_store()
    data = _payload(3 * MiB)
    store.put("victim", data)
    _flip(store.layout.final_path("victim"), HEADER_BYTES + MiB + MiB // 2)
    out = np.empty(3 * MiB + 1, np.uint8)[1:] if destination == "unaligned" else np.empty(3 * MiB, np.uint8)
    assert store.get("victim", out=out).fault is Fault.CORRUPT


@pytest.mark.parametrize("piece_bytes", [MiB, 2 * MiB, 4 * MiB, 16 * MiB])
def test_every_chunk_of_a_larger_object_under_any_piece_size(make_store, piece_bytes):
    """9 MiB: pieces of one chunk, of several, and one piece spanning most of the object."""
    store = make_store(piece_bytes=piece_bytes)
    data = _payload(9 * MiB)
    store.put("victim", data)
    path = store.layout.final_path("victim")
    for chunk in range(9):
        _flip(path, HEADER_BYTES + chunk * MiB + 4097)
        assert store.get("victim").fault is Fault.CORRUPT, f"chunk {chunk}"
        assert not os.path.exists(path)  # the bad file went; write the object again for the next chunk
        assert store.put("victim", data).stored
        assert np.array_equal(store.get("victim").buffer, data)


def test_a_flipped_byte_in_the_middle_chunk_of_a_packed_item_fails_that_item_only(make_store):
    """A pack: a 3 MiB item between two pages; its middle chunk is damaged; the pages still verify."""
    store = make_store()
    items = [("kv/a", _payload(16 << 10, 2)), ("big", _payload(3 * MiB, 3)), ("kv/b", _payload(16 << 10, 4))]
    assert all(r.stored for r in store.put_many(items, pack=True))
    (pack,) = [os.path.join(d, n) for d, _, names in os.walk(store.layout.roots[0]) for n in names
               if n.endswith(".hsp")]
    big_offset = HEADER_BYTES + (16 << 10)  # after the first page (block aligned)
    _flip(pack, big_offset + MiB + 77)
    got = store.get_many([k for k, _ in items])
    assert [r.fault for r in got] == [None, Fault.CORRUPT, None]
    assert got[0].buffer.tobytes() == items[0][1].tobytes() and got[2].buffer.tobytes() == items[2][1].tobytes()
