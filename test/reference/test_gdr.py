"""The chunked gated delta rule hands out the same states the token-by-token recurrence reaches."""
import pytest

torch = pytest.importorskip("torch")

from histate.reference.gdr import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _inputs(num_tokens, seed=0, num_k_heads=2, num_v_heads=4, d=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_tokens, num_k_heads, d, generator=g)
    k = torch.randn(1, num_tokens, num_k_heads, d, generator=g)
    v = torch.randn(1, num_tokens, num_v_heads, d, generator=g)
    # Slow decay (log-decay in [-0.05, 0]) so early tokens still matter at the end.
    decay = -0.05 * torch.rand(1, num_tokens, num_v_heads, generator=g)
    beta = torch.rand(1, num_tokens, num_v_heads, generator=g)
    return q, k, v, decay, beta


def _max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_captured_chunk_states_equal_the_recurrence_at_those_positions(dtype):
    q, k, v, decay, beta = _inputs(300)
    positions = [64, 192, 256]
    _, final, captured = chunk_gated_delta_rule(q, k, v, decay, beta, compute_dtype=dtype, capture_num_tokens=positions)
    assert captured.shape == (1, 3, 4, 32, 32) and captured.dtype == dtype
    for j, p in enumerate(positions):
        _, state = recurrent_gated_delta_rule(q[:, :p], k[:, :p], v[:, :p], decay[:, :p], beta[:, :p], compute_dtype=dtype)
        assert _max_diff(captured[:, j], state) <= TOL[dtype] * max(1.0, state.abs().max().item())
    _, state = recurrent_gated_delta_rule(q, k, v, decay, beta, compute_dtype=dtype)
    assert _max_diff(final, state) <= TOL[dtype] * max(1.0, state.abs().max().item())


def test_fp32_chunk_kernel_is_bit_identical_to_transformers():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    reference = getattr(m.torch_chunk_gated_delta_rule, "__wrapped__", m.torch_chunk_gated_delta_rule)
    q, k, v, decay, beta = _inputs(200, seed=1, num_k_heads=4, num_v_heads=4)
    out, final, _ = chunk_gated_delta_rule(q, k, v, decay, beta, compute_dtype=torch.float32)
    ref_out, ref_final = reference(q, k, v, g=decay, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, ref_out)
    assert torch.equal(final, ref_final)


def test_resuming_from_a_captured_state_continues_the_same_computation():
    q, k, v, decay, beta = _inputs(640, seed=2)
    out, final, captured = chunk_gated_delta_rule(q, k, v, decay, beta, compute_dtype=torch.float64,
                                                  capture_num_tokens=[384])
    out2, final2, _ = chunk_gated_delta_rule(q[:, 384:], k[:, 384:], v[:, 384:], decay[:, 384:], beta[:, 384:],
                                             initial_state=captured[:, 0], compute_dtype=torch.float64)
    assert _max_diff(final2, final) <= 1e-12
    assert _max_diff(out2, out[:, 384:]) <= 1e-12


def test_capture_positions_come_back_sorted_and_unique():
    q, k, v, decay, beta = _inputs(256, seed=3)
    _, _, captured = chunk_gated_delta_rule(q, k, v, decay, beta, compute_dtype=torch.float64,
                                            capture_num_tokens=[192, 64, 192])
    _, _, ordered = chunk_gated_delta_rule(q, k, v, decay, beta, compute_dtype=torch.float64,
                                           capture_num_tokens=[64, 192])
    assert torch.equal(captured, ordered) and captured.shape[1] == 2


@pytest.mark.parametrize("bad", [0, 63, 65, 320])
def test_capture_outside_the_call_or_off_a_chunk_boundary_is_rejected(bad):
    q, k, v, decay, beta = _inputs(300)
    with pytest.raises(ValueError, match="chunk boundary"):
        chunk_gated_delta_rule(q, k, v, decay, beta, capture_num_tokens=[bad])
