"""The store's records of queued work: a put's items, the file a write op produces, what publishing
it takes, and a read op. Internal to histate.storage (store.py queues them; the read and write paths
run them)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from histate.storage.batch import IoBatch
from histate.storage.format import ItemSpec
from histate.storage.index import Entry, StoredFile
from histate.storage.layout import Location
from histate.storage.results import PutResult


@dataclass(eq=False, slots=True)
class PutItem:
    key: str
    src: np.ndarray  # flat uint8, borrowed from the caller until completion
    spec: ItemSpec
    slot: int  # position in the caller's batch
    cancelled: bool = False


@dataclass(eq=False)
class WriteOp:
    """One file to write: a single object, or a pack of several items."""

    items: list[PutItem]
    batch: IoBatch
    pack: bool
    header_bytes: int
    file_bytes: int
    seq: int = 0
    loc: Location | None = None
    reserved_bytes: int = 0
    finished: bool = False  # backlog, reservation and pending entries released
    publication: Publication | None = None  # prepared beside the I/O, once the header is known

    @property
    def payload_bytes(self) -> int:
        return sum(i.src.size for i in self.items)


@dataclass(eq=False, slots=True)
class Publication:
    """What publishing a written file takes, built while its payload is still being written: its
    index record, one entry per item, and the results if every item gets published."""

    file: StoredFile
    entries: list[Entry]
    results: list[tuple[int, PutResult]]


@dataclass(eq=False)
class ReadOp:
    keys: list[str]
    slots: list[int]
    outs: list[object]
    batch: IoBatch
