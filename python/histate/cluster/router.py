"""sglang-router (0.3.2, `sglang-router launch`) as a subprocess on 127.0.0.1, in front of `histate serve` workers.

Why these flags (measured with two `histate serve` workers, test/cluster/test_router.py):
* `--host 127.0.0.1`, `--prometheus-host 127.0.0.1` and free ports: the router binds 0.0.0.0:30000 and
  a metrics server on 0.0.0.0:29000 by default.
* `--policy manual`: a request's `X-SMG-Routing-Key` (histate bench sends the root session's id) is
  pinned to the worker first chosen for it; keys never move while their worker is available, and only
  the keys of a worker that became unavailable move (sgl-model-gateway/src/policies/manual.rs).
  A new key's worker is drawn at random among the available ones (`--assignment-mode random`, the
  default; min_load / min_group break ties at random too, and with one request at a time every
  worker ties: 7 of 8 keys on one worker was seen with min_group).
* `--cb-failure-threshold 1`: after a worker dies, the first request routed to it fails to connect,
  opens that worker's circuit breaker, and the router's own retry re-selects -- now among the live
  workers -- so the client never sees an error. With the default of 10 (and 5 retries per request)
  the first two requests for the dead worker's keys come back as HTTP 500
  `call_upstream_request_error` before the breaker opens.
* `--health-check-interval-secs 1 --health-failure-threshold 2`: a dead worker is marked unhealthy
  (and so skipped for keys that are not requested meanwhile) ~2 s after it dies, not the default 3 x
  60 s. An unhealthy worker stays listed in GET /workers (`is_healthy: false`); it is not removed.
* env HF_ENDPOINT=http://127.0.0.1:9 and HF_HUB_OFFLINE=1: the router loads a tokenizer for a
  worker whose /server_info names a `model_path`; it must never reach a model hub (histate serve
  names none).

What the router asks of a worker when it adds one: GET /health, an HTTP/2 probe for gRPC (refused:
the worker is HTTP), GET /server_info (falling back to /get_server_info) and GET /model_info; then
GET /health every interval. It forwards POST /generate re-serialized (adding `model`, `log_metrics`,
`no_logs`, `background`, `return_bytes`, `return_entropy`), fans POST /flush_cache out to every
worker, proxies GET /get_model_info to one, and answers /v1/models itself. Its /v1/completions
refuses token-id prompts (422, "data did not match any variant of untagged enum StringOrArray"), so
`histate bench --backend openai` cannot go through it; `--backend sglang` can.

Worker management (the router's own API): GET /workers, POST /workers {"url"}, DELETE /workers/{id}
-- all asynchronous (202), so add/remove here wait until GET /workers shows the change.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from histate.loopback import HOST, end_process_group, free_port, log_tail

CLOSED_LOOPBACK_URL = "http://127.0.0.1:9"   # discard port: nothing listens, nothing leaves the host


def router_executable() -> Optional[str]:
    """`sglang-router` of this Python's environment, else of PATH; None when not installed."""
    here = Path(sys.executable).parent / "sglang-router"
    return str(here) if here.exists() else shutil.which("sglang-router")


class RouterError(RuntimeError):
    pass


class Router:
    """`with Router(worker_urls) as router:` -- router.url takes SGLang /generate requests."""

    def __init__(self, worker_urls: Sequence[str], policy: str = "manual", assignment_mode: str = "random",
                 health_check_interval_s: int = 1, health_failure_threshold: int = 2, cb_failure_threshold: int = 1,
                 extra_args: Sequence[str] = (), log_level: str = "warn", startup_timeout_s: float = 60.0,
                 stop_timeout_s: float = 10.0, log_dir: Optional[Path] = None) -> None:
        for url in worker_urls:
            if not url.startswith(f"http://{HOST}:"):
                raise ValueError(f"worker URL {url!r}: only http://{HOST}:PORT workers are routed to")
        self.worker_urls = list(worker_urls)
        self.policy, self.assignment_mode = policy, assignment_mode
        self.health_check_interval_s, self.health_failure_threshold = health_check_interval_s, health_failure_threshold
        self.cb_failure_threshold = cb_failure_threshold
        self.extra_args, self.log_level = list(extra_args), log_level
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self._log_dir = log_dir
        self._own_log_dir: Optional[Path] = None
        self.process: Optional[subprocess.Popen] = None
        self.url = ""
        self.log_path: Optional[Path] = None

    def argv(self, port: int, metrics_port: int) -> list:
        executable = router_executable()
        if executable is None:
            raise RouterError("sglang-router is not installed (pip install sglang-router)")
        argv = [executable, "launch", "--host", HOST, "--port", str(port),
                "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
                "--policy", self.policy,
                "--health-check-interval-secs", str(self.health_check_interval_s),
                "--health-failure-threshold", str(self.health_failure_threshold),
                "--cb-failure-threshold", str(self.cb_failure_threshold), "--log-level", self.log_level]
        if self.policy == "manual":
            argv += ["--assignment-mode", self.assignment_mode]
        if self.worker_urls:
            argv += ["--worker-urls", *self.worker_urls]
        return argv + self.extra_args

    def start(self) -> str:
        """Start the router and wait until it lists every worker as healthy; returns its URL."""
        if self._log_dir is None:
            self._own_log_dir = Path(tempfile.mkdtemp(prefix="histate-router-"))
        log_dir = self._log_dir or self._own_log_dir
        self.log_path = Path(log_dir) / "router.log"
        port = free_port()
        argv = self.argv(port, free_port())
        env = {**os.environ, "HF_ENDPOINT": CLOSED_LOOPBACK_URL, "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self.url = f"http://{HOST}:{port}"
        try:
            self.wait_for(lambda: self.healthy_urls() >= set(self.worker_urls), self.startup_timeout_s,
                          "every worker healthy")
        except BaseException:
            self.stop()
            raise
        return self.url

    def stop(self) -> None:
        if self.process is not None:
            end_process_group(self.process, self.stop_timeout_s)
            self.process = None
        if self._own_log_dir is not None:
            shutil.rmtree(self._own_log_dir, ignore_errors=True)
            self._own_log_dir = None

    def __enter__(self) -> "Router":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the router's worker API ------------------------------------------------------------------
    def list_workers(self) -> list:
        """GET /workers: [{"id", "url", "model_id", "is_healthy", "load", ...}]."""
        return self._call("GET", "/workers")["workers"]

    def healthy_urls(self) -> set:
        return {w["url"] for w in self.list_workers() if w.get("is_healthy")}

    def add_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """POST /workers, then wait until the router reports the worker healthy."""
        self._call("POST", "/workers", {"url": url})
        self.wait_for(lambda: url in self.healthy_urls(), timeout_s, f"{url} healthy")

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        """DELETE /workers/{id} of the worker at `url`, then wait until it is no longer listed."""
        ids = [w["id"] for w in self.list_workers() if w["url"] == url]
        if not ids:
            raise RouterError(f"{url} is not one of the router's workers")
        self._call("DELETE", f"/workers/{ids[0]}")
        self.wait_for(lambda: url not in {w["url"] for w in self.list_workers()}, timeout_s, f"{url} removed")

    # --- plumbing ---------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Optional[dict] = None, timeout_s: float = 5.0):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            text = resp.read().decode()
        return json.loads(text) if text else None

    def wait_for(self, condition, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
        """Poll `condition()` until true; connection errors count as not yet. RouterError on timeout or exit."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RouterError(f"sglang-router exited ({code}) waiting for {what}:\n{self.log_tail()}")
            try:
                if condition():
                    return
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline_s:
                raise RouterError(f"sglang-router: no {what} after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(poll_s)

    def log_tail(self) -> str:
        return log_tail(self.log_path) if self.log_path else ""
