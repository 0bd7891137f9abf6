"""The test that ships with upstream/series 0013 ([plugins] request validators and request-level info keys).

Written as it would sit in SGLang's own test tree (no HiState import). The tokenizer manager's validation is
run on a minimal manager (the attributes `_validate_one_request` reads); the streamer's question is asked
of the class. Registries are restored after each test.
"""
from __future__ import annotations

import types

import pytest
from sglang.srt.managers import tokenizer_manager
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler_components import output_streamer


@pytest.fixture
def registries(monkeypatch):
    monkeypatch.setattr(tokenizer_manager, "_REQUEST_VALIDATORS", [])
    monkeypatch.setattr(output_streamer, "_REQUEST_LEVEL_INFO_KEYS", set())


def manager(context_len: int = 64, allow_auto_truncate: bool = False):
    from sglang_cpu.pools import publish_server_args

    publish_server_args()  # the execution context `_validate_one_request` reads
    m = object.__new__(tokenizer_manager.TokenizerManager)
    m.context_len, m.num_reserved_tokens, m.is_generation = context_len, 0, True
    m.allow_auto_truncate, m.validate_total_tokens = allow_auto_truncate, False
    m.model_config = types.SimpleNamespace(joint_head_config=None, pointer_head=None)
    return m


def request(num_tokens: int, custom_params=None):
    return GenerateReqInput(input_ids=list(range(num_tokens)),
                            sampling_params={"max_new_tokens": 4, "custom_params": custom_params})


def test_a_registered_validator_sees_every_request_after_sglangs_checks_and_truncation(registries):
    seen = []
    tokenizer_manager.register_request_validator(lambda obj, input_ids: seen.append((obj, len(input_ids))))
    obj, ids = request(100), list(range(100))
    manager(context_len=64, allow_auto_truncate=True)._validate_one_request(obj, ids)
    assert seen == [(obj, 64)]  # the prompt as SGLang truncated it


def test_a_validator_refuses_a_request_with_the_valueerror_sglang_answers_with_400(registries):
    def no_foo(obj, input_ids):
        if (obj.sampling_params.get("custom_params") or {}).get("foo"):
            raise ValueError("custom_params.foo is not allowed")

    tokenizer_manager.register_request_validator(no_foo)
    m = manager()
    m._validate_one_request(request(8), list(range(8)))
    with pytest.raises(ValueError, match="custom_params.foo is not allowed"):
        m._validate_one_request(request(8, {"foo": 1}), list(range(8)))


def test_sglangs_own_refusal_comes_first(registries):
    seen = []
    tokenizer_manager.register_request_validator(lambda obj, input_ids: seen.append(obj))
    with pytest.raises(ValueError, match="longer than the model's context length"):
        manager(context_len=64)._validate_one_request(request(100), list(range(100)))
    assert seen == []


def test_a_registered_info_key_is_sent_once_per_request(registries):
    ask = output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key
    streamer = object.__new__(output_streamer.SchedulerOutputStreamer)
    assert not ask(streamer, "why_missed")
    output_streamer.register_request_level_info_key("why_missed")
    assert ask(streamer, "why_missed") and not ask(streamer, "other")
