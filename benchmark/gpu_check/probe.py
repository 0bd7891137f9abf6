"""Which of SGLang's import chains work on this machine, and the first module each one misses.

Each target is imported in a fresh interpreter (an import that fails half-way leaves a process in a
state no later import should inherit), all at once, each with a time limit. Prints one line per target
and, with --tsv, appends them to a run.sh step file. Informational: the GPU check itself only needs the
fla kernel chain (capture_check.py loads it directly when SGLang's package import fails).

    python benchmark/gpu_check/probe.py [--tsv PATH] [--timeout S]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

# (target, what it tells)
TARGETS = (
    ("torch.cuda", "CUDA torch"),
    ("triton", "Triton (JIT kernels)"),
    ("einops", "used by SGLang's fla chunk kernel"),
    ("sglang.kernels.ops.attention.fla.chunk", "the Triton GDN prefill kernel through SGLang's package"),
    ("sglang.srt.layers.attention.linear.kernels.gdn_triton", "TritonGDNKernel (what the server calls)"),
    ("histate.sglang_plugin.capture_forward", "HiState's capture indices"),
    ("histate_kernels", "sgl-kernel-ext"),
    ("sgl_kernel", "SGLang's CUDA kernels (373 MB, not carried: the server cannot run here)"),
    ("flashinfer", "FlashInfer (not carried)"),
)

SNIPPET = """
import importlib, sys
name = sys.argv[1]
try:
    module = importlib.import_module(name)
    if name == "torch.cuda":
        import torch
        ok = torch.cuda.is_available()
        print(("ok " if ok else "") + f"torch {torch.__version__}, CUDA {torch.version.cuda}, " +
              (torch.cuda.get_device_name(0) if ok else "NO CUDA DEVICE"))
        status = 0 if ok else 1
    else:
        print("ok " + str(getattr(module, "__version__", "")))
        status = 0
except ModuleNotFoundError as err:
    print(f"missing module {err.name!r}")
    sys.exit(1)
except BaseException as err:
    print(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    status = 1
sys.exit(status)
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tsv", help="append 'import: TARGET<TAB>ok|missing<TAB>seconds<TAB>detail' lines here")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    started = time.perf_counter()
    procs = [(target, why, subprocess.Popen([sys.executable, "-c", SNIPPET, target], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True))
             for target, why in TARGETS]
    lines = []
    for target, why, proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, args.timeout - (time.perf_counter() - started)))
            status = "ok" if proc.returncode == 0 else "missing"
            detail = (out.strip().splitlines() or ["(no output)"])[-1]
            if detail.startswith("ok"):
                detail = detail[2:].strip()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            status, detail = "missing", f"import did not finish in {args.timeout:.0f} s"
        detail = f"{detail} -- {why}" if detail else why
        lines.append(f"import: {target}\t{status}\t\t{detail}")
        print(f"{status:>8}  {target}: {detail}")
    if args.tsv:
        with open(args.tsv, "a") as fh:
            fh.write("".join(line.replace("\n", " ") + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
