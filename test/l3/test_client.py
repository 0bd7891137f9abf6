"""HiState's L3 client against a real loopback Mooncake master and store service."""
import os
import subprocess
import sys
import uuid

import pytest

from histate.l3.client import L3Client, PutHints, frame, unframe


@pytest.fixture
def client(mooncake):
    c = L3Client(mooncake.master_address, key_prefix=f"t-{uuid.uuid4().hex[:8]}")
    yield c
    c.close()


def test_frames_round_trip_and_reject_every_damage():
    payload = bytes(range(256)) * 3
    assert unframe(frame(payload)) == payload
    blob = bytearray(frame(payload))
    for i in (0, 8, 20, len(blob) - 1):  # magic, size, digest, payload
        damaged = bytearray(blob)
        damaged[i] ^= 0x01
        assert unframe(bytes(damaged)) is None, i
    assert unframe(bytes(blob[:-1])) is None  # torn
    assert unframe(b"") is None


def test_put_get_exists_byte_exact(client):
    payload = os.urandom(300_000)
    assert client.put("a", payload, PutHints(soft_pin_ttl_s=60.0, group_id="g-a"))
    assert client.get("a") == payload
    assert client.exists_many(["a", "b"]) == [True, False]
    assert client.get("b") is None
    assert client.stats.hits == 1 and client.stats.misses == 1


def test_an_object_outlives_the_process_that_wrote_it(mooncake, client):
    code = ("import sys; from histate.l3.client import L3Client; "
            f"c = L3Client('{mooncake.master_address}', key_prefix='{client.key_prefix}'); "
            "sys.exit(0 if c.put('from-child', b'x' * 5000) else 3)")
    env = {**os.environ, **mooncake.env}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert client.get("from-child") == b"x" * 5000


def test_a_foreign_object_under_our_key_is_a_miss_not_bytes(mooncake, client):
    # Written without HiState's frame (e.g. by another program sharing the store).
    client._store.put(client.key("raw"), b"not a frame at all, just bytes")
    assert client.get("raw") is None
    assert client.stats.corrupt == 1
