"""Prefix-chained page keys name whole prefixes; the SSD tier (histate.storage) turns faults into misses."""
import pytest

torch = pytest.importorskip("torch")

from histate.reference.page_keys import page_keys  # noqa: E402
from histate.reference.ssd import SsdWriteFailed, open_ssd  # noqa: E402


def test_a_key_identifies_its_page_and_everything_before_it():
    tokens = list(range(64 * 3 + 10))
    keys = page_keys(tokens, 64)
    assert len(keys) == 3  # the trailing 10 tokens form no page
    assert page_keys(tokens[:128], 64) == keys[:2]
    edited = list(tokens)
    edited[70] += 1  # inside page 1
    other = page_keys(edited, 64)
    assert other[0] == keys[0] and other[1] != keys[1] and other[2] != keys[2]
    # The same page content after a different prefix is a different key.
    assert page_keys(tokens[64:128], 64)[0] != keys[1]


def test_object_round_trip_is_byte_exact(tmp_path):
    ssd = open_ssd(str(tmp_path), 1 << 20)
    payload = torch.arange(1000, dtype=torch.int64).view(torch.uint8)
    ssd.put("obj", payload)
    assert torch.equal(ssd.get("obj"), payload)
    ssd.delete("obj")
    assert ssd.get("obj") is None
    ssd.close()


def test_a_corrupt_object_reads_as_missing(tmp_path):
    ssd = open_ssd(str(tmp_path), 1 << 20)
    ssd.put("obj", torch.ones(5000, dtype=torch.uint8))
    path = ssd.store.layout.final_path("obj")
    with open(path, "r+b") as f:
        f.seek(4096 + 10)  # inside the payload (the header fills the first 4 KiB block)
        f.write(b"\xff" * 8)
    assert ssd.get("obj") is None
    ssd.close()


def test_a_put_the_store_refuses_raises(tmp_path):
    ssd = open_ssd(str(tmp_path), 0)
    with pytest.raises(SsdWriteFailed, match="no_capacity"):
        ssd.put("big", torch.zeros(200 << 20, dtype=torch.uint8))
    ssd.close()
