"""In-pass capture on SGLang's own GDN extend kernels (GPU; `make test-gpu`, skipped without CUDA).

The CPU tests (test_capture.py) run SGLang's GDN backend with a torch stand-in for the extend kernel
that lays out its per-chunk states `h` as SGLang's Triton kernel does. What only a GPU shows is that the
real kernels keep that promise: for every position the plugin would capture, the row of `h` it reads
(`capture_forward.h_rows` / `h_index`, per kernel layout) is the state the same kernel leaves when the
sequence ends there (a cold pass), and the neighbouring rows are not. Triton keeps `h` in the
activation dtype (bf16), so that comparison has bf16 tolerance; FlashInfer's checkpoints are fp32.

    python -m pytest test/sglang/test_capture_gpu.py -q -m gpu    # in SGLang's CUDA environment
"""
from __future__ import annotations

import pytest
import torch

from histate.sglang_plugin.capture_forward import FLASHINFER, TRITON, ensure_checkpoint_plan, h_index, h_rows

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and SGLang's GDN kernels")]

CHUNK = 64
HEADS, DIM = 4, 128
LENGTHS = (200, 64, 130, 512)  # a batch of one extend pass: partial chunks, one exact chunk, several chunks
TOLERANCE = {TRITON: dict(atol=3e-2, rtol=3e-2), FLASHINFER: dict(atol=1e-4, rtol=1e-4)}


def _kernel(layout: str):
    try:
        if layout == TRITON:
            from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel

            return TritonGDNKernel()
        from sglang.srt.layers.attention.linear.kernels.gdn_flashinfer import FlashInferGDNKernel

        return FlashInferGDNKernel()
    except Exception as err:  # not installed, or not supported on this GPU
        pytest.skip(f"{layout} GDN kernel unavailable here: {err}")


def _inputs(lengths, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q = randn(1, total, HEADS, DIM).to(torch.bfloat16)
    k = randn(1, total, HEADS, DIM).to(torch.bfloat16)
    v = randn(1, total, HEADS, DIM).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(randn(1, total, HEADS)).float()
    beta = torch.sigmoid(randn(1, total, HEADS)).float()
    return q, k, v, g, beta


def _extend(kernel, layout, q, k, v, g, beta, lengths):
    """One extend pass over `lengths` from zero states; returns (h rows, the final state of each sequence)."""
    n = len(lengths)
    pool = torch.zeros(n + 1, HEADS, DIM, DIM, dtype=torch.float32, device="cuda")  # slot 0: SGLang's dummy
    cache_indices = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    extra = {}
    if layout == FLASHINFER:
        plan = type("Plan", (), {})()
        ensure_checkpoint_plan(plan, list(lengths), CHUNK, "cuda")  # the plan the plugin builds
        extra = dict(state_checkpoint_cu_starts=plan.state_checkpoint_cu_starts,
                     num_state_checkpoints=plan.num_state_checkpoints,
                     state_checkpoint_every_n_tokens=plan.state_checkpoint_every_n_tokens)
    _, _, h = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=cache_indices, query_start_loc=cu,
                            **extra)
    assert h is not None, f"{layout} returned no per-chunk states"
    return h.squeeze(0).float(), pool[1:].clone()


@pytest.mark.parametrize("layout", [TRITON, FLASHINFER])
def test_the_rows_the_plugin_reads_are_the_states_at_those_positions(layout):
    kernel = _kernel(layout)
    q, k, v, g, beta = _inputs(LENGTHS)
    h, _ = _extend(kernel, layout, q, k, v, g, beta, LENGTHS)
    rows = h_rows(layout, LENGTHS, CHUNK)
    assert h.shape[0] == sum(rows)  # the layout's row count (a kernel that breaks it is refused in the server)
    offsets = [0, *torch.tensor(rows).cumsum(0).tolist()]
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    checked = 0
    for row, length in enumerate(LENGTHS):
        for relative in range(CHUNK, length, CHUNK):  # every grid position strictly inside the sequence
            lo = starts[row]
            cold_inputs = [t[:, lo:lo + relative] for t in (q, k, v, g, beta)]
            _, cold = _extend(kernel, layout, *cold_inputs, [relative])
            index = h_index(layout, offsets, row, relative, CHUNK)
            torch.testing.assert_close(h[index], cold[0], **TOLERANCE[layout])
            for neighbour in (index - 1, index + 1):  # the check can fail: an off-by-one row differs
                if offsets[row] <= neighbour < offsets[row + 1]:
                    assert not torch.allclose(h[neighbour], cold[0], **TOLERANCE[layout])
            checked += 1
    assert checked == 3 + 0 + 2 + 7
