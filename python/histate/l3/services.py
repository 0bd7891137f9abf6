"""A Mooncake master and one standalone store service on 127.0.0.1, for the loopback cluster and tests.

Why a standalone store service: an object lives in the memory segment of the process that
contributed it. Workers that contribute no segment (`global_segment_size` 0) write into the store
service's segment, so their objects survive a worker's death -- the failover the cluster exists to
show. Killing the store service is the other fault the tests inject: every object goes, reads
fail fast (TRANSFER_FAIL) and must become misses.

Loopback only: the master binds 127.0.0.1, the store service advertises 127.0.0.1, and every
process gets `MC_TCP_BIND_ADDRESS=127.0.0.1` (without it a Mooncake client advertises the NIC
address and peers would dial it) and `MOONCAKE_PROTOCOL=tcp` (no RDMA here). Metadata is exchanged
peer to peer (`P2PHANDSHAKE`), so no HTTP metadata server is started. Some transfer-engine
sockets still listen on all interfaces (the wheel's RPC ports); nothing is ever sent to an address
other than 127.0.0.1.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from histate.loopback import HOST, end_process_group, free_port, log_tail

LOOPBACK = HOST
DEFAULT_SEGMENT_SIZE_BYTES = 256 * 2**20
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
MIN_SEGMENT_SIZE_BYTES = 16 * 2**20
"""mooncake_client refuses a smaller segment (client_buffer_allocation.cpp: 'Total size must be at least
16777216') and exits; refused here first, with the reason."""


def mooncake_binaries() -> Optional[Path]:
    """The directory of the wheel's `mooncake_master` and `mooncake_client` binaries, or None."""
    try:
        import mooncake
    except Exception:
        return None
    root = Path(mooncake.__file__).parent
    if (root / "mooncake_master").exists() and (root / "mooncake_client").exists():
        return root
    return None


def unavailable_reason() -> Optional[str]:
    """Why a loopback Mooncake cannot run here (a skip message), or None when it can."""
    if mooncake_binaries() is None:
        return "mooncake-transfer-engine-non-cuda is not installed (make venv installs it)"
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # libibverbs.so.1 missing is the usual cause
        return f"mooncake.store does not import ({exc}); install Debian's libibverbs1"
    return None


def client_env(master_port: int) -> dict:
    """Environment for any Mooncake client of this loopback store (SGLang's MooncakeStore reads the
    same variables: mooncake_store.py MooncakeStoreConfig.load_from_env)."""
    return {
        "MC_TCP_BIND_ADDRESS": LOOPBACK,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MOONCAKE_MASTER": f"{LOOPBACK}:{master_port}",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_LOCAL_HOSTNAME": LOOPBACK,
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
    }


def _wait_listening(port: int, proc: subprocess.Popen, what: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; log: {log}\n{log_tail(log)}")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout_s:.0f} s; log: {log}\n{log_tail(log)}")


@dataclass(frozen=True)
class MasterOptions:
    """The master's eviction knobs (mooncake_master flags of the same names, with the wheel's defaults;
    the simulator's L3 uses the same ones, sim/l3.py)."""

    eviction_high_watermark_ratio: float = 0.90
    eviction_ratio: float = 0.05
    default_kv_lease_ttl_ms: int = 10_000


class LoopbackMooncake:
    """`with LoopbackMooncake() as mc:` a master and a store service of `segment_size_bytes` on 127.0.0.1.

    `mc.env` is what a client process needs; `kill_store()` SIGKILLs the store service (all objects
    go), `start_store()` brings a fresh, empty one back on the same port; `kill_master()` /
    `start_master()` do the same to the master, `pause_store()` / `resume_store()` SIGSTOP / SIGCONT
    the store service (the fault scenarios of histate.cluster.faults). Everything started is
    stopped on exit, also on error. Processes run in their own process groups so that a stop
    reaches the binary behind any wrapper.
    """

    def __init__(self, segment_size_bytes: int = DEFAULT_SEGMENT_SIZE_BYTES, log_dir: Optional[str] = None,
                 options: MasterOptions = MasterOptions()) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"loopback Mooncake unavailable: {reason}")
        if segment_size_bytes < MIN_SEGMENT_SIZE_BYTES:
            raise ValueError(f"store segment of {segment_size_bytes} bytes: Mooncake's store service needs at "
                             f"least {MIN_SEGMENT_SIZE_BYTES} (16 MiB)")
        self.segment_size_bytes = segment_size_bytes
        self.options = options
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="histate-mooncake-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.master_port = free_port()
        self.metrics_port = free_port()
        self.store_port = free_port()
        self._master: Optional[subprocess.Popen] = None
        self._store: Optional[subprocess.Popen] = None
        self._store_starts = 0
        self._master_starts = 0

    @property
    def env(self) -> dict:
        return client_env(self.master_port)

    @property
    def master_address(self) -> str:
        return f"{LOOPBACK}:{self.master_port}"

    def _spawn(self, argv: list, log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / log_name
        env = {**os.environ, **self.env}
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        return proc, log

    def start(self) -> "LoopbackMooncake":
        try:
            self.start_master()
            self.start_store()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start the master (again, on the same port): a restarted master knows no objects; the store
        service mounts its segment on it again by itself (its heartbeat), and clients reconnect."""
        if self._master is not None and self._master.poll() is None:
            return
        self._master_starts += 1
        o = self.options
        self._master, log = self._spawn([
            str(mooncake_binaries() / "mooncake_master"), f"--rpc_address={LOOPBACK}", f"--rpc_port={self.master_port}",
            f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}",
            f"--eviction_high_watermark_ratio={o.eviction_high_watermark_ratio}",
            f"--eviction_ratio={o.eviction_ratio}", f"--default_kv_lease_ttl={o.default_kv_lease_ttl_ms}",
        ], f"master-{self._master_starts}.log")
        _wait_listening(self.master_port, self._master, "mooncake_master", log, START_TIMEOUT_S)

    def kill_master(self) -> None:
        """SIGKILL the master, as a crash would: its object metadata is gone (the store service's bytes
        stay, unreachable by key)."""
        if self._master is not None:
            end_process_group(self._master, STOP_TIMEOUT_S, first_signal=signal.SIGKILL)

    def pause_store(self) -> None:
        """SIGSTOP the store service: it holds its connections but answers nothing (a slow or hung
        node, without tc). `resume_store` lets it go on."""
        os.killpg(self._store.pid, signal.SIGSTOP)

    def resume_store(self) -> None:
        os.killpg(self._store.pid, signal.SIGCONT)

    def all_keys(self) -> list:
        """Every key the master lists (its HTTP `/get_all_keys`, on the metrics port)."""
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/get_all_keys", timeout=5.0) as resp:
            return [k for k in resp.read().decode().splitlines() if k]

    def start_store(self) -> None:
        """Start the store service (again): its segment is empty."""
        if self._store is not None and self._store.poll() is None:
            return
        self._store_starts += 1
        self._store, log = self._spawn([
            str(mooncake_binaries() / "mooncake_client"), f"--host={LOOPBACK}", f"--port={self.store_port}",
            f"--master_server_address={self.master_address}", "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={self.segment_size_bytes}", "--protocol=tcp",
        ], f"store-{self._store_starts}.log")
        _wait_listening(self.store_port, self._store, "mooncake_client (store service)", log, START_TIMEOUT_S)
        self._wait_segment_mounted(log)

    def _wait_segment_mounted(self, log: Path, timeout_s: float = START_TIMEOUT_S) -> None:
        """The service listens before its segment is mounted at the master; a put in between finds no
        space. Its log says when the mount is done."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "Starting real client service" in log.read_text(errors="replace"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"store service did not mount its segment within {timeout_s:.0f} s; log: {log}")

    def kill_store(self) -> None:
        """SIGKILL the store service, as a crash would: its segment and every object in it are gone."""
        if self._store is not None:
            self._continue(self._store)
            end_process_group(self._store, STOP_TIMEOUT_S, first_signal=signal.SIGKILL)

    @staticmethod
    def _continue(proc: subprocess.Popen) -> None:
        """SIGCONT a possibly paused process (a stopped process cannot exit on SIGTERM)."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def store_alive(self) -> bool:
        return self._store is not None and self._store.poll() is None

    def stop(self) -> None:
        for proc in (self._store, self._master):
            if proc is not None:
                self._continue(proc)
                end_process_group(proc, STOP_TIMEOUT_S)
        self._store = self._master = None

    def __enter__(self) -> "LoopbackMooncake":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_log_dir and not any(exc):
            shutil.rmtree(self.log_dir, ignore_errors=True)


def main(argv: Optional[list] = None) -> int:  # pragma: no cover - manual use
    """`python -m histate.l3.services`: run a loopback master + store service until Ctrl-C, printing
    the environment a client needs."""
    with LoopbackMooncake() as mc:
        for key, value in mc.env.items():
            print(f"export {key}={value}")
        sys.stdout.flush()
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
