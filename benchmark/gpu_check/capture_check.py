"""SGLang's Triton GDN extend kernel under HiState's in-pass capture (GPU), with a CPU dry path.

HiState fills a capture slot from row `h[h_index(...)]` (`HRows.index` where the plugin has it) of the
per-chunk states that SGLang's Triton extend kernel returns (`capture_forward.track_extend_around`, cast to the state pool's dtype). That is
only right if the row is the state the same kernel leaves when a sequence ends at that position. For a
batch of sequences of assorted lengths (half starting from a zero state, half resuming from a prefix
state), each activation/state dtype and page size 64 and 256, this script:

  * runs one extend pass over the batch and checks `h` has the rows the Triton layout promises
    (`h_rows`: the server refuses a pass otherwise);
  * for every position the plugin can capture (multiples of the state grid lcm(64, page size), strictly
    inside a sequence) runs a cold pass of that sequence's prefix ending there, from the same initial
    state, and compares the pool row it leaves with the row HiState would copy; reports the largest
    absolute error;
  * checks the neighbouring rows (one 64-token chunk before / after) do NOT match, so an off-by-one
    index cannot pass.

The kernel (GPU): `TritonGDNKernel.extend` when SGLang's package imports here; otherwise the module it
calls, `sglang.kernels.ops.attention.fla.chunk`, loaded on its own (its package `__init__`s and
`sglang.srt.utils.common`, which need SGLang's server dependencies, are not run: the fla modules read one
name from `common`, `torch_release`, provided with SGLang's own definition) and called with the
arguments `TritonGDNKernel.extend` passes. A kernel that cannot load is a skip with its reason (exit 2).
SGLang's kernel refuses float32 activations (an assert); that row reads "refused".

`--dry-run` runs the same harness on CPU with the torch stand-in of the kernel
(sglang_cpu/gdn_kernels.py, Triton's `h` layout), in float32 compute (CPU torch has no bf16 triangular
solve): bf16 activations are rounded to bf16 on input and `h` is stored in bf16, as Triton stores it.

    python benchmark/gpu_check/capture_check.py [--dry-run] [--json PATH] [--md PATH]

Exit: 0 every row passed (or was refused as documented), 1 a row failed, 2 skipped (no CUDA / no kernel).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # sglang_cpu (the dry path's stand-in) lives at the repository root
try:
    import histate  # noqa: F401
except ImportError:  # not installed (a device whose editable install failed): use the source tree
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from histate.sglang_plugin import capture_forward  # noqa: E402
from histate.sglang_plugin.capture_forward import TRITON, h_index, h_rows  # noqa: E402

KERNEL_CHUNK = 64  # Gated-DeltaNet's mamba_chunk_size: h has one row per 64-token chunk (Triton layout)
PAGE_SIZES = (64, 256)
LENGTHS = (1030, 64, 200, 513, 256, 770, 33, 320)  # partial chunks, exact chunks, one-chunk, sub-chunk
RESUMED = (True, False, True, False, True, True, False, False)  # passes starting from a prefix state
# (activation dtype, state pool dtype): SGLang's default pool is fp32 (--mamba-ssm-dtype), bf16 is allowed
DTYPE_CASES = (("bfloat16", "float32"), ("bfloat16", "bfloat16"), ("float32", "float32"))
# allclose-style |a - b| <= atol + rtol * |b|. Triton stores h in the activation dtype, so a bf16 pass's
# row carries bf16 rounding (2^-9 relative) that the cold pass's fp32 final state does not.
TOLERANCE = {"bfloat16": dict(atol=1e-2, rtol=1e-2), "float32": dict(atol=1e-5, rtol=1e-5)}
SHAPES = {"gpu": dict(k_heads=8, v_heads=16, dim=128), "dry": dict(k_heads=1, v_heads=2, dim=32)}


class KernelUnavailable(Exception):
    """The kernel cannot run here; the message is the skip reason."""


@dataclass
class Row:
    case: str
    dtype: str
    page_size: str
    max_error: str
    result: str  # pass | FAIL | refused | skip
    detail: str


# --- kernels -----------------------------------------------------------------------------------

def _missing(err: BaseException) -> str:
    if isinstance(err, ModuleNotFoundError) and err.name:
        return f"missing module {err.name!r}"
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _purge_sglang() -> None:
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def _fla_direct() -> types.ModuleType:
    """`sglang.kernels.ops.attention.fla.chunk` without running SGLang's package `__init__`s.

    The chunk kernel's closure (chunk, chunk_delta_h, chunk_fwd, wy_fast, chunk_o, cumsum, index, l2norm,
    op, utils) needs torch, triton, einops, packaging and, from SGLang, only
    `sglang.srt.utils.common.torch_release`; `sglang/__init__.py`, `sglang/kernels/__init__.py`,
    `sglang/kernels/ops/__init__.py` and `sglang/srt/utils/__init__.py` import SGLang's server
    dependencies (orjson, msgspec, starlette, ...), which a GPU box without SGLang's install lacks."""
    spec = importlib.util.find_spec("sglang")  # locates the package without executing it
    if spec is None or not spec.submodule_search_locations:
        raise KernelUnavailable("sglang is not installed (run.sh installs .whl/sglang-*.whl)")
    root = Path(list(spec.submodule_search_locations)[0])
    _purge_sglang()
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention",
                 "sglang.kernels.ops.attention.fla", "sglang.srt", "sglang.srt.utils"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    from packaging import version as pkg_version

    common = types.ModuleType("sglang.srt.utils.common")
    common.torch_release = pkg_version.parse(torch.__version__).release  # srt/utils/common.py's definition
    sys.modules["sglang.srt.utils.common"] = common
    return importlib.import_module("sglang.kernels.ops.attention.fla.chunk")


def load_triton_extend() -> tuple[Callable, str]:
    """SGLang's Triton GDN extend as `extend(q, k, v, g, beta, pool, cache_indices, cu) -> h`, and a label."""
    if not torch.cuda.is_available():
        raise KernelUnavailable("no CUDA device (use --dry-run on CPU)")
    mode = os.environ.get("GPU_CHECK_IMPORT", "auto")  # auto | package | direct
    package_reason = "not tried (GPU_CHECK_IMPORT=direct)"
    if mode in ("auto", "package"):
        try:
            from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

            kernel = TritonGDNKernel()

            def extend(q, k, v, g, beta, pool, cache_indices, cu):
                _, _, h = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=cache_indices,
                                        query_start_loc=cu)
                return h

            return extend, "SGLang's TritonGDNKernel.extend (gdn_triton.py, full package import)"
        except Exception as err:  # noqa: BLE001 - any failure of SGLang's import chain is a reason to report
            package_reason = _missing(err)
            _purge_sglang()
            if mode == "package":
                raise KernelUnavailable(f"SGLang's gdn_triton does not import here: {package_reason}") from err
    try:
        chunk = _fla_direct()
    except KernelUnavailable:
        raise
    except Exception as err:  # noqa: BLE001
        raise KernelUnavailable(f"SGLang's fla chunk kernel does not import here: {_missing(err)} "
                                f"(the full package import failed too: {package_reason})") from err

    def extend(q, k, v, g, beta, pool, cache_indices, cu):
        # exactly the call TritonGDNKernel.extend makes on CUDA (gdn_triton.py)
        _, _, h = chunk.chunk_gated_delta_rule(
            q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu, head_first=False,
            use_qk_l2norm_in_kernel=True, initial_state_indices=cache_indices, inplace_update=True)
        return h

    return extend, ("SGLang's fla chunk_gated_delta_rule (kernels/ops/attention/fla/chunk.py, loaded directly; "
                    f"TritonGDNKernel not importable here: {package_reason})")


def load_standin_extend() -> tuple[Callable, str]:
    from sglang_cpu import gdn_kernels

    def extend(q, k, v, g, beta, pool, cache_indices, cu):
        act = q.dtype
        if act == torch.float32:
            compute = act
        else:  # CPU torch has no bf16 triangular solve: compute in fp32 on the bf16-rounded inputs
            compute = torch.float32
        _, _, h = gdn_kernels.chunk_gated_delta_rule(
            q.to(compute), k.to(compute), v.to(compute), g, beta, initial_state=pool,
            initial_state_indices=cache_indices, cu_seqlens=cu, head_first=False,
            use_qk_l2norm_in_kernel=True, inplace_update=True)
        return h.to(act)  # Triton keeps h in the activation dtype

    return extend, "STAND-IN: torch stand-in of the kernel (sglang_cpu/gdn_kernels.py, CPU), not SGLang's Triton kernel"


# --- harness -----------------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _short(name: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}[name]


def make_inputs(lengths, act: torch.dtype, state: torch.dtype, shape: dict, device: str, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total, hk, hv, d = sum(lengths), shape["k_heads"], shape["v_heads"], shape["dim"]

    def randn(*size):
        return torch.randn(*size, generator=gen)

    q = randn(1, total, hk, d).to(act)
    k = randn(1, total, hk, d).to(act)
    v = randn(1, total, hv, d).to(act)
    # SGLang's gates are fp32 (fused_gdn_gating); log-decays around -0.05 per token keep a state alive
    # for a few chunks, so resumed states and neighbouring chunks both matter
    g = torch.nn.functional.logsigmoid(randn(1, total, hv) + 3.0).float()
    beta = torch.sigmoid(randn(1, total, hv)).float()
    # slot 0 is SGLang's dummy slot; sequence i uses slot i + 1
    init = torch.zeros(len(lengths) + 1, hv, d, d)
    for i, resumed in enumerate(RESUMED[:len(lengths)]):
        if resumed:
            init[i + 1] = 0.1 * randn(hv, d, d)
    tensors = [t.to(device) for t in (q, k, v, g, beta)]
    return (*tensors, init.to(device=device, dtype=state))


def _cu(lengths, device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def plugin_rows(lengths) -> tuple[list, Callable]:
    """The Triton rows of `h` as the plugin reads them: (offsets, index(row, relative) -> row or None).
    `HRows` is what `build_indices` uses where the plugin has it; `h_rows` / `h_index` must agree."""
    offsets = [0, *torch.tensor(h_rows(TRITON, list(lengths), KERNEL_CHUNK)).cumsum(0).tolist()]

    def by_functions(row: int, relative: int) -> int:
        return h_index(TRITON, offsets, row, relative, KERNEL_CHUNK)

    rows_class = getattr(capture_forward, "HRows", None)
    if rows_class is None:
        return offsets, by_functions
    rows = rows_class.triton(list(lengths), KERNEL_CHUNK)
    if list(rows.offsets) != offsets:
        raise AssertionError(f"HRows.triton offsets {list(rows.offsets)} != h_rows' {offsets}")

    def by_rows(row: int, relative: int) -> Optional[int]:
        index = rows.index(row, relative)
        if index is not None and index != by_functions(row, relative):
            raise AssertionError(f"HRows.index({row}, {relative}) = {index} != h_index's {by_functions(row, relative)}")
        return index

    return offsets, by_rows


def check_case(extend: Callable, lengths, act_name: str, state_name: str, page: int, shape: dict,
               device: str, seed: int) -> Row:
    act, state = _dtype(act_name), _dtype(state_name)
    grid = math.lcm(KERNEL_CHUNK, page)
    dtype_label = f"{_short(act_name)} (state {_short(state_name)})"
    page_label = f"{page} (grid {grid})"
    positions = [(row, rel) for row, n in enumerate(lengths) for rel in range(grid, n, grid)]
    case = f"{len(lengths)} seqs ({min(lengths)}-{max(lengths)} tok), {len(positions)} positions"
    q, k, v, g, beta, init = make_inputs(lengths, act, state, shape, device, seed)
    n = len(lengths)
    indices = torch.arange(1, n + 1, dtype=torch.int32, device=device)
    pool = init.clone()
    try:
        h = extend(q, k, v, g, beta, pool, indices, _cu(lengths, device))
    except AssertionError as err:
        if act == torch.float32 and "float32" in str(err):
            return Row(case, dtype_label, page_label, "-", "refused",
                       f"SGLang's kernel asserts: {str(err).strip()} (never called with fp32 activations)")
        raise
    if h is None:
        return Row(case, dtype_label, page_label, "-", "FAIL", "the kernel returned no per-chunk states (h is None)")
    rows = h.squeeze(0)  # what track_extend_around reads
    offsets, plugin_index = plugin_rows(lengths)
    if rows.shape[0] != offsets[-1] or tuple(rows.shape[1:]) != tuple(init.shape[1:]):
        return Row(case, dtype_label, page_label, "-", "FAIL",
                   f"h has shape {tuple(rows.shape)}; the Triton layout promises ({offsets[-1]}, "
                   f"{', '.join(map(str, init.shape[1:]))}) (the server would refuse every capture)")
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    tol = TOLERANCE[act_name if act_name in TOLERANCE else "bfloat16"]
    worst, failures, neighbour_gap, neighbours = 0.0, [], math.inf, 0
    one = torch.ones(1, dtype=torch.int32, device=device)
    for row, relative in positions:
        lo = starts[row]
        cold_pool = torch.zeros_like(init[:2])
        cold_pool[1] = init[row + 1]
        cold_inputs = [t[:, lo:lo + relative] for t in (q, k, v, g, beta)]
        extend(*cold_inputs, cold_pool, one, _cu([relative], device))
        cold = cold_pool[1].float()
        index = plugin_index(row, relative)
        if index is None:
            failures.append(f"seq {row} @ {relative}: the plugin finds no row of h there (it would drop the capture)")
            continue
        captured = rows[index].to(state).float()  # the copy HiState makes into the capture slot
        error = (captured - cold).abs().max().item()
        worst = max(worst, error)
        if not torch.allclose(captured, cold, **tol):
            failures.append(f"seq {row} @ {relative}: max err {error:.2e}")
        for neighbour in (index - 1, index + 1):  # an off-by-one row must not pass
            if offsets[row] <= neighbour < offsets[row + 1]:
                other = rows[neighbour].to(state).float()
                neighbours += 1
                neighbour_gap = min(neighbour_gap, (other - cold).abs().max().item())
                if torch.allclose(other, cold, **tol):
                    failures.append(f"seq {row} @ {relative}: neighbour row {neighbour} matches too")
    if not positions:
        return Row(case, dtype_label, page_label, "-", "FAIL", "no capture position in the batch (bad case)")
    tol_text = f"atol {tol['atol']:g}, rtol {tol['rtol']:g}"
    if failures:
        more = f" (+{len(failures) - 3} more)" if len(failures) > 3 else ""
        return Row(case, dtype_label, page_label, f"{worst:.2e}", "FAIL", "; ".join(failures[:3]) + more + f"; {tol_text}")
    return Row(case, dtype_label, page_label, f"{worst:.2e}", "pass",
               f"{tol_text}; h rows {rows.shape[0]} = layout; {neighbours} neighbour rows differ "
               f"(min max-diff {neighbour_gap:.2e})")


def time_project_kernels() -> list[Row]:
    """sgl-kernel-ext's gather_states (per-chunk states into pool slots): Triton vs its torch reference."""
    try:
        import histate_kernels
    except Exception as err:  # noqa: BLE001
        return [Row("sgl-kernel-ext gather_states", "-", "-", "-", "skip", f"histate_kernels: {_missing(err)}")]
    if not histate_kernels.triton_available():
        return [Row("sgl-kernel-ext gather_states", "-", "-", "-", "skip", "triton/CUDA unavailable")]
    out = []
    layers, chunks, slots, heads, dim = 4, 32, 16, 16, 128
    gen = torch.Generator(device="cpu").manual_seed(3)
    src = torch.randn(layers, chunks, heads, dim, dim, generator=gen).cuda()
    src_index = torch.tensor([3, 0, 31, 17, 8, 9, 22, 5], device="cuda")
    dst_index = torch.tensor([1, 15, 4, 7, 0, 2, 11, 9], device="cuda")
    for dst_dtype in (torch.float32, torch.bfloat16):
        times, results = {}, {}
        try:
            for backend in ("triton", "torch"):
                dst = torch.zeros(layers, slots, heads, dim, dim, dtype=dst_dtype, device="cuda")
                for _ in range(3):
                    histate_kernels.gather_states(src, src_index, dst, dst_index, backend=backend)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    histate_kernels.gather_states(src, src_index, dst, dst_index, backend=backend)
                end.record()
                torch.cuda.synchronize()
                times[backend] = start.elapsed_time(end) / 20
                results[backend] = dst
            error = (results["triton"].float() - results["torch"].float()).abs().max().item()
            row_elems = src_index.numel() * layers * heads * dim * dim
            moved = row_elems * (src.element_size() + results["triton"].element_size()) / 1e9  # GB read + written
            out.append(Row(f"sgl-kernel-ext gather_states: {src_index.numel()} rows x {layers} layers",
                           f"fp32 -> {_short(str(dst_dtype).split('.')[-1])}", "-", f"{error:.2e}",
                           "pass" if error == 0 else "FAIL",
                           f"triton {times['triton'] * 1e3:.1f} us, torch {times['torch'] * 1e3:.1f} us "
                           f"({moved / (times['triton'] / 1e3):.0f} GB/s); results identical"
                           if error == 0 else "triton and torch backends disagree"))
        except Exception as err:  # noqa: BLE001
            out.append(Row("sgl-kernel-ext gather_states", str(dst_dtype), "-", "-", "FAIL", _missing(err)))
    return out


def render(rows: list[Row], label: str) -> str:
    lines = [f"Kernel: {label}", "",
             "| case | dtype | page size | max error | result | detail |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.case} | {r.dtype} | {r.page_size} | {r.max_error} | {r.result} | {r.detail} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: the torch stand-in instead of SGLang's Triton kernel")
    parser.add_argument("--json", type=Path, help="write {label, rows} here")
    parser.add_argument("--md", type=Path, help="write the markdown table here")
    parser.add_argument("--no-timing", action="store_true", help="skip timing sgl-kernel-ext's kernels")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    if args.dry_run:
        torch.set_num_threads(1)  # tiny tensors: more threads only spin-wait (10x slower on a busy 2-core box)
        extend, label = load_standin_extend()
        shape, device = SHAPES["dry"], "cpu"
    else:
        shape, device = SHAPES["gpu"], "cuda"
        try:
            extend, label = load_triton_extend()
        except KernelUnavailable as err:
            rows = [Row("SGLang Triton GDN extend", "-", "-", "-", "skip", str(err))]
            label = "none"
            return _finish(args, rows, label, started, code=2)
    rows = []
    for page in PAGE_SIZES:
        for seed, (act_name, state_name) in enumerate(DTYPE_CASES):
            try:
                rows.append(check_case(extend, LENGTHS, act_name, state_name, page, shape, device, seed))
            except Exception as err:  # noqa: BLE001 - one broken case must not hide the others
                rows.append(Row(f"{len(LENGTHS)} seqs", f"{_short(act_name)} (state {_short(state_name)})",
                                str(page), "-", "FAIL", f"raised {_missing(err)}"))
            print(f"  {rows[-1].dtype:>18} page {page:>3}: {rows[-1].result} {rows[-1].max_error}",
                  file=sys.stderr, flush=True)
    if not args.dry_run and not args.no_timing:
        rows.extend(time_project_kernels())
    code = 1 if any(r.result == "FAIL" for r in rows) else 0
    return _finish(args, rows, label, started, code)


def _finish(args, rows: list[Row], label: str, started: float, code: int) -> int:
    table = render(rows, label)
    print(table)
    print(f"\n{sum(r.result == 'pass' for r in rows)} passed, {sum(r.result == 'FAIL' for r in rows)} failed, "
          f"{sum(r.result in ('skip', 'refused') for r in rows)} skipped/refused in {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"label": label, "dry_run": bool(args.dry_run), "exit": code,
                                         "rows": [asdict(r) for r in rows]}, indent=1))
    if args.md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
