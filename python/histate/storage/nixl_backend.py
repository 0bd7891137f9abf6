"""NIXL backend: DRAM <-> FILE transfers through NIXL's POSIX plugin (Linux AIO queue by default).

Each store worker owns one agent (NIXL agents default to no thread synchronisation, and one owner per
agent keeps it that way). Long-lived staging buffers are registered once per session; caller buffers
are registered for the duration of one transfer (about 2.5 us on the reference VM), and opened files
are registered in fd mode. NIXL reports failures as exceptions with only an error code; each becomes
an IoFault so the store turns it into a miss. nixl is imported lazily: `import histate.storage` works
without it, and `NixlUnavailable` tells the store to fall back to plain files.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Sequence

import numpy as np

from histate.storage.buffers import address_of
from histate.storage.io_base import IoSession, OpenFile, Segment
from histate.storage.results import Fault, IoFault

_BACKEND = "POSIX"
_agent_ids = itertools.count()
_SPIN_S = 200e-6  # busy-poll this long (small I/Os finish within it), then yield the CPU between polls
_POLL_SLEEP_S = 50e-6


class NixlUnavailable(RuntimeError):
    """nixl cannot be imported or its POSIX backend cannot start on this machine."""


def _import_nixl():
    # NIXL's Python INFO logs go to stdout; keep them off unless the user asked for them.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a broken wheel failing inside its own import
        raise NixlUnavailable(f"import nixl failed: {type(exc).__name__}: {exc}") from exc
    return nixl_agent, nixl_agent_config


class _Pending:
    __slots__ = ("handle", "temp_regs", "op", "path", "state", "error")

    def __init__(self, handle, temp_regs, op, path, state):
        self.handle, self.temp_regs, self.op, self.path, self.state = handle, temp_regs, op, path, state
        self.error: Exception | None = None


def _contiguous_runs(segments: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """(file offset, address, bytes) runs of segments adjacent both in the file and in memory: the
    pages of a batch are usually slices of one host pool, so a packed batch becomes one descriptor
    pair instead of one per page (NIXL's registration and transfer setup cost per descriptor)."""
    runs: list[list[int]] = []
    for offset, view in segments:
        addr, size = address_of(view), view.size
        if runs and runs[-1][0] + runs[-1][2] == offset and runs[-1][1] + runs[-1][2] == addr:
            runs[-1][2] += size
        else:
            runs.append([offset, addr, size])
    return [(o, a, n) for o, a, n in runs]


class NixlSession(IoSession):
    name = "nixl"

    def __init__(self, params: dict[str, str] | None = None, preallocate: bool = True):
        super().__init__(preallocate=preallocate)
        nixl_agent, nixl_agent_config = _import_nixl()
        self.agent_name = f"histate-store-{os.getpid()}-{next(_agent_ids)}"
        try:
            cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
            self.agent = nixl_agent(self.agent_name, cfg)
            if _BACKEND not in self.agent.get_plugin_list():
                raise NixlUnavailable(f"NIXL has no {_BACKEND} plugin: {self.agent.get_plugin_list()}")
            self.agent.create_backend(_BACKEND, dict(params or {}))
        except NixlUnavailable:
            raise
        except Exception as exc:
            raise NixlUnavailable(f"NIXL {_BACKEND} backend failed to start: {type(exc).__name__}: {exc}") from exc
        self.params = dict(params or {})
        self._staging_regs: dict[int, tuple[int, object]] = {}  # address -> (size, registration)

    # --- registration hooks ------------------------------------------------------------------
    def _attach(self, f: OpenFile) -> None:
        try:
            f.token = self.agent.register_memory([(0, max(f.size_bytes, 1), f.fd, "")], "FILE",
                                                 backends=[_BACKEND])
        except Exception as exc:
            raise IoFault(Fault.IO_ERROR, f"NIXL register {f.path}: {type(exc).__name__}: {exc}") from None

    def _detach(self, f: OpenFile) -> None:
        if f.token is not None:
            self.agent.deregister_memory(f.token, backends=[_BACKEND])
            f.token = None

    def _register_staging(self, buf: np.ndarray) -> None:
        addr = address_of(buf)
        reg = self.agent.register_memory([(addr, buf.size, 0, "")], "DRAM", backends=[_BACKEND])
        self._staging_regs[addr] = (buf.size, reg)

    def _unregister_staging(self, buf: np.ndarray) -> None:
        entry = self._staging_regs.pop(address_of(buf), None)
        if entry is not None:
            self.agent.deregister_memory(entry[1], backends=[_BACKEND])

    def _is_registered(self, addr: int, num_bytes: int) -> bool:
        return any(base <= addr and addr + num_bytes <= base + size
                   for base, (size, _reg) in self._staging_regs.items())

    # --- transfers ---------------------------------------------------------------------------
    def submit(self, f: OpenFile, op: str, segments: Sequence[Segment]) -> object:
        local, remote, fresh = [], [], []
        for offset, addr, size in _contiguous_runs(segments):
            local.append((addr, size, 0))
            remote.append((offset, size, f.fd))
            if not self._is_registered(addr, size):
                fresh.append((addr, size, 0, ""))
        temp_regs = None
        try:
            if fresh:
                temp_regs = self.agent.register_memory(fresh, "DRAM", backends=[_BACKEND])
            handle = self.agent.initialize_xfer(
                op, self.agent.get_xfer_descs(local, "DRAM"), self.agent.get_xfer_descs(remote, "FILE"),
                self.agent_name, backends=[_BACKEND])
        except Exception as exc:
            self._release(None, temp_regs)
            raise IoFault(Fault.IO_ERROR, f"NIXL {op} {f.path} setup: {type(exc).__name__}: {exc}") from None
        try:
            state = self.agent.transfer(handle)
        except Exception as exc:
            self._release(handle, temp_regs)
            raise IoFault(Fault.IO_ERROR, f"NIXL {op} {f.path} post: {type(exc).__name__}: {exc}") from None
        return _Pending(handle, temp_regs, op, f.path, state)

    def poll(self, token: object) -> bool:
        p: _Pending = token
        if p.state == "PROC" and p.error is None:
            try:
                p.state = self.agent.check_xfer_state(p.handle)
            except Exception as exc:  # reported by wait(), which also releases the handle
                p.error = exc
        return p.state != "PROC" or p.error is not None

    def wait(self, token: object) -> None:
        p: _Pending = token
        try:
            if p.error is not None:
                raise p.error
            state = p.state
            spin_until = time.perf_counter() + _SPIN_S
            while state == "PROC":  # the POSIX plugin only progresses (and submits past 64 I/Os) when polled
                if time.perf_counter() > spin_until:
                    time.sleep(_POLL_SLEEP_S)
                state = self.agent.check_xfer_state(p.handle)
            if state != "DONE":
                raise IoFault(Fault.IO_ERROR, f"NIXL {p.op} {p.path} ended in state {state}")
        except IoFault:
            raise
        except Exception as exc:
            raise IoFault(Fault.IO_ERROR, f"NIXL {p.op} {p.path}: {type(exc).__name__}: {exc}") from None
        finally:
            self._release(p.handle, p.temp_regs)

    def _release(self, handle, temp_regs) -> None:
        if handle is not None:
            handle.release()
        if temp_regs is not None:
            self.agent.deregister_memory(temp_regs, backends=[_BACKEND])


def nixl_available() -> bool:
    """True when nixl imports and a POSIX backend starts (costs ~1 s the first time: nixl imports torch)."""
    try:
        NixlSession().shutdown()
    except NixlUnavailable:
        return False
    return True
