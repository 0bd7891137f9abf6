"""The reuse ceiling: every KV page and a state at every page boundary, never evicted."""
from __future__ import annotations

from . import register_policy
from .base import Policy
from ..types import Tier


@register_policy
class Unlimited(Policy):
    name = "unlimited"
    tiers = (Tier.GPU,)
    dense_checkpoints = True
    unbounded = True
