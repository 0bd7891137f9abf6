"""Cost model arithmetic against hand-computed numbers (paper §3.1, anchors §7, HF configs)."""
import math

import pytest

from histate.sim.costs import (CPU_TIER, GPU_TIER, H100_SXM, H200_SXM, QWEN3_NEXT_80B_A3B, QWEN3_NEXT_80B_A3B_ARCH,
                               QWEN35_9B, QWEN35_9B_ARCH, SSD_TIER, TINY_QWEN35, TINY_QWEN35_ARCH,
                               CalibratedStepCost, PrefillChunk, PrefillProfile, RooflineStepCost, get_hardware,
                               get_model, load_time_s, restore_time_s)


def test_parameter_counts_match_the_transformers_configs():
    # Counted on meta-device Qwen3_5ForCausalLM / Qwen3NextForCausalLM (transformers 5.19 defaults).
    assert QWEN35_9B_ARCH.total_params == 8_953_803_264
    assert QWEN35_9B_ARCH.dense_params == 6_919_565_824
    assert QWEN3_NEXT_80B_A3B_ARCH.total_params == 79_674_391_296
    assert TINY_QWEN35_ARCH.total_params == 1_456_624            # refmodel.md: "1.46 M params"


def test_cache_sizes():
    assert QWEN35_9B.kv_bytes_per_token == 8 * 2 * 4 * 256 * 2 == 32 * 1024
    assert QWEN35_9B.ssm_state_bytes == 24 * 32 * 128 * 128 * 4 == 48 * 2**20
    assert QWEN35_9B.conv_state_bytes == 24 * 8192 * 3 * 2
    assert QWEN35_9B.checkpoint_size_bytes == 51_511_296           # 49.12 MiB (refmodel.md table)
    assert QWEN35_9B.checkpoint_token_equivalents == 1572.0
    assert QWEN3_NEXT_80B_A3B.kv_bytes_per_token == 24 * 1024
    assert QWEN3_NEXT_80B_A3B.checkpoint_size_bytes == 77_266_944
    # what histate.reference's executor (the `histate serve` server) stores: kernel - 1 conv columns
    assert (TINY_QWEN35.kv_bytes_per_token, TINY_QWEN35.checkpoint_size_bytes) == (1024, 116_736)


def test_paper_eq2_load_times():
    ms = 1e3
    kv_32k = 32768 * QWEN35_9B.kv_bytes_per_token
    assert round(load_time_s(kv_32k, CPU_TIER, H100_SXM) * ms, 1) == 16.8
    assert round(load_time_s(kv_32k, SSD_TIER, H100_SXM) * ms, 1) == 231.5
    assert round(load_time_s(4 * kv_32k, CPU_TIER, H100_SXM) * ms, 1) == 67.1
    assert round(load_time_s(4 * kv_32k, SSD_TIER, H100_SXM) * ms, 1) == 926.1
    # The paper's 0.8 / 10.9 ms per checkpoint are the 48 MiB SSM state; with the conv state: 0.8 / 11.1.
    ssm = QWEN35_9B.ssm_state_bytes
    assert round(load_time_s(ssm, CPU_TIER, H100_SXM) * ms, 1) == 0.8
    assert round(load_time_s(ssm, SSD_TIER, H100_SXM) * ms, 1) == 10.9
    assert round((load_time_s(ssm, SSD_TIER, H100_SXM) - load_time_s(ssm, CPU_TIER, H100_SXM)) * ms, 1) == 10.1
    full = QWEN35_9B.checkpoint_size_bytes
    assert round(load_time_s(full, CPU_TIER, H100_SXM) * ms, 2) == 0.80
    assert round(load_time_s(full, SSD_TIER, H100_SXM) * ms, 2) == 11.11
    assert load_time_s(full, GPU_TIER, H100_SXM) == 0.0 and load_time_s(full, None, H100_SXM) == 0.0
    total = restore_time_s({GPU_TIER: 10**9, CPU_TIER: kv_32k}, ssm, SSD_TIER, H100_SXM)
    assert total == pytest.approx(kv_32k / 64e9 + ssm / 5e9 + ssm / 64e9)


def test_link_presets_and_overrides():
    gen5 = H200_SXM.with_links(ssd_gb_s=14)
    assert round(load_time_s(QWEN35_9B.checkpoint_size_bytes, SSD_TIER, gen5) * 1e3, 1) == 4.5   # 3.7 + 0.8
    assert get_hardware("h200") is H200_SXM and get_model("qwen3.5-9b") is QWEN35_9B
    with pytest.raises(ValueError, match="unknown model"):
        get_model("llama")


def test_roofline_flops_and_bytes_by_hand():
    m, hw = QWEN35_9B, H100_SXM
    cost = RooflineStepCost(m, hw, step_overhead_s=0.0)
    assert m.matmul_flops_per_token == 2 * 6_919_565_824
    assert m.attention_flops_per_attended_token == 4 * 8 * 16 * 256
    assert m.logits_flops_per_token == 2 * 248_320 * 4096
    assert m.recurrent_flops_per_token == 2 * 24 * 32 * (3 * 128 * 128 + 64 * 256)
    # 1,024 tokens on 4,096 cached: attended = 1024 * 4096 + 1024 * 1025 / 2.
    flops = 1024 * (2 * 6_919_565_824 + m.recurrent_flops_per_token) + 131072 * (1024 * 4096 + 524800) \
        + 2 * 248_320 * 4096
    assert cost.prefill_work([PrefillChunk(1024, 4096, True)])[0] == pytest.approx(flops, rel=1e-12)
    expected = flops / (989.4e12 * 0.5)           # compute-bound
    assert cost.step_time_s([PrefillChunk(1024, 4096, True)]) == pytest.approx(expected, rel=1e-12)
    # One decode token at 10K context is memory-bound: weights (no input embedding) + KV + state r/w.
    weights = (6_919_565_824 + 248_320 * 4096) * 2
    byts = weights + 10_001 * 32768 + 2 * 51_511_296
    assert cost.step_time_s([], 1, 10_000) == pytest.approx(byts / (3.35e12 * 0.8), rel=1e-12)


def test_decode_coefficients_reproduce_step_by_step_times():
    for model in (QWEN35_9B, QWEN3_NEXT_80B_A3B):
        cost = RooflineStepCost(model, H200_SXM)
        n, ctx = 48, 48 * 300_000           # long contexts: crosses from one regime to the other? check both
        o, a, b, c, d = cost.decode_coefficients(n, ctx)
        for j in (0, 1, 17, 999):
            assert o + max(a + b * j, c + d * j) == pytest.approx(cost.step_time_s([], n, ctx + j * n), rel=1e-12)


def test_moe_reads_only_touched_experts():
    cost = RooflineStepCost(QWEN3_NEXT_80B_A3B, H200_SXM)
    m = QWEN3_NEXT_80B_A3B
    assert cost.weight_bytes(1) == pytest.approx(m.dense_weight_bytes + m.expert_weight_bytes * 10 / 512)
    assert cost.weight_bytes(8192) == pytest.approx(m.dense_weight_bytes + m.expert_weight_bytes)


def test_chunked_prefill_time_adds_up():
    cost = RooflineStepCost(QWEN35_9B, H100_SXM)
    total = cost.prefill_time_s(20_000, 1_000, chunk_num_tokens=8192)
    parts = [cost.step_time_s([PrefillChunk(8192, 1_000, False)]), cost.step_time_s([PrefillChunk(8192, 9_192, False)]),
             cost.step_time_s([PrefillChunk(3616, 17_384, True)])]
    assert total == pytest.approx(sum(parts), rel=1e-12)
    # Attention growth: the same 8K chunk costs more on a longer context.
    assert parts[0] < parts[1]


# ---------------------------------------------------------------------------------- calibration
def write_profile(tmp_path, text):
    path = tmp_path / "profile.csv"
    path.write_text(text)
    return path


def test_profile_fit_recovers_the_generating_coefficients(tmp_path):
    truth = (0.004, 2.5e-5, 3.0e-10, 1.5e-10)
    lines = ["# measured on nothing: generated", "gpu,num_tokens,context_num_tokens,latency_s"]
    for n in (512, 2048, 8192):
        for ctx in (0, 16384, 65536):
            lat = truth[0] + truth[1] * n + truth[2] * n * ctx + truth[3] * n * n
            lines.append(f"h200,{n},{ctx},{lat!r}")
    profile = PrefillProfile.from_csv(write_profile(tmp_path, "\n".join(lines) + "\n"))
    assert profile.num_points == 9 and profile.max_relative_error < 1e-9
    for got, want in zip(profile.coefficients, truth):
        assert got == pytest.approx(want, rel=1e-6)
    assert profile.latency_s(4096, 32768) == pytest.approx(truth[0] + truth[1] * 4096 + truth[2] * 4096 * 32768
                                                           + truth[3] * 4096 ** 2, rel=1e-9)
    cost = CalibratedStepCost(QWEN35_9B, H200_SXM, profile)
    assert cost.step_time_s([PrefillChunk(4096, 32768, True)]) == pytest.approx(profile.latency_s(4096, 32768))
    decode_only = cost.step_time_s([], 2, 1000)
    assert decode_only == RooflineStepCost(QWEN35_9B, H200_SXM).step_time_s([], 2, 1000)
    assert cost.step_time_s([PrefillChunk(4096, 32768, True)], 2, 1000) > profile.latency_s(4096, 32768)


@pytest.mark.parametrize("text, message", [
    ("num_tokens,latency_s\n1,2\n", ":1: header lacks column(s) ['context_num_tokens']"),
    ("num_tokens,context_num_tokens,latency_s\n1024,0,fast\n", ":2: latency_s: not a number: 'fast'"),
    ("num_tokens,context_num_tokens,latency_s\n1024,0\n", ":2: latency_s: missing value"),
    ("num_tokens,context_num_tokens,latency_s\n\n# c\n-5,0,1\n", ":4: num_tokens: out of range"),
    ("num_tokens,context_num_tokens,latency_s\n1,0,1\n2,0,1\n", "need at least 4 points"),
    ("num_tokens,context_num_tokens,latency_s\n1,0,1\n2,0,2\n3,0,3\n4,0,4\n", "do not determine the fit"),
    ("", "empty profile"),
])
def test_profile_errors_name_file_line_and_column(tmp_path, text, message):
    path = write_profile(tmp_path, text)
    with pytest.raises(ValueError) as exc:
        PrefillProfile.from_csv(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_ratio_anchor_recompute_vs_restore():
    """anchors §7.3: recomputing 1,024 tokens costs tens of ms, far more than one host checkpoint load."""
    recompute = RooflineStepCost(QWEN35_9B, H200_SXM, step_overhead_s=0).prefill_time_s(1024)
    host = load_time_s(QWEN35_9B.checkpoint_size_bytes, CPU_TIER, H200_SXM)
    assert 25e-3 < recompute < 40e-3 and 30 < recompute / host < 50
    assert math.isclose(H100_SXM.peak_flops, H200_SXM.peak_flops)


def test_vllm_hybrid_blocks_match_the_paper():
    """Paper §4.1: 2,560 blocks of 576 tokens in 45 GiB; a Qwen3.5-9B state takes 3 blocks (54 MiB)."""
    from histate.sim.costs import vllm_hybrid_blocks
    blocks = vllm_hybrid_blocks(QWEN35_9B)
    assert (blocks.block_num_tokens, blocks.state_num_blocks) == (576, 3)
    assert blocks.state_size_bytes == 54 * 2**20
    assert 45 * 2**30 // blocks.block_size_bytes == 2560
