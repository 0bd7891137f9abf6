"""Moving cached state in and out of transformers' hybrid `DynamicCache`.

A hit restores two things (DESIGN.md, hit accounting): the attention KV of tokens [0, c) and one
recurrent checkpoint at c. This module builds a ready-to-continue `DynamicCache` from exactly those
pieces, and cuts the pieces HiState keeps (KV pages, checkpoints) back out of a cache after a forward.

Layouts are those of `histate.reference.model.StateGeometry`; batch size is 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from histate.reference.model import StateGeometry


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Recurrent state of every GDN layer after `position` tokens.

    conv: `[num_linear_layers, conv_dim, kernel-1]`; ssm: `[num_linear_layers, H_v, d_k, d_v]`.
    """

    position: int
    conv: torch.Tensor
    ssm: torch.Tensor

    def max_abs_diff(self, other: "Checkpoint") -> float:
        return max(_max_abs_diff(self.conv, other.conv), _max_abs_diff(self.ssm, other.ssm))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def new_cache(model):
    from transformers.cache_utils import DynamicCache

    return DynamicCache(config=model.config)


def restore_cache(model, geometry: StateGeometry, kv_pages: Sequence[torch.Tensor], checkpoint: Checkpoint | None):
    """A cache holding KV of `len(kv_pages)` pages and the recurrent state `checkpoint`, whose position
    must be exactly the KV length (transformers derives position ids from the KV length)."""
    cache = new_cache(model)
    num_tokens = len(kv_pages) * geometry.page_num_tokens
    if checkpoint is None:
        if kv_pages:
            raise ValueError(f"{len(kv_pages)} KV pages restored without a recurrent checkpoint")
        return cache
    if checkpoint.position != num_tokens:
        raise ValueError(f"checkpoint at token {checkpoint.position} does not end the restored KV ({num_tokens} tokens)")
    kv = torch.cat(list(kv_pages), dim=3)  # [full, 2, H_kv, T, d]
    for j, layer_id in enumerate(geometry.full_layer_ids):
        cache.layers[layer_id].update(kv[j, 0].unsqueeze(0).contiguous(), kv[j, 1].unsqueeze(0).contiguous())
    for j, layer_id in enumerate(geometry.linear_layer_ids):
        layer = cache.layers[layer_id]
        # transformers keeps `kernel` columns; the oldest one never reaches a kept output, so it is zero.
        conv = F.pad(checkpoint.conv[j].to(geometry.conv_dtype), (1, 0)).unsqueeze(0)
        layer.update_conv_state(conv.contiguous(), 0)
        layer.update_recurrent_state(checkpoint.ssm[j].to(geometry.ssm_dtype).unsqueeze(0).contiguous(), 0)
    return cache


def kv_pages_from_cache(cache, geometry: StateGeometry, first_page: int, num_pages: int) -> list[torch.Tensor]:
    """Pages [first_page, first_page + num_pages) of the cache's attention KV, each
    `[num_full_layers, 2, H_kv, page_num_tokens, head_dim]` and independent of the cache's storage."""
    page = geometry.page_num_tokens
    layers = [cache.layers[i] for i in geometry.full_layer_ids]
    if layers[0].keys.shape[-2] < (first_page + num_pages) * page:
        raise ValueError(f"cache holds {layers[0].keys.shape[-2]} tokens, asked for pages up to {first_page + num_pages}")
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in layers])  # [full, 2, H, T, d]
    return [kv[:, :, :, p * page : (p + 1) * page].clone() for p in range(first_page, first_page + num_pages)]


def final_checkpoint(cache, geometry: StateGeometry, position: int) -> Checkpoint:
    """The recurrent state a cache holds after a forward ending at `position` (a separately computed
    checkpoint, the reference that in-prefill captures are compared with)."""
    keep = geometry.conv_num_columns
    layers = [cache.layers[i] for i in geometry.linear_layer_ids]
    conv = torch.stack([layer.conv_states[0][0, :, -keep:] for layer in layers]).clone()
    ssm = torch.stack([layer.recurrent_states[0][0] for layer in layers]).clone()
    return Checkpoint(position, conv, ssm)
