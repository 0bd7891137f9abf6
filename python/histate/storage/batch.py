"""Handles for submitted work: one IoBatch per submit call, completed item by item by the workers."""
from __future__ import annotations

import threading
from typing import Generic, TypeVar

R = TypeVar("R")


class IoBatch(Generic[R]):
    """Results of one batched submit, in submission order. `poll()` never blocks; `wait()` may."""

    def __init__(self, num_items: int):
        self._results: list[R | None] = [None] * num_items
        self._remaining = num_items
        self._cond = threading.Condition()

    def _complete(self, index: int, result: R) -> None:
        self._complete_many([(index, result)])

    def _complete_many(self, results: list[tuple[int, R]]) -> None:
        """Complete several items under one lock acquisition (a packed batch finishes together)."""
        with self._cond:
            for index, result in results:
                if self._results[index] is not None:
                    raise RuntimeError(f"batch item {index} completed twice")
                self._results[index] = result
            self._remaining -= len(results)
            if self._remaining == 0:
                self._cond.notify_all()

    def poll(self) -> bool:
        """True once every item has completed."""
        with self._cond:
            return self._remaining == 0

    def wait(self, timeout_s: float | None = None) -> list[R]:
        """Block until every item has completed; raises TimeoutError after `timeout_s`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._remaining == 0, timeout_s):
                raise TimeoutError(f"{self._remaining} of {len(self._results)} items still pending "
                                   f"after {timeout_s} s")
            return list(self._results)

    def __len__(self) -> int:
        return len(self._results)
