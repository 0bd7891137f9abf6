"""Start SGLang 0.5.23's own server (`python -m sglang.launch_server`) on this CPU: test and bench support.

What runs is SGLang's entry point with every process it starts (launcher, tokenizer manager, scheduler,
detokenizer, uvicorn); what this module adds is only what the CPU lacks (`shim.py`) and the flags a
CPU needs, each added only when the caller did not give it:

  --device cpu --attention-backend torch_native --disable-cuda-graph --sleep-on-idle
      (SGLANG_USE_CPU_ENGINE=1 picks SGLang's CPU code paths; the idle scheduler spins a core without
      --sleep-on-idle)
  --page-size 64 --max-total-tokens 16384 --max-mamba-cache-size 64 --max-running-requests 4
  --context-length 8192
      (SGLang sizes the pools from RAM by default: 6.7 GB of recurrent state and 22 s of allocation)
  --dtype float32, SGLANG_MAMBA_CONV_DTYPE=float32
      (the conv-state pool stays bf16 otherwise and the first fp32 extend fails, gdn_backend.py:1066)
  --hicache-io-backend direct --hicache-mem-layout page_first_direct   (with a host tier only)
      (the Mamba host pool takes page_first layouts only, pool_host/mamba.py:103; the transfer ops
      bound on CPU are the direct ones)
  --histate-device-pool static   (with --enable-histate only)
      (HiState's default unified pool implies SGLang's page-major KV layout, which torch_native does
      not read; the plugin refuses it with torch_native: docs/sglang.md. The unified pool runs on CPU
      with `--histate-device-pool unified --attention-backend triton`, which here is the translating
      stand-in `unified_attention.py`: test/server/test_unified_pool.py)

Stock SGLang and `--enable-histate` go through the same function, so they are launched the same way.
`python -m sglang_cpu.server.launch [SGLang flags]` runs one in the foreground (`make cpu-server`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from .checkpoint import ensure_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = Path(__file__).resolve().parent / "site"
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "cpu-server-model"

CPU_DEFAULTS = (
    ("--device", "cpu"), ("--attention-backend", "torch_native"), ("--disable-cuda-graph", None),
    ("--sleep-on-idle", None), ("--page-size", "64"), ("--max-total-tokens", "16384"),
    ("--max-mamba-cache-size", "64"), ("--max-running-requests", "4"), ("--context-length", "8192"),
    ("--host", "127.0.0.1"),
)
HOST_TIER_DEFAULTS = (("--hicache-io-backend", "direct"), ("--hicache-mem-layout", "page_first_direct"))
HOST_TIER_FLAGS = ("--enable-histate", "--enable-hierarchical-cache")
HISTATE_DEFAULTS = (("--histate-device-pool", "static"),)


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: Sequence[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def server_args(args: Sequence[str], model_dir: Path, port: int, dtype: str) -> list:
    """The caller's SGLang flags plus the CPU defaults it did not give."""
    out = list(args)
    defaults = list(CPU_DEFAULTS) + [("--model-path", str(model_dir)), ("--port", str(port)), ("--dtype", dtype)]
    if any(_given(args, flag) for flag in HOST_TIER_FLAGS):
        defaults += HOST_TIER_DEFAULTS
    if _given(args, "--enable-histate"):
        defaults += HISTATE_DEFAULTS
    for flag, value in defaults:
        if not _given(args, flag):
            out += [flag] if value is None else [flag, value]
    return out


def server_env(dtype: str, base: Optional[dict] = None) -> dict:
    """The environment every SGLang process of the server needs (inherited by spawned children)."""
    env = dict(os.environ if base is None else base)
    path = [str(SITE_DIR), str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update({
        "PYTHONPATH": os.pathsep.join(path),
        "HISTATE_CPU_SERVER": "1",
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    if dtype == "float32":
        env["SGLANG_MAMBA_CONV_DTYPE"] = "float32"
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerDied(RuntimeError):
    """The server exited (or never answered) before it was ready; the message ends with its log's tail."""


class CpuServer:
    """One SGLang server process group on 127.0.0.1, started by `start()`, stopped by `stop()`."""

    def __init__(self, args: Sequence[str] = (), *, log_path: Path, dtype: str = "float32",
                 model_dir: Optional[Path] = None, port: Optional[int] = None, env: Optional[dict] = None):
        self.dtype = dtype
        self.model_dir = Path(model_dir or DEFAULT_MODEL_DIR / dtype)
        self.port = port or free_port()
        self.args = server_args(args, self.model_dir, self.port, dtype)
        self.log_path = Path(log_path)
        self.extra_env = dict(env or {})
        self.process: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list:
        return [sys.executable, "-m", "sglang.launch_server", *self.args]

    def start(self, timeout_s: float = 300.0) -> "CpuServer":
        ensure_checkpoint(self.model_dir, self.dtype)
        env = server_env(self.dtype)
        env.update(self.extra_env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            cwd=str(REPO_ROOT), start_new_session=True)
        try:
            self._wait_ready(started + timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerDied(f"SGLang server exited with {self.process.returncode} before it was ready:\n"
                                 f"{self.log_tail()}")
            if self._answers("/health_generate"):
                return
            time.sleep(0.5)
        raise ServerDied(f"SGLang server not ready after its start-up deadline:\n{self.log_tail()}")

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as response:
                return response.status == 200
        except Exception:
            return False

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def child_pids(self, name_part: str) -> list:
        """PIDs in the server's process group whose command line contains `name_part` (SGLang names its
        processes with setproctitle: "sglang::scheduler", "sglang::detokenizer")."""
        import psutil

        pids = []
        for proc in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if name_part in " ".join(proc.cmdline()) or name_part in proc.name():
                    pids.append(proc.pid)
            except psutil.Error:
                continue
        return pids

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the group (SGLang's launcher ends its children), then SIGKILL what is left."""
        if self.process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait_s)
                time.sleep(0.2)
                os.killpg(self.process.pid, 0)  # children left in the group?
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.process = None

    def __enter__(self) -> "CpuServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Foreground server for a person to try (`make cpu-server ARGS="--enable-histate"`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    dtype = _value(args, "--dtype") or "float32"
    model_dir = Path(_value(args, "--model-path") or DEFAULT_MODEL_DIR / dtype)
    port = int(_value(args, "--port") or 30000)
    if not _given(args, "--model-path"):
        ensure_checkpoint(model_dir, dtype)
    full = server_args(args, model_dir, port, dtype)
    print(f"SGLang {'with HiState' if _given(args, '--enable-histate') else 'stock'} on CPU (tiny random "
          f"{dtype} Qwen3.5 at {model_dir}; stand-in kernels, docs/sglang.md). Try:\n"
          f"  curl -s http://127.0.0.1:{port}/generate -H 'Content-Type: application/json' "
          f"-d '{{\"text\": \"hello\", \"sampling_params\": {{\"max_new_tokens\": 8, \"temperature\": 0}}}}'",
          flush=True)
    os.execvpe(sys.executable, [sys.executable, "-m", "sglang.launch_server", *full], server_env(dtype))


if __name__ == "__main__":
    sys.exit(main())
