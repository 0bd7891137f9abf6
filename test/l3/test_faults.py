"""Store faults are misses: the store service killed mid-run, and objects the master evicted."""
import os
import time
import uuid

from histate.l3.client import L3Client


def test_killing_the_store_service_turns_reads_and_writes_into_misses_then_recovers(own_mooncake):
    mooncake = own_mooncake
    client = L3Client(mooncake.master_address, key_prefix=f"kill-{uuid.uuid4().hex[:8]}")
    payload = os.urandom(100_000)
    assert client.put("before", payload)
    assert client.get("before") == payload

    mooncake.kill_store()
    started = time.monotonic()
    assert client.get("before") is None  # its segment died with the service
    assert not client.put("during", payload)
    assert time.monotonic() - started < 10.0, "a dead store must fail fast, not hang a request"

    mooncake.start_store()
    deadline = time.monotonic() + 20.0
    while not client.put("after", payload) and time.monotonic() < deadline:
        time.sleep(0.2)  # the master learns of the new segment within a heartbeat
    assert client.get("after") == payload
    assert client.get("before") is None  # a fresh segment is empty
    client.close()


def test_objects_past_the_segment_are_evicted_and_read_back_as_misses(mooncake):
    client = L3Client(mooncake.master_address, key_prefix=f"evict-{uuid.uuid4().hex[:8]}")
    object_bytes = 1 << 20
    num_objects = 3 * (mooncake.segment_size_bytes // object_bytes)  # three segments' worth
    payloads = {}
    for i in range(num_objects):
        payloads[i] = bytes([i % 251]) * object_bytes
        client.put(f"o{i}", payloads[i])
    got = {i: client.get(f"o{i}") for i in range(num_objects)}
    present = [i for i, v in got.items() if v is not None]
    assert 0 < len(present) < num_objects
    assert all(got[i] == payloads[i] for i in present)  # what is read is exactly what was put
    assert got[0] is None  # the oldest went first
    client.close()
