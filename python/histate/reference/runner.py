"""Forward passes of the reference model: (resumed) prefill with in-prefill checkpoints, decode, cold runs.

`ModelRunner` fixes the numerics once (model dtype, GDN compute dtype, page size) so the cold
reference and every resumed run use the same kernels. Two modes are used by the exactness suite:

  "fp64": float64 weights, float64 GDN kernels -- resuming is exact up to the last few ulps (<= 1e-12);
  "fp32": float32 weights and kernels, as a deployment runs -- rounding differs with the split point
          (GEMM blocking, chunk padding), so resumes agree to ~1e-6, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from histate.reference.gdn_kernels import CapturedStates, gdn_kernels
from histate.reference.hybrid_cache import Checkpoint, final_checkpoint, new_cache
from histate.reference.model import StateGeometry, TinyModelSpec, build_tiny_qwen35, state_geometry

NUMERICS = {
    "fp64": (torch.float64, torch.float64),  # (model dtype, GDN compute dtype)
    "fp32": (torch.float32, torch.float32),
}


@dataclass(frozen=True, slots=True)
class PrefillResult:
    last_logits: torch.Tensor  # [vocab], float64 copy of the logits at the last input position
    captured: CapturedStates  # checkpoints taken inside this prefill


@dataclass(frozen=True, slots=True)
class ColdRun:
    """The reference a resumed request must reproduce: one uncached prefill plus teacher-forced decode."""

    last_logits: torch.Tensor  # [vocab] float64
    decode_tokens: tuple[int, ...]  # greedy tokens chosen by the cold run
    decode_logits: tuple[torch.Tensor, ...]  # logits after feeding each of decode_tokens


class ModelRunner:
    def __init__(self, numerics: str = "fp32", page_num_tokens: int = 64, spec: TinyModelSpec = TinyModelSpec()):
        if numerics not in NUMERICS:
            raise ValueError(f"numerics={numerics!r}: choose one of {sorted(NUMERICS)}")
        self.numerics = numerics
        self.model_dtype, self.compute_dtype = NUMERICS[numerics]
        self.model = build_tiny_qwen35(spec, self.model_dtype)
        self.geometry: StateGeometry = state_geometry(self.model, page_num_tokens, self.compute_dtype)

    def new_cache(self):
        return new_cache(self.model)

    @torch.no_grad()
    def prefill(self, cache, token_ids: Sequence[int], start_position: int,
                capture_positions: Sequence[int] = ()) -> PrefillResult:
        """Forward tokens [start_position, len(token_ids)) on `cache` (which must hold exactly
        `start_position` tokens) and capture checkpoints at `capture_positions` (absolute)."""
        new_ids = torch.tensor([list(token_ids[start_position:])], dtype=torch.long)
        if new_ids.shape[1] == 0:
            raise ValueError("prefill needs at least one new token (the last input token is always computed)")
        if cache.get_seq_length() != start_position:
            raise ValueError(f"cache holds {cache.get_seq_length()} tokens but the prefill starts at {start_position}")
        with gdn_kernels(self.compute_dtype, start_position=start_position, num_new_tokens=new_ids.shape[1],
                         capture_positions=capture_positions) as recorder:
            logits = self.model(input_ids=new_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        num_linear = len(self.geometry.linear_layer_ids)
        captured = recorder.result(num_linear) if recorder is not None else CapturedStates((), torch.empty(0), torch.empty(0))
        return PrefillResult(logits[0, -1].double(), captured)

    @torch.no_grad()
    def decode(self, cache, token_ids: Sequence[int]) -> list[torch.Tensor]:
        """Feed tokens one at a time (the seq_len == 1 decode path); logits after each, float64."""
        out = []
        with gdn_kernels(self.compute_dtype):
            for token in token_ids:
                ids = torch.tensor([[int(token)]], dtype=torch.long)
                out.append(self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1].double())
        return out

    def cold_run(self, token_ids: Sequence[int], num_decode_steps: int) -> ColdRun:
        """Uncached prefill of all tokens, then `num_decode_steps` greedy decode steps."""
        cache = self.new_cache()
        last = self.prefill(cache, token_ids, 0).last_logits
        tokens, logits = [], []
        current = last
        for _ in range(num_decode_steps):
            token = int(current.argmax())
            current = self.decode(cache, [token])[0]
            tokens.append(token)
            logits.append(current)
        return ColdRun(last, tuple(tokens), tuple(logits))

    def checkpoint_by_prefill(self, token_ids: Sequence[int], position: int) -> Checkpoint:
        """A checkpoint at `position` computed separately: an uncached prefill of tokens [0, position)."""
        cache = self.new_cache()
        self.prefill(cache, token_ids[:position], 0)
        return final_checkpoint(cache, self.geometry, position)
