"""sgl-kernel-ext: gather per-chunk states into pool slots, pack/unpack one checkpoint for one I/O.

CPU tests pin the torch reference's semantics; tests marked `gpu` compare the Triton kernels with it
and are skipped without CUDA + triton (`make test-gpu` on a GPU machine).
"""
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
histate_kernels = pytest.importorskip("histate_kernels")

from histate_kernels import REGION_ALIGN_BYTES, CheckpointLayout, gather_states, pack_slot, unpack_slot  # noqa: E402



def gpu_only(test):
    """Marked `gpu` (selected by `make test-gpu`) and skipped unless CUDA and triton are present."""
    skip = pytest.mark.skipif(not histate_kernels.triton_available(), reason="needs CUDA and triton")
    return pytest.mark.gpu(skip(test))


def _pools(device="cpu", num_slots=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(6, num_slots, 256, 3, generator=g).to(torch.bfloat16)
    ssm = torch.randn(6, num_slots, 4, 32, 32, generator=g)
    return {"conv": conv.to(device), "ssm": ssm.to(device)}


def _chunk_states(num_chunks=9, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, num_chunks, 4, 32, 32, generator=g).to(dtype)


# --- torch reference (CPU) ---------------------------------------------------------------------

@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.float64, torch.float32)])
def test_gather_copies_chosen_chunks_into_chosen_slots_with_conversion(src_dtype, dst_dtype):
    src = _chunk_states(dtype=src_dtype)
    dst = torch.full((6, 7, 4, 32, 32), -7.0, dtype=dst_dtype)
    gather_states(src, torch.tensor([8, 0, 3]), dst, torch.tensor([2, 6, 0]))
    for chunk, slot in ((8, 2), (0, 6), (3, 0)):
        assert torch.equal(dst[:, slot], src[:, chunk].to(dst_dtype))
    for untouched in (1, 3, 4, 5):
        assert bool((dst[:, untouched] == -7.0).all())


def test_gather_rejects_bad_indices_without_writing():
    src, dst = _chunk_states(), torch.zeros(6, 4, 4, 32, 32)
    with pytest.raises(IndexError):
        gather_states(src, torch.tensor([9]), dst, torch.tensor([0]))
    with pytest.raises(IndexError):
        gather_states(src, torch.tensor([0]), dst, torch.tensor([4]))
    with pytest.raises(ValueError, match="duplicates"):
        gather_states(src, torch.tensor([0, 1]), dst, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="outside the row dimension"):
        gather_states(src, torch.tensor([0]), torch.zeros(6, 4, 4, 32, 16), torch.tensor([0]))
    assert not dst.any()


def test_layout_aligns_regions_and_sizes_a_checkpoint():
    layout = CheckpointLayout.for_pools(_pools())
    conv, ssm = layout.regions
    assert (conv.offset_bytes, conv.size_bytes) == (0, 6 * 256 * 3 * 2)
    assert ssm.offset_bytes == 9216 and ssm.offset_bytes % REGION_ALIGN_BYTES == 0
    assert layout.size_bytes == 9216 + 6 * 4 * 32 * 32 * 4


def test_pack_then_unpack_round_trips_byte_exact_into_another_slot():
    pools = _pools()
    layout = CheckpointLayout.for_pools(pools)
    packed = pack_slot(pools, 3, layout)
    assert packed.dtype == torch.uint8 and packed.numel() == layout.size_bytes
    assert torch.equal(layout.view(packed, "conv"), pools["conv"][:, 3])
    assert torch.equal(layout.view(packed, "ssm"), pools["ssm"][:, 3])
    unpack_slot(packed, layout, pools, 0)
    for name in pools:
        assert torch.equal(pools[name][:, 0].view(torch.uint8), pools[name][:, 3].view(torch.uint8))
    assert torch.equal(pack_slot(pools, 0, layout), packed)  # padding is zero: equal states, equal bytes


def test_pack_checks_the_pools_against_the_layout():
    pools = _pools()
    layout = CheckpointLayout.for_pools(pools)
    with pytest.raises(ValueError, match="layout expects"):
        pack_slot({"conv": pools["conv"].float(), "ssm": pools["ssm"]}, 0, layout)
    with pytest.raises(IndexError):
        pack_slot(pools, 5, layout)
    with pytest.raises(ValueError, match="bytes"):
        unpack_slot(torch.zeros(layout.size_bytes - 1, dtype=torch.uint8), layout, pools, 0)


def test_cpu_path_never_imports_triton():
    """In a fresh interpreter (other suites install a triton stub in this one): import, run every op on
    CPU tensors, and triton is still not imported; asking for the triton backend is a clear error."""
    script = """
import sys, torch, histate_kernels as hk
pools = {"conv": torch.zeros(2, 3, 8, 3), "ssm": torch.zeros(2, 3, 4, 4)}
layout = hk.CheckpointLayout.for_pools(pools)
hk.gather_states(torch.ones(2, 5, 4, 4), torch.tensor([1]), pools["ssm"], torch.tensor([2]))
hk.unpack_slot(hk.pack_slot(pools, 2, layout), layout, pools, 0)
assert "triton" not in sys.modules, "triton was imported on the CPU path"
try:
    hk.gather_states(torch.ones(2, 5, 4, 4), torch.tensor([1]), pools["ssm"], torch.tensor([2]), backend="triton")
except RuntimeError as exc:
    assert "triton" in str(exc)
else:
    assert hk.triton_available()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# --- Triton (CUDA) vs the reference --------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.float64, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("transpose_src", [False, True])
def test_triton_gather_equals_reference(src_dtype, dst_dtype, transpose_src):
    src = _chunk_states(dtype=src_dtype).cuda()
    if transpose_src:  # per-chunk states laid out chunk-major, as fla's h [B, NT, H, K, V] stacked per layer
        src = src.transpose(0, 1).contiguous().transpose(0, 1)
    src_index, dst_index = torch.tensor([8, 0, 3, 5]), torch.tensor([2, 6, 0, 9])
    expected = torch.zeros(6, 11, 4, 32, 32, dtype=dst_dtype, device="cuda")
    got = expected.clone()
    gather_states(src, src_index, expected, dst_index, backend="torch")
    gather_states(src, src_index.cuda(), got, dst_index.cuda(), backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


@gpu_only
def test_triton_pack_and_unpack_equal_reference():
    pools = _pools("cuda", num_slots=9)
    layout = CheckpointLayout.for_pools(pools)
    expected = pack_slot(pools, 7, layout, backend="torch")
    got = pack_slot(pools, 7, layout, backend="triton")
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
    target = {name: torch.zeros_like(p) for name, p in pools.items()}
    unpack_slot(got, layout, target, 4, backend="triton")
    torch.cuda.synchronize()
    for name in pools:
        assert torch.equal(target[name][:, 4], pools[name][:, 7])
        assert not target[name][:, :4].any() and not target[name][:, 5:].any()

