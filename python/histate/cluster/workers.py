"""N `histate serve` worker processes on 127.0.0.1, for a router to spread sessions over.

Why subprocesses (not `ServerThread`s): a worker must be killable on its own -- SIGKILL, the way a
machine dies -- without taking the test or the router down, and each must own its CPU thread and
memory as a real worker would.

Each worker gets a free loopback port and its own temporary directory, which is also its TMPDIR, so
its SSD tier and tokenizer files land there and go away with it even after a SIGKILL (the server
cannot clean up after itself then). Every worker runs in its own process group; `stop` ends the
groups (SIGTERM, then SIGKILL after `stop_timeout_s`).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from histate.loopback import HOST, end_process_group, free_port, log_tail
from typing import Optional, Sequence

@dataclass
class Worker:
    url: str
    process: subprocess.Popen
    work_dir: Path                     # its TMPDIR: SSD tier, tokenizer files, log
    log_path: Path

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


class WorkerPool:
    """Start `num_workers` `histate serve` processes; `with WorkerPool(...) as pool:` stops them all."""

    def __init__(self, num_workers: int, policy: str = "histate", ssd_backend: str = "file",
                 extra_args: Sequence[str] = (), startup_timeout_s: float = 120.0, stop_timeout_s: float = 10.0,
                 base_dir: Optional[Path] = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers, self.policy, self.ssd_backend = num_workers, policy, ssd_backend
        self.extra_args = list(extra_args)
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self._base_dir = base_dir
        self._root: Optional[Path] = None
        self.workers: list = []

    @property
    def urls(self) -> list:
        return [w.url for w in self.workers]

    def start(self) -> list:
        """Start every worker and wait until each answers /health; returns their URLs. On any failure
        everything started is stopped and RuntimeError says which worker and shows its log."""
        self._root = Path(tempfile.mkdtemp(prefix="histate-workers-", dir=self._base_dir))
        try:
            for index in range(self.num_workers):
                self.workers.append(self._launch(index))
            deadline_s = time.monotonic() + self.startup_timeout_s
            for worker in self.workers:
                wait_healthy(worker, deadline_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _launch(self, index: int) -> Worker:
        work_dir = self._root / f"worker{index}"
        work_dir.mkdir()
        port = free_port()
        log_path = work_dir / "serve.log"
        argv = [sys.executable, "-m", "histate.cli", "serve", "--host", HOST, "--port", str(port),
                "--policy", self.policy, "--ssd-dir", str(work_dir / "ssd"), "--ssd-backend", self.ssd_backend,
                *self.extra_args]
        env = {**os.environ, "TMPDIR": str(work_dir), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        return Worker(f"http://{HOST}:{port}", process, work_dir, log_path)

    def kill(self, index: int) -> Worker:
        """SIGKILL worker `index` (its whole process group), as a crashed machine; returns it."""
        worker = self.workers[index]
        end_process_group(worker.process, self.stop_timeout_s, first_signal=signal.SIGKILL)
        return worker

    def stop(self) -> None:
        for worker in self.workers:
            end_process_group(worker.process, self.stop_timeout_s)
        self.workers = []
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def __enter__(self) -> "WorkerPool":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(worker: Worker, deadline_s: float, poll_s: float = 0.2) -> None:
    """Until time.monotonic() passes deadline_s: return once GET /health is 200; raise if the process exits."""
    while True:
        if not worker.alive:
            raise RuntimeError(f"histate serve at {worker.url} exited with {worker.process.returncode}:\n"
                               f"{log_tail(worker.log_path)}")
        try:
            with urllib.request.urlopen(worker.url + "/health", timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline_s:
            raise RuntimeError(f"histate serve at {worker.url} not healthy in time:\n{log_tail(worker.log_path)}")
        time.sleep(poll_s)
