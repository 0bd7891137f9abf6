"""Application-placed checkpoints in SGLang's own server (docs/hints.md): `custom_params.histate_checkpoints`.

On the shared HiState server, against stock SGLang answering cold:
  * a prompt naming token 1,344 (page 21 of the 64-token grid) and 1,000 keeps states there: a later
    prompt sharing exactly its first 1,344 tokens resumes at 1,344, one sharing its first 1,000 at 960
    (the deepest whole grid step), both answers exact. The same pair without the hint resumes below
    1,344: eq. 5's grid is even page counts from 0, a depth bin is planned at its first page (8k + 1),
    near-end positions lie within 8 pages of the 62-page end, so nothing else plans page 21.
  * bad hints (not a list, too many, not a positive integer, beyond the prompt) are answered 400 with
    one line naming the field, through /generate and /v1/completions, and change nothing: the refused
    prompt, sent again without hints, finds nothing cached.
"""
from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

from .client import LOGPROB_TOLERANCE, Answer, generate, post_json, tokens

HINTS_KEY = "histate_checkpoints"


def _generate(url: str, prompt: list, hints) -> Answer:
    out = post_json(url + "/generate", {
        "input_ids": list(prompt), "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True,
                            "custom_params": {HINTS_KEY: hints}}})
    meta = out["meta_info"]
    return Answer(tuple(out["output_ids"]), int(meta["cached_tokens"]),
                  tuple(float(entry[0]) for entry in meta["output_token_logprobs"]))


def _refused(url: str, path: str, payload: dict) -> str:
    request = urllib.request.Request(url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            raise AssertionError(f"{path} accepted {payload!r}: {response.status}")
    except urllib.error.HTTPError as error:
        assert error.code == 400, (path, error.code)
        body = json.loads(error.read())
    message = body.get("message") or body["error"]["message"]
    assert f"custom_params.{HINTS_KEY}: " in message and "\n" not in message, message
    return message


def _exact(reference_url: str, prompt: list, served: Answer, where: str) -> None:
    cold = generate(reference_url, prompt)
    assert served.output_ids == cold.output_ids, f"{where}: greedy answer differs from stock's cold one"
    gap = served.max_logprob_gap(cold)
    assert gap <= LOGPROB_TOLERANCE, f"{where}: logprobs {gap:.2e} off a cold prefill"


def test_a_named_position_keeps_the_state_a_later_prompt_resumes_from(servers):
    url, rng = servers.histate.url, random.Random(3131)
    control = tokens(rng, 4000)
    generate(url, control)
    branch = control[:1344] + tokens(rng, 300)
    unhinted = generate(url, branch).cached_tokens
    assert unhinted < 1344 and unhinted % 64 == 0, unhinted

    prompt = tokens(rng, 4000)
    _exact(servers.reference.url, prompt, _generate(url, prompt, [1344, 1000]), "hinted prompt")
    at_hint = prompt[:1344] + tokens(rng, 300)
    served = generate(url, at_hint)
    assert served.cached_tokens == 1344
    _exact(servers.reference.url, at_hint, served, "resumed at the hint")
    inside = prompt[:1000] + tokens(rng, 200)
    served = generate(url, inside)
    assert served.cached_tokens == 960
    _exact(servers.reference.url, inside, served, "resumed at the grid step under the hint")


def test_bad_hints_are_refused_with_a_400_and_change_nothing(servers):
    url, rng = servers.histate.url, random.Random(3132)
    prompt = tokens(rng, 500)
    messages = [
        _refused(url, "/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 2, "custom_params": {HINTS_KEY: bad}}})
        for bad in ("256", [256] * 17, [0], [True], [2.5], [501])]
    assert "beyond the prompt (500 tokens)" in messages[-1] and "at most 16 positions" in messages[1]
    _refused(url, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 2,
                                      "custom_params": {HINTS_KEY: [501]}})
    assert generate(url, prompt).cached_tokens == 0  # nothing of the refused requests was cached
