"""HiCache's host write policy, chosen by HiState when the operator did not give `--hicache-write-policy`.

The rule is core/write_policy.py's (write_back with an SSD tier, no L3, and a host KV pool at most 1.8x the
device pool; measured in docs/results.md "write_back against write_through as the host grows"), the one the
simulator's `histate` runs (`ReplayConfig.rules`).

"Not given": SGLang's parser stores the flag's value, or its default `write_through`, and the record cannot
tell the two apart. HiState's `add_cli_args` hook makes the flag's argparse action also mark the parsed
namespace when the flag appears on the command line (`record_when_given`), and its `from_cli_args` hook
stashes whether the choice is HiState's on the record (`AUTO_ATTR`, pickled to the scheduler with the
record). Nothing else about the flag changes: its value, default, choices and help stay SGLang's. A record
without the stash counts as chosen by the operator: one built by `Engine(**kwargs)` (no command line; its
dataclass default is indistinguishable from an explicit `write_through`), or through SGLang's
plugin-declared arguments (upstream/series 0003, where HiState declares only its own group).

The switch (`choose_write_policy`): in `init_hicache`, after SGLang built the host pools and attached the
storage backend and before any request, from sizes every rank agrees on (the device pool's from
`_agree_sizes`, the host KV pool's MIN over the ranks here), through the three assignments SGLang's own
runtime policy switch makes (`StorageAttachment._apply_policies`, unified_cache/storage_attachment.py:
387-404). Going from write_through to write_back on an empty tree needs none of the flush that the other
direction asks for (storage_attachment.py:86-101).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from histate.core import WRITE_BACK, WRITE_THROUGH, Tier, auto_host_write_policy

logger = logging.getLogger(__name__)

FLAG = "--hicache-write-policy"
GIVEN_ATTR = "_histate_write_policy_given"
"""Set on the parsed namespace when `--hicache-write-policy` was on the command line."""
AUTO_ATTR = "_histate_write_policy_auto"
"""Underscore bookkeeping attribute on the ServerArgs record: True when HiState may choose the policy."""


def record_when_given(parser: Any) -> None:
    """Make `--hicache-write-policy`'s action mark the namespace it stores into (idempotent; a parser
    without the flag is left alone). argparse calls an action only for a flag on the command line."""
    action = getattr(parser, "_option_string_actions", {}).get(FLAG)
    if action is None or getattr(type(action), "records_given", False):
        return
    base = type(action)

    class RecordingAction(base):
        records_given = True

        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
            setattr(namespace, GIVEN_ATTR, True)
            super().__call__(parser, namespace, values, option_string)

    action.__class__ = RecordingAction


def stash_choice(record: Any, namespace: Any) -> None:
    """`from_cli_args`: the record may get HiState's choice when the flag was not on the command line."""
    setattr(record, AUTO_ATTR, not getattr(namespace, GIVEN_ATTR, False))


def choose_write_policy(cache: Any, server_args: Any) -> Optional[str]:
    """Switch HiCache to write_back where the rule says so; returns the policy chosen (None: the
    operator's, or no HiCache). Called in `init_hicache` on every rank, with agreed inputs only."""
    import torch
    from sglang.srt.mem_cache.unified_radix_cache import PoolName

    from .storage_backend import histate_backend

    controller = getattr(cache, "cache_controller", None)
    if not getattr(server_args, AUTO_ATTR, False) or controller is None \
            or controller.write_policy != WRITE_THROUGH or cache.host_memory_mode != "cache":
        return None
    host_kv = cache.host_pool_group.get_pool(PoolName.KV)
    has_ssd = histate_backend(controller) is not None
    # MIN over the ranks: each rank's headroom may size its host apart, and an SSD tier counts only if
    # every rank attached one
    agreed = torch.tensor([int(host_kv.size), int(has_ssd)], dtype=torch.int64)
    cache._all_reduce(agreed, torch.distributed.ReduceOp.MIN)
    host_tokens, has_ssd = (int(v) for v in agreed.tolist())
    core = cache.histate.core_config
    host_kv_bytes = host_tokens * core.kv_bytes_per_token
    device_bytes = core.capacity_bytes[Tier.GPU]
    policy = auto_host_write_policy(device_bytes, host_kv_bytes, has_ssd=bool(has_ssd),
                                    has_l3=cache.histate.config.l3 != "off")
    logger.info("HiState: --hicache-write-policy not given: %s (host KV pool %.2f GB, %.2fx the device pool's "
                "%.2f GB; SSD tier: %s; L3: %s)", policy, host_kv_bytes / 1e9, host_kv_bytes / device_bytes,
                device_bytes / 1e9, "yes" if has_ssd else "no", cache.histate.config.l3)
    if policy == WRITE_BACK:
        controller.write_policy = WRITE_BACK
        cache.write_through_threshold = 2
        cache.is_write_back = True
    return policy
