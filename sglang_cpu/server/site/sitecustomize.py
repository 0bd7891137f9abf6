"""Runs the CPU-server shim at interpreter start in every process SGLang starts.

SGLang spawns its scheduler and detokenizer with multiprocessing "spawn", so each child needs the
stubs and patches before its first `import sglang`: a wrapper around `python -m sglang.launch_server`
would reach the launcher only. The launcher (`sglang_cpu.server.launch`) puts this directory first on
PYTHONPATH and sets HISTATE_CPU_SERVER=1; any other interpreter is left alone.
"""
import os

if os.environ.get("HISTATE_CPU_SERVER") == "1":
    from sglang_cpu.server import shim

    shim.install()
