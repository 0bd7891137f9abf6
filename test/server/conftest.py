"""SGLang's own server processes for the real-server tests (test and bench support: sglang_cpu/server).

Each configuration is one `python -m sglang.launch_server` process group (launcher, tokenizer manager,
scheduler, detokenizer), started once when a test first asks for it and stopped after the last test of
this directory (package scope: the directories after it get the memory back, and SGLang's host-tier
check wants 10 GiB free besides what a pool asks for); start-up and total times are printed in the
summary. Servers started together boot in parallel.

Skips this directory, naming what is missing, when SGLang or the server's own imports are absent
(`make venv` installs them).
"""
from __future__ import annotations

import importlib.util
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

MISSING = [name for name in ("sglang", "uvloop", "uvicorn", "fastapi", "xgrammar", "multipart")
           if importlib.util.find_spec(name) is None]
if MISSING:  # pragma: no cover - environment without the server's imports
    collect_ignore_glob = ["test_*.py"]

REFERENCE_ARGS = ("--disable-radix-cache",)  # stock SGLang, every request a cold prefill
HISTATE_ARGS = ("--enable-histate", "--histate-device-pool", "static", "--enable-metrics")

_timings: list = []  # (name, start-up s, lifetime s)


class ServerFleet:
    """Named servers of this session; `get` starts what is not running (several at once in parallel)."""

    def __init__(self, root: Path):
        self.root = root
        self.servers: dict = {}
        self.started_at: dict = {}

    def get(self, *specs: tuple, env: Optional[dict] = None) -> list:
        """specs: (name, args); returns the running servers in that order. `env`: extra environment of
        the servers started now."""
        from sglang_cpu.server.launch import CpuServer

        todo = [(name, args) for name, args in specs if name not in self.servers]
        errors: list = []

        def boot(name: str, args: tuple) -> None:
            server = CpuServer(list(args), log_path=self.root / f"{name}.log", env=env)
            try:
                self.servers[name] = server.start()
                self.started_at[name] = time.monotonic()
            except Exception as error:  # reported below, with the log's tail
                errors.append(error)

        threads = [threading.Thread(target=boot, args=spec) for spec in todo]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return [self.servers[name] for name, _ in specs]

    def stop(self, name: str) -> None:
        server = self.servers.pop(name, None)
        if server is not None:
            server.stop()
            _timings.append((name, server.startup_s, time.monotonic() - self.started_at.pop(name)))

    def stop_all(self) -> None:
        """Stop every server at once (each waits up to 30 s for SGLang's own shutdown; one after the
        other they took ~25 s of every suite run)."""
        threads = [threading.Thread(target=self.stop, args=(name,)) for name in list(self.servers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


@pytest.fixture(scope="package")
def fleet(tmp_path_factory):
    fleet = ServerFleet(tmp_path_factory.mktemp("servers"))
    yield fleet
    fleet.stop_all()


@pytest.fixture(scope="package")
def ssd_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ssd")


@dataclass(frozen=True)
class Servers:
    reference: object  # stock SGLang, radix cache disabled: every answer a cold prefill
    histate: object  # --enable-histate with an SSD tier, metrics and miss reasons; shared by tests in file order
    fresh: object  # --enable-histate, untouched until the capture-exactness test (its hits are predictable)


@pytest.fixture(scope="package")
def servers(fleet, ssd_root) -> Servers:
    """The three standard servers, booted together on first use."""
    return Servers(*fleet.get(("reference", REFERENCE_ARGS),
                              ("histate", HISTATE_ARGS + ("--histate-ssd-dir", str(ssd_root / "main"),
                                                          "--histate-miss-reasons")),
                              ("fresh", HISTATE_ARGS)))


def pytest_terminal_summary(terminalreporter):
    if _timings:
        terminalreporter.section("SGLang server processes (CPU)")
        for name, startup_s, lifetime_s in _timings:
            terminalreporter.write_line(f"{name}: ready after {startup_s:.1f} s, up {lifetime_s:.1f} s")
