"""The SSD tier of the executor: named objects in `histate.storage.CheckpointStore`.

The executor's SSD stores (tier_stores.py) need three calls -- put, get, delete of a flat uint8 tensor
under a name -- which `SsdObjects` maps onto the project's store (NIXL POSIX or plain files, checksummed,
atomically published). The core, not the store, decides what lives on SSD: the store gets a byte budget
with room for file headers and block padding, and is told never to evict on its own
(`on_capacity_needed` returns no victims), so a refused put means the core and the bytes disagree.
"""

from __future__ import annotations

import torch

from histate.storage import CheckpointStore, StoreConfig

# Each object costs a header block plus block padding on disk; the tiny model's objects are 64-230 KiB.
_FILE_OVERHEAD_FACTOR = 2
_FILE_OVERHEAD_BYTES = 64 << 20


class SsdWriteFailed(RuntimeError):
    """The SSD store refused or failed a put the core decided on."""


class SsdObjects:
    def __init__(self, store: CheckpointStore):
        self.store = store

    def put(self, name: str, payload: torch.Tensor) -> None:
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ValueError(f"payload must be a flat uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
        result = self.store.put(name, payload.detach().to("cpu").contiguous())
        if not result.stored:
            raise SsdWriteFailed(f"SSD put of {name!r} failed: {result.fault.value}")

    def get(self, name: str) -> torch.Tensor | None:
        """The payload, or None for a miss of any kind (absent, torn, corrupt, I/O error)."""
        result = self.store.get(name)
        return result.tensor().reshape(-1) if result.hit else None

    def delete(self, name: str) -> None:
        self.store.delete(name)

    def close(self) -> None:
        self.store.close()


def open_ssd(root: str, core_capacity_bytes: int, backend: str = "auto") -> SsdObjects:
    """An SSD object store under `root` sized for `core_capacity_bytes` of payload placed by the core."""
    config = StoreConfig(
        dirs=[root],
        capacity_bytes=_FILE_OVERHEAD_FACTOR * core_capacity_bytes + _FILE_OVERHEAD_BYTES,
        backend=backend,
        num_workers=1,
    )
    return SsdObjects(CheckpointStore(config, on_capacity_needed=lambda num_bytes: ()))
