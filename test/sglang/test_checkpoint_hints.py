"""Application-placed checkpoints in the plugin: the `custom_params.histate_checkpoints` check, the
scheduler's reading of it, and the plan it feeds (docs/hints.md). The 400 through SGLang's HTTP API and
the resumed answers are test/server/test_checkpoint_hints.py; the same decisions as the simulator on one
stream, states compared with cold prefills, are test_differential.py's `hinted` case."""
from __future__ import annotations

import types
from array import array

import pytest

from histate.sglang_plugin.checkpoint_hints import (HINTS_KEY, MAX_CHECKPOINT_HINTS, CheckpointHintError,
                                                   hint_grid_steps, hints_of, parse_hints,
                                                   validate_one_request_after)

from sglang_cpu.pools import build_cache, build_pools, publish_server_args


@pytest.mark.parametrize("value, want", [
    (None, ()), ([], ()), ([1000], (1000,)), ([1280, 64, 1280], (64, 1280)), ([4096], (4096,)),
])
def test_good_hints_parse_to_sorted_unique_positions(value, want):
    assert parse_hints({HINTS_KEY: value}, 4096) == want
    assert parse_hints(None, 4096) == () and parse_hints({"other": 1}, 4096) == ()


@pytest.mark.parametrize("value, fragment", [
    ("1000", "expected a list of token positions, got str"),
    (1000, "expected a list of token positions, got int"),
    ({"at": 1000}, "expected a list of token positions, got dict"),
    (list(range(1, MAX_CHECKPOINT_HINTS + 2)), f"at most {MAX_CHECKPOINT_HINTS} positions, got {MAX_CHECKPOINT_HINTS + 1}"),
    ([0], "each position must be an integer >= 1, got 0"),
    ([-64], "got -64"),
    ([True], "got True"),
    ([64.0], "got 64.0"),
    (["end"], "got 'end'"),
    ([4097], "position 4097 is beyond the prompt (4096 tokens)"),
])
def test_bad_hints_raise_one_line_naming_the_field(value, fragment):
    with pytest.raises(CheckpointHintError) as error:
        parse_hints({HINTS_KEY: value}, 4096)
    message = str(error.value)
    assert message.startswith(f"custom_params.{HINTS_KEY}: ") and fragment in message and "\n" not in message
    assert isinstance(error.value, ValueError)  # what SGLang's HTTP layer answers with a 400


def test_the_tokenizer_check_reads_the_request_sampling_params_and_the_prompt_after_truncation():
    obj = types.SimpleNamespace(sampling_params={"custom_params": {HINTS_KEY: [900]}})
    assert validate_one_request_after(None, object(), obj, list(range(1000))) is None
    with pytest.raises(CheckpointHintError, match="beyond the prompt"):
        validate_one_request_after(None, object(), obj, list(range(800)))
    # no sampling params dict (an embedding request) or no hints: nothing to check
    assert validate_one_request_after(None, object(), types.SimpleNamespace(sampling_params=None), [1]) is None


def test_the_scheduler_reads_hints_without_ever_raising():
    def req(params, num_tokens=1000):
        return types.SimpleNamespace(sampling_params=types.SimpleNamespace(custom_params=params),
                                     origin_input_ids=array("q", range(num_tokens)))

    assert hints_of(req({HINTS_KEY: [640, 128]})) == (128, 640)
    assert hints_of(req({HINTS_KEY: "bad"})) == ()
    assert hints_of(req({HINTS_KEY: [5000]})) == ()
    assert hints_of(req(None)) == () and hints_of(types.SimpleNamespace()) == ()


def test_hint_positions_floor_to_the_state_grid():
    assert hint_grid_steps((64, 1000, 1343, 1344), 64) == (1, 15, 20, 21)


def test_the_plugin_plans_a_named_position_its_own_rule_would_not(sglang_plugins):
    publish_server_args(page_size=64)
    cache = build_cache("histate", build_pools(64 * 256, 8, page_size=64))
    grid = cache.histate.grid_tokens
    assert grid == 64
    plain = cache.plan_checkpoints(0, 4000)
    assert 1344 not in plain  # page 21: odd, far from the end (the precondition)
    hinted = cache.plan_checkpoints(0, 4000, None, (1344, 1000, 5000 // 2))
    assert {1344, 960, 2496} <= set(hinted) and set(plain) <= set(hinted)
    assert all(position % grid == 0 for position in hinted)
