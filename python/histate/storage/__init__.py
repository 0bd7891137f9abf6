"""SSD store for recurrent checkpoints and cold KV pages (docs/storage.md).

    from histate.storage import CheckpointStore, StoreConfig
    store = CheckpointStore(StoreConfig(dirs=["/nvme/histate"], capacity_bytes=150 << 30))
    batch = store.submit_put([("ckpt/abc", state_array)])   # asynchronous; poll() / wait()
    result = store.get("ckpt/abc")                           # GetResult: .hit, .fault, .array()

NIXL's POSIX plugin moves the bytes when it is installed and starts; plain preadv/pwritev otherwise,
with the same on-disk format. Faults never raise from get/put: they come back as misses with a reason.
"""
from histate.storage.batch import IoBatch
from histate.storage.buffers import aligned_empty
from histate.storage.config import StoreConfig
from histate.storage.layout import InvalidKeyError
from histate.storage.nixl_backend import NixlUnavailable, nixl_available
from histate.storage.ownership import DirectoryInUse, StoreDirectoryError
from histate.storage.results import EvictionEvent, Fault, GetResult, PutResult
from histate.storage.store import CheckpointStore

__all__ = [
    "CheckpointStore", "StoreConfig", "IoBatch", "GetResult", "PutResult", "EvictionEvent", "Fault",
    "InvalidKeyError", "NixlUnavailable", "nixl_available", "aligned_empty", "StoreDirectoryError", "DirectoryInUse",
]
