"""Policy registry: adding a policy is one class with `@register_policy` (docs/policies.md)."""
from __future__ import annotations

from .base import AdmissionContext, Policy

_REGISTRY: dict = {}


def register_policy(cls):
    if cls.name in _REGISTRY:
        raise ValueError(f"policy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def make_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available_policies())}") from None


def available_policies() -> list[str]:
    return list(_REGISTRY)


from . import histate, vllm, sglang_hicache, marconi, unlimited, sglang_tuned, vllm_current  # noqa: E402,F401  (registration)
from .histate import with_host_write_policy  # noqa: E402

__all__ = ["AdmissionContext", "Policy", "available_policies", "make_policy", "register_policy",
           "with_host_write_policy"]
