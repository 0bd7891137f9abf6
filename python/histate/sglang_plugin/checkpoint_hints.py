"""Application-placed checkpoints: positions a request names through SGLang's `custom_params`.

An application knows where the prefix it will send again ends -- its system prompt and tool list, a
compaction's preamble -- before any second request could show the cache (SGLang #37198: shared lengths
5120/4992 against a state stored at 5952 give 0 hits). A request names those token positions:

    /generate:               {"sampling_params": {"custom_params": {"histate_checkpoints": [4992]}}}
    /v1/chat/completions:    {"custom_params": {"histate_checkpoints": [4992]}}

and HiState plans a checkpoint at each one inside the pass that computes it (the state after the
deepest whole grid step at or below the position, `PolicyState.plan`). `custom_params` is the field
SGLang already carries from both APIs to the scheduler's `Req.sampling_params`, so no request field is
added. What is kept is then ranked like every other checkpoint (eq. 7): a hint places a state, it does
not pin one, so one client cannot fill the cache with hinted states.

Bad hints are refused where SGLang refuses other bad input: `TokenizerManager._validate_one_request`
raises ValueError, which SGLang's HTTP layer answers with a 400 naming the problem, before the request
reaches the scheduler (nothing in the cache changes). The scheduler reads the same field again with
`hints_of`, which never raises: a request that reached it without the tokenizer's check (none does in
0.5.23) runs without hints rather than failing.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

HINTS_KEY = "histate_checkpoints"
MAX_CHECKPOINT_HINTS = 16
"""Positions one request may name. Enough for a system prompt, a tool list and a few compaction points;
a bound keeps a request from asking for a state every few tokens (each is a state-sized copy)."""

_TOKENIZER_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
_GROUP = "checkpoint_hints"


class CheckpointHintError(ValueError):
    """A bad `histate_checkpoints` value (a ValueError: SGLang answers it with HTTP 400)."""


def parse_hints(custom_params: Any, num_prompt_tokens: int) -> tuple:
    """The named positions (tokens, ascending, unique) of a request whose prompt has
    `num_prompt_tokens` tokens; () when it names none. Raises CheckpointHintError, one line, naming the
    field and what is wrong."""
    if not isinstance(custom_params, dict) or custom_params.get(HINTS_KEY) is None:
        return ()
    value = custom_params[HINTS_KEY]
    where = f"custom_params.{HINTS_KEY}"
    if not isinstance(value, list):
        raise CheckpointHintError(f"{where}: expected a list of token positions, got {type(value).__name__}")
    if len(value) > MAX_CHECKPOINT_HINTS:
        raise CheckpointHintError(f"{where}: at most {MAX_CHECKPOINT_HINTS} positions, got {len(value)}")
    for position in value:
        if isinstance(position, bool) or not isinstance(position, int) or position < 1:
            raise CheckpointHintError(f"{where}: each position must be an integer >= 1, got {position!r}")
        if position > num_prompt_tokens:
            raise CheckpointHintError(f"{where}: position {position} is beyond the prompt "
                                      f"({num_prompt_tokens} tokens)")
    return tuple(sorted(set(value)))


def hints_of(req: Any) -> tuple:
    """A scheduler `Req`'s named positions; () when it names none or they do not parse (never raises)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        return parse_hints(params, len(getattr(req, "origin_input_ids", ()) or ()))
    except CheckpointHintError:
        return ()


def hint_grid_steps(hint_tokens: Sequence[int], grid_tokens: int) -> tuple:
    """Hint positions as state-grid steps: a position inside a step keeps the state at the deepest whole
    step it covers (the state that exists there)."""
    return tuple(t // grid_tokens for t in hint_tokens)


def validate_request(obj: Any, input_ids: Optional[list]) -> None:
    """After SGLang's own checks of a request and any truncation: refuse bad hints with the ValueError
    SGLang turns into a 400."""
    sampling_params = getattr(obj, "sampling_params", None)
    if isinstance(sampling_params, dict):
        parse_hints(sampling_params.get("custom_params"), len(input_ids) if input_ids is not None else 0)


def validate_one_request_after(result: Any, manager: Any, obj: Any, input_ids: Optional[list]) -> None:
    """AFTER `TokenizerManager._validate_one_request` (stock 0.5.23): `validate_request`."""
    validate_request(obj, input_ids)
    return None


_installed = False


def install() -> None:
    """Install the tokenizer-side check in this process (the server's main process, where SGLang's
    TokenizerManager runs); once per process. Through `register_request_validator` on a SGLang with
    upstream/series 0013, else a fail-closed AFTER hook (hooks.install_once)."""
    global _installed
    from sglang.srt.managers import tokenizer_manager

    register = getattr(tokenizer_manager, "register_request_validator", None)
    if register is not None:
        if not _installed:
            register(validate_request)
            _installed = True
        return
    from .hooks import install_once

    install_once(_GROUP, [(_TOKENIZER_TARGET, validate_one_request_after, "AFTER")])
