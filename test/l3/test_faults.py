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


# --- faults the loopback cluster injects (histate.cluster.faults), one client at a time -------------

def _garble_payload(blob: bytes) -> bytes:
    """Same size, HiState's frame header intact, every payload byte changed: only the checksum can tell."""
    from histate.l3.client import FRAME_HEADER_SIZE_BYTES as HEADER

    return blob[:HEADER] + bytes(b ^ 0x5A for b in blob[HEADER:])


def test_same_size_garbage_and_a_truncated_object_are_checksum_and_size_misses(mooncake):
    client = L3Client(mooncake.master_address, key_prefix=f"garble-{uuid.uuid4().hex[:8]}")
    payload = os.urandom(50_000)
    assert client.put("g", payload) and client.put("t", payload)
    raw = client._store
    blob = raw.get(client.key("g"))
    assert raw.upsert(client.key("g"), _garble_payload(blob)) == 0
    assert raw.upsert(client.key("t"), blob[:len(blob) // 2]) == 0
    assert len(raw.get(client.key("g"))) == len(blob)  # the injection took: same size, other bytes
    assert client.get("g") is None and client.get("t") is None
    assert client.stats.corrupt == 2 and client.stats.hits == 0
    client.close()


def test_a_paused_store_costs_one_bounded_timeout_then_calls_are_skipped_until_it_answers(own_mooncake):
    mooncake = own_mooncake
    client = L3Client(mooncake.master_address, key_prefix=f"pause-{uuid.uuid4().hex[:8]}",
                      op_timeout_s=0.5, down_for_s=1.0)
    payload = os.urandom(20_000)
    assert client.put("p", payload)
    mooncake.pause_store()
    try:
        started = time.monotonic()
        assert client.get("p") is None  # without the timeout: 30 s (the transfer engine's own)
        assert client.get("p") is None and not client.put("q", payload)
        elapsed_s = time.monotonic() - started
    finally:
        mooncake.resume_store()
    assert elapsed_s < 0.5 + 0.4, elapsed_s
    assert (client.stats.timeouts, client.stats.down_events) == (1, 1)
    assert client.stats.skipped_down == 2
    deadline = time.monotonic() + 10.0
    while client.get("p") != payload and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get("p") == payload  # the store answers again; the client tried again by itself
    client.close()


def test_a_dead_master_is_a_bounded_miss_and_the_client_reconnects_to_a_restarted_one(own_mooncake):
    mooncake = own_mooncake
    client = L3Client(mooncake.master_address, key_prefix=f"master-{uuid.uuid4().hex[:8]}",
                      op_timeout_s=0.5, down_for_s=1.0)
    payload = os.urandom(20_000)
    assert client.put("m", payload)
    mooncake.kill_master()
    started = time.monotonic()
    assert client.exists_many(["m"]) == [False]
    assert client.get("m") is None and not client.put("n", payload)
    assert time.monotonic() - started < 0.5 + 0.4  # without the timeout: 4.3 s a get or put
    assert client.stats.down_events >= 1

    mooncake.start_master()
    deadline = time.monotonic() + 20.0
    while not client.put("n", payload) and time.monotonic() < deadline:
        time.sleep(0.2)  # the store service mounts its segment on the new master within a heartbeat
    assert client.get("n") == payload
    assert client.get("m") is None  # a restarted master lists nothing it had
    client.close()


def test_a_store_full_of_pinned_objects_refuses_puts_after_bounded_retries(own_mooncake):
    from mooncake.store import ReplicateConfig

    from histate.l3.client import PUT_RETRY_BACKOFF_S

    mooncake = own_mooncake
    client = L3Client(mooncake.master_address, key_prefix=f"full-{uuid.uuid4().hex[:8]}")
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True  # never evicted: the store stays full
    junk = 0
    while client._store.put(f"junk-{client.key_prefix}-{junk}", b"j" * 2**19, pinned) == 0:
        junk += 1
    assert junk > 0
    started = time.monotonic()
    assert not client.put("x", os.urandom(100_000))
    assert client.stats.put_retries == len(PUT_RETRY_BACKOFF_S)
    assert time.monotonic() - started < sum(PUT_RETRY_BACKOFF_S) + 0.5
    assert client._store.remove_by_regex(f"^junk-{client.key_prefix}-.*") == junk
    assert client.put("x", b"fits now")
    client.close()


def test_a_corrupt_object_is_removed_so_the_next_put_of_its_key_writes_a_whole_one(mooncake):
    client = L3Client(mooncake.master_address, key_prefix=f"heal-{uuid.uuid4().hex[:8]}")
    payload = os.urandom(30_000)
    assert client.put("h", payload)
    raw = client._store
    raw.upsert(client.key("h"), _garble_payload(raw.get(client.key("h"))))
    assert client.put("h", payload)  # the master lists the key: this put changes nothing...
    assert client.get("h") is None   # ...so the garbage is still there, and read as a miss
    assert client.stats.corrupt_removed == 1
    assert client.put("h", payload)
    assert client.get("h") == payload
    client.close()
