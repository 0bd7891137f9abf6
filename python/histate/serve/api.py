"""What `histate serve` accepts: the request bodies of `/generate` and `/v1/completions`, checked field by field.

A benchmark against a server that silently ignores part of a request measures something else than
was asked for (n=2 answered once, a stop string never applied, "stream": "false" streamed anyway),
so every field is one of three kinds:

* served: prompts (`text` / `input_ids`, `prompt`), `max_new_tokens` / `max_tokens`, `stream`,
  `stream_options.include_usage`, `rid`;
* accepted because they change nothing here: the sampling knobs (decoding is greedy whatever
  `temperature`, `top_p`, `top_k`, `min_p` or `seed` say -- documented), `ignore_eos` (the model has
  no EOS: every request produces exactly its max new tokens), `user`;
* not implemented, accepted only with their neutral value (`n: 1`, `logprobs: null`, `echo: false`,
  `stop: null`, `return_logprob: false`, a penalty of 0 ...): any other value is a 400 naming the
  field, as SGLang answers a request it cannot serve.

A field that is none of these (a typo such as `max_new_token`, or a feature this server does not
know) is a 400 naming it too, and so is a value of the wrong type ("stream": "false",
"sampling_params": []). Prompts are token ids below the vocabulary size or text the tokenizer
(histate/reference/tokenizer.py) covers, at most the max context long.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

MODEL_NAME = "histate-tiny-qwen3.5"
_ABSENT = object()


class BadRequest(ValueError):
    """A request this server answers with HTTP 400; the message names the field."""


@dataclass(frozen=True)
class Limits:
    """What a prompt and an output may be: the server's configuration, as the parser needs it."""

    tokenizer: object                  # CharTokenizer: encode(text), vocab_size
    max_context_num_tokens: int
    max_new_tokens: int


@dataclass(frozen=True)
class GenerateCall:
    """One request, parsed: what the engine runs and how the answer is framed."""

    token_ids: list
    max_new_tokens: int
    stream: bool
    include_usage: bool = False        # OpenAI: a final chunk with usage
    cache_details: bool = False        # OpenAI (SGLang's return_cached_tokens_details): sglext in the usage chunk
    rid: Optional[str] = None


# --- field kinds -------------------------------------------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and value == value  # NaN is not a number here


def _no_op(check, expected: str):
    """A field accepted because it cannot change a greedy, EOS-free answer; only its type is checked."""
    def parse(field: str, value) -> None:
        if value is not None and not check(value):
            raise BadRequest(f"{field} must be {expected}, got {json.dumps(value)}")
    return parse


def _neutral(*neutral_values):
    """A field this server does not implement: accepted only with a value that asks for nothing."""
    def parse(field: str, value) -> None:
        if value is None or any(value == v and type(value) is type(v) for v in neutral_values) or \
                (_is_number(value) and any(_is_number(v) and value == v for v in neutral_values)):
            return
        allowed = " or ".join(["null", *(json.dumps(v) for v in neutral_values)])
        raise BadRequest(f"{field}={json.dumps(value)} is not supported by histate serve (only {allowed})")
    return parse


_BOOL = _no_op(lambda v: isinstance(v, bool), "true or false")
_NUMBER = _no_op(_is_number, "a number")
_INT = _no_op(_is_int, "an integer")
_TEXT = _no_op(lambda v: isinstance(v, str), "a string")
_NO_STOP = _neutral("", [])

# SGLang's SamplingParams (sglang/srt/sampling/sampling_params.py), less max_new_tokens.
_SAMPLING_FIELDS = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "min_p": _NUMBER, "sampling_seed": _INT,
    "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL, "min_new_tokens": _INT,
    "n": _neutral(1), "stop": _NO_STOP, "stop_token_ids": _NO_STOP, "stop_regex": _NO_STOP,
    "frequency_penalty": _neutral(0), "presence_penalty": _neutral(0), "repetition_penalty": _neutral(1),
    "json_schema": _neutral(), "regex": _neutral(), "ebnf": _neutral(), "structural_tag": _neutral(),
    "logit_bias": _neutral({}), "custom_params": _neutral(),
}

# SGLang's GenerateReqInput (sglang/srt/managers/io_struct.py), less the prompt, sampling and stream.
_GENERATE_FIELDS = {
    "logprob_start_len": _INT, "return_text_in_logprobs": _BOOL,
    "return_logprob": _neutral(False), "top_logprobs_num": _neutral(0), "token_ids_logprob": _neutral(),
    "lora_path": _neutral(), "return_hidden_states": _neutral(False), "return_routed_experts": _neutral(False),
    "custom_logit_processor": _neutral(), "image_data": _neutral(), "audio_data": _neutral(),
    "video_data": _neutral(), "session_params": _neutral(),
    # What sglang-router 0.3.2 adds to every /generate it forwards (seen on the wire): logging switches
    # with no effect here, and off-by-default features.
    "log_metrics": _BOOL, "no_logs": _BOOL, "background": _neutral(False), "return_bytes": _neutral(False),
    "return_entropy": _neutral(False),
}

# OpenAI's completions request (and SGLang's / vLLM's extensions of it), less prompt, model,
# max_tokens, stream, stream_options and return_cached_tokens_details.
_COMPLETION_FIELDS = {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "min_p": _NUMBER, "seed": _INT, "user": _TEXT,
    "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "no_stop_trim": _BOOL, "min_tokens": _INT,
    "n": _neutral(1), "best_of": _neutral(1), "logprobs": _neutral(), "echo": _neutral(False),
    "stop": _NO_STOP, "stop_token_ids": _NO_STOP, "suffix": _neutral(""),
    "frequency_penalty": _neutral(0), "presence_penalty": _neutral(0), "repetition_penalty": _neutral(1),
    "logit_bias": _neutral({}), "lora_path": _neutral(), "return_hidden_states": _neutral(False),
    "return_routed_experts": _neutral(False), "return_token_ids": _neutral(False),
}


def _check_fields(body: dict, known: dict, served: tuple, where: str = "") -> None:
    """Every field of `body` is served or in `known` (whose parser then checks its value)."""
    for name, value in body.items():
        field = f"{where}{name}"
        if name in served:
            continue
        if name not in known:
            raise BadRequest(f"unknown field {field!r}")
        known[name](field, value)


# --- shared parts ------------------------------------------------------------------------------

def _strict_bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _object(body: dict, name: str) -> dict:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object, got {type(value).__name__}")
    return value


def _count(value, field: str, default: int, limits: Limits) -> int:
    value = default if value is None else value
    if not _is_int(value) or not 1 <= value <= limits.max_new_tokens:
        raise BadRequest(f"{field} must be an integer in [1, {limits.max_new_tokens}], got {value!r}")
    return value


def _single(value, field: str):
    """A batch of one prompt is that prompt; larger batches are not served (one request at a time)."""
    if isinstance(value, list) and value and all(isinstance(v, (list, str)) for v in value):
        if len(value) != 1:
            raise BadRequest(f"{field}: a batch of {len(value)} prompts; histate serve takes one per request")
        return value[0]
    return value


def _prompt_ids(value, field: str, limits: Limits) -> list:
    """Token ids of a prompt given as text or as ids, checked against the vocabulary and max context."""
    value = _single(value, field)
    if isinstance(value, str):
        if not value:
            raise BadRequest(f"{field} is empty")
        try:
            ids = limits.tokenizer.encode(value)
        except ValueError as err:
            raise BadRequest(f"{field}: {err}") from None
    elif isinstance(value, list) and value:
        vocab = limits.tokenizer.vocab_size
        if not all(_is_int(t) and 0 <= t < vocab for t in value):
            raise BadRequest(f"{field}: every token id must be an integer in [0, {vocab})")
        ids = value
    else:
        raise BadRequest(f"{field} must be text or a non-empty list of token ids")
    if len(ids) > limits.max_context_num_tokens:
        raise BadRequest(f"{field}: {len(ids)} tokens exceed the max context of {limits.max_context_num_tokens}")
    return ids


def _rid(value) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"rid must be a string, got {value!r}")
    return value


# --- the two endpoints -------------------------------------------------------------------------

def _check_model(body: dict) -> None:
    model = body.get("model")
    if model is not None and model != MODEL_NAME:
        raise BadRequest(f"model {model!r} is not served here; the only model is {MODEL_NAME!r} (GET /v1/models)")


def parse_generate(body: dict, limits: Limits) -> GenerateCall:
    """SGLang's `POST /generate`: `text` or `input_ids`, `sampling_params`, `stream`, `rid`, and `model`
    (null or this server's: sglang-router forwards `"model": null`)."""
    _check_fields(body, _GENERATE_FIELDS, ("text", "input_ids", "sampling_params", "stream", "rid", "model"))
    _check_model(body)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise BadRequest("give exactly one of text and input_ids")
    token_ids = _prompt_ids(body["text"], "text", limits) if has_text else \
        _prompt_ids(body["input_ids"], "input_ids", limits)
    params = _object(body, "sampling_params")
    _check_fields(params, _SAMPLING_FIELDS, ("max_new_tokens",), where="sampling_params.")
    max_new = _count(params.get("max_new_tokens"), "sampling_params.max_new_tokens", 128, limits)
    return GenerateCall(token_ids, max_new, _strict_bool(body, "stream"), rid=_rid(body.get("rid")))


def parse_completion(body: dict, limits: Limits) -> GenerateCall:
    """OpenAI's `POST /v1/completions`: `prompt` (text or token ids), `max_tokens`, `stream`, `stream_options`."""
    _check_fields(body, _COMPLETION_FIELDS, ("model", "prompt", "max_tokens", "stream", "stream_options",
                                             "return_cached_tokens_details"))
    model = body.get("model", _ABSENT)
    if model is not _ABSENT and model != MODEL_NAME:
        raise BadRequest(f"model {model!r} is not served here; the only model is {MODEL_NAME!r} (GET /v1/models)")
    if "prompt" not in body:
        raise BadRequest("prompt is required")
    token_ids = _prompt_ids(body["prompt"], "prompt", limits)
    max_new = _count(body.get("max_tokens"), "max_tokens", 16, limits)
    stream = _strict_bool(body, "stream")
    options = _object(body, "stream_options")
    _check_fields(options, {"continuous_usage_stats": _neutral(False)}, ("include_usage",), where="stream_options.")
    if options and not stream:
        raise BadRequest("stream_options is only allowed with stream: true")
    return GenerateCall(token_ids, max_new, stream, include_usage=_strict_bool(options, "include_usage"),
                        cache_details=_strict_bool(body, "return_cached_tokens_details"))
