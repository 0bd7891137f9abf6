"""In-pass capture on SGLang's own GDN extend kernels (GPU; `make test-gpu`, skipped without CUDA).

The CPU tests (test_capture.py) run SGLang's GDN backend with torch stand-ins for the extend kernel that
lay out their per-sequence states `h` as SGLang's Triton and FlashInfer kernels do. What only a GPU shows
is that the real kernels keep that promise: for every position the plugin would capture at a page size
(a multiple of max(64, page) from the pass start, `capture.capture_chunk_tokens`), the row of `h` it reads
is the state the same kernel leaves when the sequence ends there (a cold pass), and the neighbouring rows
are not. The rows come from the plugin's own code (`capture_forward.select_captures` / `HRows`) under the
plan actually given to the kernel:
  * Triton: no plan, one row per 64-token chunk whatever the page;
  * FlashInfer with SGLang's own plan (built by SGLang's `maybe_build_flashinfer_checkpoint_plan` for a
    tracked interior row, one checkpoint per `mamba_cache_chunk_size()` = max(64, page) tokens), whose
    tracked row is checked too;
  * FlashInfer with the plugin's plan (a pass where SGLang tracks no interior row).
Page sizes 64 and 256 (at 256, SGLang's FlashInfer plan has a row every 256 tokens: issue F1). Triton
keeps `h` in the activation dtype (bf16), so that comparison has bf16 tolerance; FlashInfer's checkpoints
are fp32.

    python -m pytest test/sglang/test_capture_gpu.py -q -m gpu    # in SGLang's CUDA environment
"""
from __future__ import annotations

import types

import pytest
import torch

from histate.sglang_plugin import capture_forward
from histate.sglang_plugin.capture_forward import FLASHINFER, TRITON, select_captures

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and SGLang's GDN kernels")]

CHUNK = 64
HEADS, DIM = 4, 128
LENGTHS = (200, 64, 130, 600, 1100)  # one extend pass: partial chunks, one exact chunk, several pages
TRACKED_ROW, TRACKED_AT = 3, 512  # SGLang's own interior tracked position (sequence 3, 512 tokens in)
TOLERANCE = {TRITON: dict(atol=3e-2, rtol=3e-2), FLASHINFER: dict(atol=1e-4, rtol=1e-4)}
SETUPS = [(TRITON, None), (FLASHINFER, "sglang"), (FLASHINFER, "histate")]


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


def _extend(kernel, q, k, v, g, beta, lengths, metadata=None):
    """One extend pass over `lengths` from zero states, under the checkpoint plan in `metadata` (if any);
    returns (h rows or None, the final state of each sequence)."""
    n = len(lengths)
    pool = torch.zeros(n + 1, HEADS, DIM, DIM, dtype=torch.float32, device="cuda")  # slot 0: SGLang's dummy
    cache_indices = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    extra = {}
    if metadata is not None and metadata.num_state_checkpoints:
        extra = dict(state_checkpoint_cu_starts=metadata.state_checkpoint_cu_starts,
                     num_state_checkpoints=metadata.num_state_checkpoints,
                     state_checkpoint_every_n_tokens=metadata.state_checkpoint_every_n_tokens)
    _, _, h = kernel.extend(q, k, v, g, beta, ssm_states=pool, cache_indices=cache_indices, query_start_loc=cu,
                            **extra)
    return (None if h is None else h.squeeze(0).float()), pool[1:].clone()


def _metadata(plan: str, grid: int):
    """The forward metadata the plugin's hook sees: SGLang's own FlashInfer plan for an interior tracked row
    (gdn_flashinfer.py:80-118, SGLang's code), or none (the plugin builds its own)."""
    metadata = types.SimpleNamespace(num_state_checkpoints=0, track_ssm_h_src=None)
    if plan == "sglang":
        from sglang.srt.layers.attention.linear.kernels.gdn_flashinfer import maybe_build_flashinfer_checkpoint_plan

        n = len(LENGTHS)
        forward_batch = types.SimpleNamespace(
            extend_seq_lens=torch.tensor(LENGTHS), extend_prefix_lens=torch.zeros(n, dtype=torch.int64),
            mamba_track_mask=torch.arange(n) == TRACKED_ROW,
            mamba_track_seqlens=torch.full((n,), TRACKED_AT + 1))  # schedule_batch.py:3149-3163: p + 1
        metadata.track_ssm_h_src, metadata.track_ssm_h_dst = torch.zeros(1), torch.zeros(1)
        maybe_build_flashinfer_checkpoint_plan(forward_batch, metadata, "cuda")
        assert metadata.state_checkpoint_every_n_tokens == grid
    return metadata


@pytest.mark.parametrize("page", [64, 256])
@pytest.mark.parametrize("layout,plan", SETUPS)
def test_the_rows_the_plugin_reads_are_the_states_at_those_positions(monkeypatch, layout, plan, page):
    import sglang.srt.layers.attention.linear.kernels.gdn_flashinfer as gdn_flashinfer
    import sglang.srt.runtime_context as runtime_context

    grid = max(CHUNK, page)  # SGLang's mamba_cache_chunk_size() (arg_groups/overrides.py:1897-1925)
    monkeypatch.setattr(gdn_flashinfer, "mamba_cache_chunk_size", lambda: grid)
    monkeypatch.setattr(runtime_context, "mamba_cache_chunk_size", lambda: grid)
    kernel = _kernel(layout)
    q, k, v, g, beta = _inputs(LENGTHS)
    metadata = _metadata(plan, grid)
    backend = types.SimpleNamespace(mamba_chunk_size=CHUNK, device="cuda", kernel_dispatcher=types.SimpleNamespace(
        extend_uses_state_checkpoints=layout == FLASHINFER))
    wanted = [(row, relative, None) for row, length in enumerate(LENGTHS)
              for relative in range(grid, length, grid)]  # every capture position strictly inside a sequence
    rows, held, dropped = select_captures(backend, metadata, wanted, list(LENGTHS))
    assert held == wanted and not dropped
    assert rows.spacing == (CHUNK if layout == TRITON else grid)
    h, _ = _extend(kernel, q, k, v, g, beta, LENGTHS, metadata)
    assert h is not None and h.shape[0] == rows.num_rows  # the rows the plugin's hook checks before copying
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    checks = [(row, relative) for row, relative, _ in held]
    if plan == "sglang":  # SGLang's own tracked row, read through its own index
        assert metadata.track_ssm_h_src.tolist() == [rows.index(TRACKED_ROW, TRACKED_AT)]
        checks.append((TRACKED_ROW, TRACKED_AT))
    for row, relative in checks:
        lo = starts[row]
        _, cold = _extend(kernel, *[t[:, lo:lo + relative] for t in (q, k, v, g, beta)], [relative])
        index = rows.index(row, relative)
        torch.testing.assert_close(h[index], cold[0], **TOLERANCE[layout])
        for neighbour in (index - 1, index + 1):  # the check can fail: an off-by-one row differs
            if rows.offsets[row] <= neighbour < rows.offsets[row + 1]:
                assert not torch.allclose(h[neighbour], cold[0], **TOLERANCE[layout])
    assert len(held) == sum((length - 1) // grid for length in LENGTHS) == {64: 3 + 0 + 2 + 9 + 17, 256: 6}[page]
    assert capture_forward.HRows.of_plan(metadata, list(LENGTHS)) == (rows if layout == FLASHINFER else None)
