"""Child processes on 127.0.0.1: free ports, stopping a process group, the end of a log.

Shared by the loopback Mooncake services (l3/services.py), the `histate serve` worker pool and the
router (cluster/). Every service HiState starts for itself binds 127.0.0.1 and runs in its own
process group (`start_new_session=True`), so stopping it reaches whatever it spawned.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 right now (the OS's choice; another process could take it
    before we bind it, which the caller's start-up wait then reports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def end_process_group(process: subprocess.Popen, timeout_s: float, first_signal: int = signal.SIGTERM) -> None:
    """Send `first_signal` to the process's group, wait up to timeout_s, then SIGKILL it; a no-op once it
    is gone. SIGKILL as the first signal is a crash, as the failure tests want one."""
    for sig in (first_signal, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=timeout_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the leader is gone; anything it left in its group goes too
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def log_tail(path: Path, num_chars: int = 2000) -> str:
    """The end of a child's log, for an error message that says why it did not start."""
    try:
        return Path(path).read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""
