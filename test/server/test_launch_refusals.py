"""Configurations HiState does not accept end SGLang's launch with one line, before any weights load.

Run as users run it: `python -m sglang.launch_server` with the CPU server's environment. The case here
is the one only this machine shows: HiState's default device pool (unified: SGLang's page-major KV
layout) with SGLang's CPU attention backend (torch_native), which does not read KV through SGLang's
translator (issue 27, R3). Flag conflicts and unsupported models are driven in test/sglang
(test_plugin_cli.py, test_accepted_configs.py).
"""
from __future__ import annotations

import subprocess
import sys

from sglang_cpu.server.launch import DEFAULT_MODEL_DIR, free_port, server_args, server_env
from sglang_cpu.server.checkpoint import ensure_checkpoint


def test_the_unified_device_pool_with_a_cpu_attention_backend_is_refused_in_one_line():
    model_dir = ensure_checkpoint(DEFAULT_MODEL_DIR / "float32")
    args = server_args(["--enable-histate", "--histate-device-pool", "unified"], model_dir, free_port(), "float32")
    done = subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], env=server_env("float32"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = next(line for line in reversed(done.stderr.strip().splitlines()) if "error:" in line)
    assert "--histate-device-pool unified" in last and "torch_native" in last, last
    assert "Traceback" not in done.stderr
