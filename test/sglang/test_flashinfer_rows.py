"""Which row of the GDN prefill kernel's per-chunk states `h` the plugin copies, checked by label.

The numerics tests (test_capture.py) compare captured states with cold prefills; this one isolates the
row arithmetic of `capture_forward` (`HRows`, `select_captures`, `build_indices`, the plan refinement)
so an index that is off by one row fails here whatever the states look like. `h` comes from labelled
CPU stand-ins that follow each kernel's documented contract, written out in this file without calling
the plugin's `h_rows` / `h_index`: every row holds (sequence, tokens of that sequence the state is
after), and every token of `mixed_qkv` holds (sequence, token index), so a copied row or conv window
says exactly which state it is.

  * FlashInfer (`flashinfer.gdn_prefill.chunk_gated_delta_rule`, flashinfer-ai/flashinfer
    flashinfer/gdn_prefill.py @0069530, docstring of `checkpoint_cu_starts` /
    `checkpoint_every_n_tokens`): with N = checkpoint_every_n_tokens (a multiple of 64), sequence i has
    cu_starts[i + 1] - cu_starts[i] = len_i // N checkpoint rows, packed sequence after sequence. Which
    state each row holds is what FlashInfer's own checkpoint oracle computes (tests/gdn/
    _gdn_prefill_checkpoint_oracle.py @bfe0d9b, mode "checkpoint_per_sequence": a row is appended after
    token `local_index` when `(local_index + 1) % interval == 0`): row j of sequence i is the state
    after (j + 1) * N of its tokens. No row for the sequence's start.
  * Triton (SGLang's FLA `chunk_gated_delta_rule_fwd_h`, kernels/ops/attention/fla/chunk_delta_h.py:
    382-397 in SGLang 0.5.23): ceil(len_i / 64) rows per sequence, row c the state ENTERING chunk c,
    i.e. after 64 c tokens.

Batches hold several requests of different lengths whose passes start at different cached prefixes
(the rows count from the pass's first token, the captures are planned at absolute positions).
"""
from __future__ import annotations

import types

import pytest
import torch

CONV_KERNEL = 4  # Qwen3.5's GDN conv: the conv state is the last 3 pre-conv inputs


def flashinfer_h(lengths: list, every: int, cu_starts: list) -> torch.Tensor:
    """FlashInfer's `state_checkpoints`, labelled: [1, rows, 2] of (sequence, tokens after)."""
    assert every > 0 and every % 64 == 0, "FlashInfer refuses a spacing that is not a multiple of 64"
    rows = []
    for seq, length in enumerate(lengths):
        mine = [(seq, local + 1) for local in range(length) if (local + 1) % every == 0]
        assert len(mine) == cu_starts[seq + 1] - cu_starts[seq], "the plan disagrees with FlashInfer's count"
        rows.extend(mine)
    return torch.tensor(rows, dtype=torch.float64).reshape(1, -1, 2)


def triton_h(lengths: list) -> torch.Tensor:
    """FLA's `h`, labelled: the state entering each 64-token chunk of each sequence."""
    rows = [(seq, begin) for seq, length in enumerate(lengths) for begin in range(0, length, 64)]
    return torch.tensor(rows, dtype=torch.float64).reshape(1, -1, 2)


def labelled_tokens(lengths: list) -> torch.Tensor:
    """`mixed_qkv` of the batch, labelled: [tokens, 2] of (sequence, token index in the pass)."""
    return torch.tensor([(seq, t) for seq, length in enumerate(lengths) for t in range(length)], dtype=torch.float64)


class _Capture:
    def __init__(self, slot: int):
        self.slot = torch.tensor([slot])
        self.conv_layers, self.ssm_layers = set(), set()


def _backend(flashinfer: bool):
    return types.SimpleNamespace(mamba_chunk_size=64, device="cpu",
                                 kernel_dispatcher=types.SimpleNamespace(extend_uses_state_checkpoints=flashinfer))


def _copy_rows(captures: list, rows, lengths: list, h: torch.Tensor) -> tuple:
    """Run the plugin's index build and its SSM / conv copies (`track_extend_around`,
    `convolve_prefill_around`'s gather) on labelled inputs: (ssm label per capture, conv labels)."""
    from histate.sglang_plugin.capture_forward import build_indices, track_extend_around

    indices = build_indices(captures, rows, lengths, CONV_KERNEL - 1, lambda slots: slots, "cpu")
    indices.layer_id = 0
    ssm_states = torch.full((1 + max(int(c.slot) for _, _, c in captures), 2), -1.0, dtype=torch.float64)
    track_extend_around(lambda *args, **kwargs: None, None, None, h, ssm_states,
                        types.SimpleNamespace(_hs_capture=indices))
    assert all(capture.ssm_layers == {0} for _, _, capture in captures), "the plugin refused the rows"
    conv = labelled_tokens(lengths)[indices.conv_src]  # [captures, kernel - 1, 2]
    return ssm_states, conv


def _check(captures: list, rows, lengths: list, h: torch.Tensor) -> int:
    ssm_states, conv = _copy_rows(captures, rows, lengths, h)
    for row, relative, capture in captures:
        slot = int(capture.slot)
        assert ssm_states[slot].tolist() == [row, relative], (row, relative, ssm_states[slot].tolist())
        window = conv[[c is capture for _, _, c in captures].index(True)]
        assert window.tolist() == [[row, t] for t in range(relative - CONV_KERNEL + 1, relative)], (row, relative)
    return len(captures)


# (prefix tokens, extend tokens, absolute planned positions inside the pass) per request of one batch
BATCH = [(0, 700, [128, 256, 384, 512, 640]),
         (192, 300, [320, 448]),             # a pass resuming at 192: relative 128 and 256
         (320, 1000, [384, 576, 832, 1280]),  # relative 64, 256, 512 and 960
         (64, 64, [])]                        # one chunk, nothing planned inside: rows must still count


def _captures(batch: list) -> list:
    out, slot = [], 0
    for row, (prefix, _length, positions) in enumerate(batch):
        for position in positions:
            out.append((row, position - prefix, _Capture(slot)))
            slot += 1
    return out


def test_triton_rows_are_the_states_at_each_capture():
    from histate.sglang_plugin.capture_forward import TRITON, select_captures

    lengths = [length for _, length, _ in BATCH]
    captures = _captures(BATCH)
    rows, held, dropped = select_captures(_backend(False), types.SimpleNamespace(), captures, lengths)
    assert rows.layout == TRITON and not dropped and len(held) == len(captures)
    assert _check(held, rows, lengths, triton_h(lengths)) == 11


# Captures at 256-token steps from each pass's start: a plan of 64, 128 or 256 tokens holds them all.
COARSE = [(0, 700, [256, 512]), (256, 300, [512]), (256, 1100, [512, 768, 1280]), (64, 64, [])]


@pytest.mark.parametrize("grid, batch, every", [(64, BATCH, 64), (256, BATCH, 64), (128, COARSE, 128),
                                                (256, COARSE, 256)])
def test_flashinfer_rows_under_the_plugins_own_plan(sglang_plugins, grid, batch, every):
    """No SGLang plan in the metadata (its tracked row is each pass's end): the plugin builds one on
    SGLang's grid (`mamba_cache_chunk_size()` = `grid`), or finer where a capture needs it (BATCH has a
    capture 64 tokens into a pass), and reads its rows by FlashInfer's contract."""
    from histate.sglang_plugin.capture_forward import FLASHINFER, select_captures
    from sglang_cpu.pools import publish_server_args

    publish_server_args(page_size=grid, chunk_tokens=grid)
    lengths = [length for _, length, _ in batch]
    captures = _captures(batch)
    metadata = types.SimpleNamespace()
    rows, held, dropped = select_captures(_backend(True), metadata, captures, lengths)
    assert rows.layout == FLASHINFER and not dropped and len(held) == len(captures)
    assert metadata.state_checkpoint_every_n_tokens == every
    h = flashinfer_h(lengths, every, metadata.state_checkpoint_cu_starts.tolist())
    assert h.shape[1] == metadata.num_state_checkpoints == rows.num_rows
    assert _check(held, rows, lengths, h) == len(captures) > 0


def test_flashinfer_rows_under_sglangs_plan_refined_keep_sglangs_own_row(sglang_plugins):
    """SGLang's own plan (its code: `maybe_build_flashinfer_checkpoint_plan`, page 256, one row per 256
    tokens) for interior tracked positions of passes that start at non-zero prefixes; the plugin's
    captures at 128-token steps make it refine the plan to 128 and move SGLang's `track_ssm_h_src`.
    SGLang's tracked rows must label the same (sequence, tokens) before and after, and every capture's
    row its own position."""
    from sglang.srt.layers.attention.linear.kernels.gdn_flashinfer import maybe_build_flashinfer_checkpoint_plan

    from histate.sglang_plugin.capture_forward import FLASHINFER, select_captures
    from sglang_cpu.pools import publish_server_args

    publish_server_args(page_size=256, chunk_tokens=256)  # mamba_cache_chunk_size() = 256
    batch = [(0, 900, [128, 384, 640]),       # SGLang tracks 768
             (256, 600, [384]),               # tracks 768 (relative 512)
             (512, 300, []),                  # tracks nothing
             (768, 1100, [896, 1152, 1408])]  # tracks 1792 (relative 1024)
    tracked = {0: 768, 1: 768, 3: 1792}
    lengths = [length for _, length, _ in batch]
    prefixes = [prefix for prefix, _, _ in batch]
    forward_batch = types.SimpleNamespace(
        extend_seq_lens=torch.tensor(lengths), extend_prefix_lens=torch.tensor(prefixes),
        mamba_track_mask=torch.tensor([row in tracked for row in range(len(batch))]),
        # SGLang passes an interior tracked position p as p + 1 (schedule_batch.py:3157-3170)
        mamba_track_seqlens=torch.tensor([tracked.get(row, -2) + 1 for row in range(len(batch))]))
    metadata = types.SimpleNamespace(track_ssm_h_src=torch.zeros(len(tracked), dtype=torch.int64),
                                     track_ssm_h_dst=torch.arange(len(tracked)))
    maybe_build_flashinfer_checkpoint_plan(forward_batch, metadata, "cpu")
    sglang_h = flashinfer_h(lengths, 256, metadata.state_checkpoint_cu_starts.tolist())
    sglang_rows = sglang_h[0, metadata.track_ssm_h_src].tolist()
    want_tracked = [[row, position - prefixes[row]] for row, position in tracked.items()]
    assert sglang_rows == want_tracked  # SGLang's own arithmetic, under the contract written out above

    captures = _captures(batch)
    rows, held, dropped = select_captures(_backend(True), metadata, captures, lengths)
    assert rows.layout == FLASHINFER and rows.spacing == 128 and not dropped and len(held) == len(captures)
    assert metadata.state_checkpoint_every_n_tokens == 128
    h = flashinfer_h(lengths, 128, metadata.state_checkpoint_cu_starts.tolist())
    assert h[0, metadata.track_ssm_h_src].tolist() == want_tracked  # the refined plan moved SGLang's rows along
    assert _check(held, rows, lengths, h) == 7


def test_a_capture_no_row_holds_is_dropped_not_misread(sglang_plugins):
    """Positions FlashInfer's plan has no row for (the pass end, past the end, not on the plan's grid
    when the plan cannot be refined to it) are left out; the rest still read their own rows."""
    from histate.sglang_plugin.capture_forward import select_captures
    from sglang_cpu.pools import publish_server_args

    publish_server_args(page_size=64, chunk_tokens=64)
    lengths = [640, 200]
    captures = [(0, 640, _Capture(0)), (0, 320, _Capture(1)), (1, 100, _Capture(2)), (1, 192, _Capture(3)),
                (1, 256, _Capture(4))]
    rows, held, dropped = select_captures(_backend(True), types.SimpleNamespace(), captures, lengths)
    assert [(r, rel) for r, rel, _ in held] == [(0, 320), (1, 192)]
    assert sorted((r, rel) for r, rel, *_ in dropped) == [(0, 640), (1, 100), (1, 256)]
    h = flashinfer_h(lengths, rows.spacing, list(rows.offsets))
    assert _check(held, rows, lengths, h) == 2
