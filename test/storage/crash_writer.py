"""Writer process for test_crash.py: streams versioned checkpoints into a store until it is SIGKILLed.

Prints `ack <key> <version>` after each put is published and `paused <key>` once a write has been
frozen half-way (some pieces on disk, no header yet), which is the parent's cue to SIGKILL it.
Usage: python crash_writer.py DIR BACKEND ACKS_BEFORE_PAUSE [pack]   (pack: batches of 4 as packed files)
"""
import sys
import threading

from histate.storage import CheckpointStore, StoreConfig
import histate.storage.transfer as transfer
from storage_helpers import versioned_payload

NUM_KEYS = 20


def payload_bytes(key: str, version: int) -> int:
    return (1 << 20) + 4096 * (version % 5) + int(key.split("-")[1]) * 1000


def main() -> None:
    root, backend, acks_before_pause = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pack = sys.argv[4:] == ["pack"]
    out_lock = threading.Lock()
    pause = threading.Event()
    real_checksum = transfer.chunk_checksum

    def say(line: str) -> None:
        with out_lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def checksum_then_maybe_freeze(chunk, *args):
        # checksums run beside the piece writes and the header waits for all of them: freezing one
        # leaves a temp file with payload pieces on disk and no header, i.e. a torn write
        if pause.is_set() and threading.current_thread() is not threading.main_thread():
            say(f"paused {threading.current_thread().name}")
            threading.Event().wait()
        return real_checksum(chunk, *args)

    transfer.chunk_checksum = checksum_then_maybe_freeze
    cfg = StoreConfig(dirs=[root], capacity_bytes=1 << 34, backend=backend, num_workers=2,
                      chunk_bytes=64 << 10, piece_bytes=128 << 10, max_inflight=2)
    store = CheckpointStore(cfg)
    acks = 0
    version = 0
    while True:
        batch_items = [(f"ckpt-{i}", versioned_payload(f"ckpt-{i}", version, payload_bytes(f"ckpt-{i}", version)))
                       for i in range(NUM_KEYS)]
        for start in range(0, NUM_KEYS, 4):
            for r in store.submit_put(batch_items[start: start + 4], pack=pack).wait():
                if r.stored:
                    say(f"ack {r.key} {version}")
                    acks += 1
            if acks >= acks_before_pause:
                pause.set()
        version += 1


if __name__ == "__main__":
    main()
