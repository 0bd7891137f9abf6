"""A request whose admission match finds an SSD-only checkpoint waits one round for its restore.

SGLang asks `check_prefetch_progress` before the admission's own match (scheduler.py:4240-4258), and HiState
holds a request there while the checkpoint an earlier match of it found is restored from the SSD
(ssd_tier.py, `restore_ready`). A checkpoint that appears on the request's path after that earlier match
and is homed to the SSD alone before the admission (another session's request created it, then went past
it) is first seen by the admission match, after the hold: SGLang's match finds no state there, and the
request recomputes what HiState holds on the SSD. Seen in SGLang's own server: a six-session replay of
`histate bench` recomputed a new session's 128-token shared prefix on every run; before the miss reasons
were settled to the admitted prefix (runtime.py `settle`) the same request made them disagree with
SGLang's `cached_tokens`.

SGLang has the same race for its own storage lookups and answers it at this point:
`Scheduler._prefetch_after_device_hit_loss` (scheduler.py:3426-3453) skips a request whose admission match
came out shorter than its lookup, to look again. HiState answers there too: if the admission match left an
SSD-only checkpoint to restore (`SsdTier.restore_pending`), the request skips this round and the next
round's hold restores it. At most `MAX_RECHECKS` times per request, so a restore that cannot start (no host
slot) never holds a request forever. The inputs are the agreed tree and the request, the same on every rank.
"""
from __future__ import annotations

from typing import Any

from .hooks import install_once

MAX_RECHECKS = 2
"""Rounds a request may be skipped for checkpoints its admission matches found on the SSD."""

RECHECKS_ATTR = "_hs_restore_rechecks"
"""Underscore attribute on SGLang's `Req`: how often it was skipped here."""

_TARGET = "sglang.srt.managers.scheduler.Scheduler._prefetch_after_device_hit_loss"


def wait_for_restore(tree_cache: Any, req: Any) -> bool:
    """Whether `req` skips this admission round for an SSD restore its admission match noted."""
    tier = getattr(getattr(tree_cache, "histate", None), "ssd_tier", None)
    handle = getattr(req, "cache_request_handle", None)
    if tier is None or handle is None or not tier.restore_pending(handle):
        return False
    rechecks = getattr(req, RECHECKS_ATTR, 0)
    if rechecks >= MAX_RECHECKS:
        return False
    setattr(req, RECHECKS_ATTR, rechecks + 1)
    tree_cache.histate.metrics.record_restore_recheck()
    return True


def prefetch_after_device_hit_loss_around(original: Any, scheduler: Any, req: Any) -> bool:
    return original(scheduler, req) or wait_for_restore(scheduler.tree_cache, req)


def install_restore_recheck() -> None:
    """Register the hook (once per process; the scheduler's). Only with an SSD tier: SGLang calls it only
    with HiCache storage on (scheduler.py:4255)."""
    install_once("restore_recheck", [(_TARGET, prefetch_after_device_hit_loss_around, "AROUND")])
