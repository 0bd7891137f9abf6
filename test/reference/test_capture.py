"""One prefill of the real Qwen3.5 layer stack yields several checkpoints, each equal to a separately
computed one (a prefill of exactly that many tokens), and capturing does not perturb the forward."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from histate.reference.exactness import TOLERANCE  # noqa: E402
from histate.reference.gdn_kernels import gdn_kernels  # noqa: E402
from histate.reference.hybrid_cache import Checkpoint, kv_pages_from_cache, restore_cache  # noqa: E402

NUM_TOKENS = 700


def _tokens(seed=0, n=NUM_TOKENS):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def _captured(result, j):
    return Checkpoint(result.captured.positions[j], result.captured.conv[:, j], result.captured.ssm[:, j])


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_checkpoints_captured_in_one_fresh_prefill_equal_separate_prefills(numerics, runners):
    runner, tokens = runners(numerics), _tokens()
    result = runner.prefill(runner.new_cache(), tokens, 0, capture_positions=[640, 64, 256, 448])
    assert result.captured.positions == (64, 256, 448, 640)
    for j, position in enumerate(result.captured.positions):
        separate = runner.checkpoint_by_prefill(tokens, position)
        assert _captured(result, j).max_abs_diff(separate) <= TOLERANCE[numerics], position


@pytest.mark.parametrize("numerics", ["fp64", "fp32"])
def test_checkpoints_captured_in_a_resumed_prefill_equal_separate_prefills(numerics, runners):
    """The executor's case: restore KV[0, 128) + checkpoint@128, then capture 192, 320, 640 on the way."""
    runner, tokens = runners(numerics), _tokens(seed=1)
    full = runner.new_cache()
    runner.prefill(full, tokens, 0)
    start = runner.checkpoint_by_prefill(tokens, 128)
    cache = restore_cache(runner.model, runner.geometry, kv_pages_from_cache(full, runner.geometry, 0, 2), start)
    result = runner.prefill(cache, tokens, 128, capture_positions=[192, 320, 640])
    for j, position in enumerate(result.captured.positions):
        separate = runner.checkpoint_by_prefill(tokens, position)
        assert _captured(result, j).max_abs_diff(separate) <= TOLERANCE[numerics], position


def test_capturing_does_not_change_the_logits(runners):
    runner, tokens = runners("fp32"), _tokens(seed=2)
    plain = runner.prefill(runner.new_cache(), tokens, 0)
    captured = runner.prefill(runner.new_cache(), tokens, 0, capture_positions=[64, 128, 640])
    assert torch.equal(plain.last_logits, captured.last_logits)


def test_captured_conv_state_is_the_last_kernel_minus_one_inputs(runners):
    """Capture at 64 must hold pre-conv inputs 61..63; a window shifted by one token differs."""
    runner, tokens = runners("fp64"), _tokens(seed=3, n=200)
    result = runner.prefill(runner.new_cache(), tokens, 0, capture_positions=[64])
    at_64 = runner.checkpoint_by_prefill(tokens, 64)
    at_65 = runner.checkpoint_by_prefill(tokens, 65)
    assert (result.captured.conv[:, 0] - at_64.conv).abs().max().item() == 0.0
    assert (result.captured.conv[:, 0] - at_65.conv).abs().max().item() > 1e-3


def test_capture_off_the_resumed_chunk_grid_is_rejected(runners):
    runner, tokens = runners("fp32"), _tokens(seed=4, n=300)
    with pytest.raises(ValueError, match="chunk boundary"):
        runner.prefill(runner.new_cache(), tokens, 0, capture_positions=[100])


def test_kernel_swap_refuses_to_nest():
    with gdn_kernels(torch.float32):
        with pytest.raises(RuntimeError, match="cannot nest"):
            with gdn_kernels(torch.float32):
                pass
