"""`histate serve` answers the API subset the bench uses, and what it streams is the model's output.

Requests go through HTTP to the real server (conftest.histate_server). The greedy tokens it streams
after a cache hit must be the tokens of a cold run of the same prompt: the hit restored KV and a
recurrent checkpoint from histate.core's tiers, and any error there changes the logits (~1e-3 for a
state one token off, research/refmodel.md) long before it could leave argmax intact on every step.
"""
import json
import random
import urllib.error
import urllib.request

import pytest

from histate.cli import main


def _post(url, payload, raw=None):
    data = raw if raw is not None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            body = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read().decode())
    if body.startswith("data:"):
        events = [line[5:].strip() for line in body.splitlines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        return status, [json.loads(e) for e in events[:-1]]
    return status, json.loads(body)


def _ids(rng, n):
    return [rng.randrange(512) for _ in range(n)]


@pytest.fixture(scope="module")
def cold_runner():
    from histate.reference.runner import ModelRunner
    return ModelRunner("fp32")


def test_hit_streams_the_cold_runs_greedy_tokens(histate_server, cold_runner):
    url = histate_server.url + "/generate"
    rng = random.Random(11)
    first = _ids(rng, 300)
    status, events = _post(url, {"input_ids": first, "sampling_params": {"max_new_tokens": 1}, "stream": True})
    assert status == 200 and events[-1]["meta_info"]["cached_tokens"] == 0
    prompt = first + _ids(rng, 40)
    status, events = _post(url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
                                 "stream": True})
    assert status == 200
    token_events = [e for e in events if e["meta_info"]["finish_reason"] is None]
    assert [e["meta_info"]["completion_tokens"] for e in token_events] == [1, 2, 3, 4, 5]
    last = events[-1]
    meta = last["meta_info"]
    # 300 tokens -> pages of tokens [0, 299): 4 full pages, terminal checkpoint at 256 tokens.
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (340, 5, 256)
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["cached_tokens_details"] == {"device": 256, "host": 0, "storage": 0}
    assert meta["histate"]["kv_hit_tokens"] == 256 and meta["histate"]["checkpoint_tier"] == "gpu"
    assert all(e["meta_info"]["cached_tokens"] == 256 for e in events)  # known from the first token on
    cold = cold_runner.cold_run(prompt, 5)
    assert last["output_ids"] == list(cold.decode_tokens)


def test_non_streaming_and_openai_completions(histate_server):
    rng = random.Random(12)
    prompt = _ids(rng, 200)
    status, body = _post(histate_server.url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(body["output_ids"]) == 3 and body["meta_info"]["cached_tokens"] == 0
    url = histate_server.url + "/v1/completions"
    status, body = _post(url, {"prompt": prompt + _ids(rng, 10), "max_tokens": 2})
    assert status == 200
    assert body["usage"]["prompt_tokens"] == 210 and body["usage"]["completion_tokens"] == 2
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 199 tokens cached -> 3 pages
    status, events = _post(url, {"prompt": [prompt], "max_tokens": 2, "stream": True,
                                 "stream_options": {"include_usage": True}})
    assert status == 200
    assert [len(e["choices"]) for e in events] == [1, 1, 1, 0]
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 192


@pytest.mark.parametrize("path, payload, message", [
    ("/generate", {"input_ids": [1, 512]}, "every token id must be an integer in [0, 512)"),
    ("/generate", {"input_ids": []}, "text or a non-empty list of token ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens must be an integer in [1, "),
    ("/generate", {"input_ids": [1] * 16385}, "16385 tokens exceed the max context of 16384"),
    ("/v1/completions", {"prompt": [1], "max_tokens": True}, "max_tokens must be an integer"),
    # Silently accepted before (issue 19): each asks for something this server does not do.
    ("/v1/completions", {"model": "gpt-4", "prompt": [1]}, "model 'gpt-4' is not served here"),
    ("/v1/completions", {"prompt": [1], "n": 2}, "n=2 is not supported"),
    ("/v1/completions", {"prompt": [1], "logprobs": 1}, "logprobs=1 is not supported"),
    ("/v1/completions", {"prompt": [1], "echo": True}, "echo=true is not supported"),
    ("/v1/completions", {"prompt": [1], "stop": ["\n"]}, "stop=[\"\\n\"] is not supported"),
    ("/v1/completions", {"prompt": [1], "stream": "false"}, 'stream must be true or false, got "false"'),
    ("/v1/completions", {"prompt": [1], "max_token": 3}, "unknown field 'max_token'"),
    ("/v1/completions", {"prompt": [[1], [2]]}, "a batch of 2 prompts"),
    ("/generate", {"input_ids": [1], "sampling_params": []}, "sampling_params must be an object, got list"),
    ("/generate", {"input_ids": [1], "stream": "false"}, 'stream must be true or false, got "false"'),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 2}}, "sampling_params.n=2 is not supported"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": "x"}}, 'sampling_params.stop="x" is not supported'),
    ("/generate", {"input_ids": [1], "return_logprob": True}, "return_logprob=true is not supported"),
    ("/generate", {"input_ids": [1], "text": "a"}, "give exactly one of text and input_ids"),
    ("/generate", {"text": "\u20ac"}, "character '\u20ac' (U+20AC) at position 0 has no token"),
])
def test_bad_requests_get_400_with_a_message(histate_server, path, payload, message):
    status, body = _post(histate_server.url + path, payload)
    assert status == 400 and message in body["error"]["message"], body


def test_neutral_values_of_unserved_fields_are_accepted(histate_server):
    """What SGLang's and OpenAI's clients send by default must still be served."""
    status, body = _post(histate_server.url + "/v1/completions", {
        "model": "histate-tiny-qwen3.5", "prompt": [1, 2], "max_tokens": 1, "n": 1, "best_of": 1, "logprobs": None,
        "echo": False, "stop": None, "temperature": 0.0, "ignore_eos": True, "user": "u"})
    assert status == 200 and body["usage"]["completion_tokens"] == 1
    status, body = _post(histate_server.url + "/generate", {
        "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                                                 "stop": [], "n": 1},
        "lora_path": None, "return_logprob": False, "logprob_start_len": -1, "return_routed_experts": False})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 1


def test_text_prompts_and_streamed_text_are_the_tokenizers(histate_server):
    """A text prompt is the tokenizer's ids (one per character); every streamed token carries its text."""
    from histate.reference.tokenizer import CharTokenizer

    tokenizer = CharTokenizer(512)
    text = "def f(x):\n    return x  # caf\u00e9"
    status, by_ids = _post(histate_server.url + "/generate", {"input_ids": tokenizer.encode(text),
                                                              "sampling_params": {"max_new_tokens": 4}})
    status, events = _post(histate_server.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 4},
                                                              "stream": True})
    assert status == 200 and events[-1]["meta_info"]["prompt_tokens"] == len(text)
    assert events[-1]["output_ids"] == by_ids["output_ids"]  # the same prompt, as text or as ids
    assert [e["text"] for e in events[:4]] == [tokenizer.decode(by_ids["output_ids"][:n]) for n in range(1, 5)]
    status, chunks = _post(histate_server.url + "/v1/completions", {"prompt": text, "max_tokens": 4, "stream": True})
    token_chunks = [c["choices"][0]["text"] for c in chunks
                    if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(token_chunks) == 4 and all(len(t) == 1 for t in token_chunks)
    status, whole = _post(histate_server.url + "/v1/completions", {"prompt": text, "max_tokens": 4})
    assert "".join(token_chunks) == whole["choices"][0]["text"] == tokenizer.decode(by_ids["output_ids"])


def test_a_client_hanging_up_mid_stream_is_quiet(histate_server, caplog):
    """Closing the connection after the first token stops the request without an error in the log."""
    import logging
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(histate_server.url)
    body = json.dumps({"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 400}, "stream": True}).encode()
    request = (f"POST /generate HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
            sock.sendall(request)
            received = b""
            while b"data:" not in received:
                received += sock.recv(65536)
        time.sleep(1.0)  # the server writes its next tokens to the closed connection
        after = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
        assert _post(histate_server.url + "/generate", after)[0] == 200  # still serving
    problems = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not problems, [r.getMessage() for r in problems]


def test_bad_json_and_flush(histate_server):
    status, body = _post(histate_server.url + "/generate", None, raw=b"{not json")
    assert status == 400 and body["error"]["message"] == "body is not JSON"
    rng = random.Random(13)
    prompt = _ids(rng, 150)
    payload = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    _post(histate_server.url + "/generate", payload)
    assert _post(histate_server.url + "/generate", payload)[1]["meta_info"]["cached_tokens"] == 128
    with urllib.request.urlopen(urllib.request.Request(histate_server.url + "/flush_cache", method="POST")) as r:
        assert r.status == 200
    assert _post(histate_server.url + "/generate", payload)[1]["meta_info"]["cached_tokens"] == 0


def test_what_sglang_router_forwards_is_served_and_names_the_worker(histate_server):
    """sglang-router 0.3.2 re-serializes /generate with these fields (seen on the wire); the answer
    says which worker served it, as a router's worker URL names it."""
    status, body = _post(histate_server.url + "/generate", {
        "model": None, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2},
        "return_text_in_logprobs": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
        "background": False, "no_logs": False, "return_bytes": False, "return_entropy": False})
    assert status == 200, body
    assert "http://" + body["meta_info"]["histate"]["worker"] == histate_server.url
    status, body = _post(histate_server.url + "/generate", {"input_ids": [1], "model": "other"})
    assert status == 400 and "not served here" in body["error"]["message"]


def test_server_info_counts_requests(histate_server):
    def server_info(path):
        with urllib.request.urlopen(histate_server.url + path) as r:
            return json.loads(r.read())

    before = server_info("/server_info")
    assert (before["served_model_name"], before["dp_size"], before["url"]) == \
        ("histate-tiny-qwen3.5", 1, histate_server.url)
    assert "model_path" not in before  # sglang-router would look a tokenizer of that name up on the hub
    _post(histate_server.url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert server_info("/get_server_info")["num_requests"] == before["num_requests"] + 1


def test_info_endpoints(histate_server):
    with urllib.request.urlopen(histate_server.url + "/get_model_info") as r:
        info = json.loads(r.read())
    assert (info["vocab_size"], info["histate_policy"], info["page_num_tokens"]) == (512, "histate", 64)
    assert (info["max_context_num_tokens"], info["max_new_tokens"]) == (16384, 4096)
    with urllib.request.urlopen(histate_server.url + "/model_info") as r:  # SGLang's name, where bench_serving asks
        assert json.loads(r.read())["tokenizer_path"] == info["tokenizer_path"]
    with urllib.request.urlopen(histate_server.url + "/v1/models") as r:
        assert json.loads(r.read())["data"][0]["id"] == "histate-tiny-qwen3.5"


def test_policy_none_never_reuses(cold_runner):
    import queue

    from histate.serve.engine import Job, ServeConfig, ServingEngine

    engine = ServingEngine(ServeConfig("none"))
    try:
        prompt = _ids(random.Random(14), 200)
        for _ in range(2):
            events = queue.Queue()
            engine.submit(Job(prompt, 3, events.put))
            got = [events.get(timeout=60) for _ in range(4)]
            assert [e[0] for e in got] == ["token", "token", "token", "done"]
            assert got[-1][1]["cached_tokens"] == 0 and got[-1][1]["kv_hit_tokens"] == 0
            assert got[-1][1]["output_ids"] == list(cold_runner.cold_run(prompt, 3).decode_tokens)
    finally:
        engine.close()


@pytest.mark.parametrize("flag, value", [("--gpu-mib", "inf"), ("--cpu-mib", "Infinity"), ("--ssd-mib", "1e400"),
                                         ("--port", "70000")])
def test_serve_refuses_bad_numbers_in_one_line(capsys, flag, value):
    with pytest.raises(SystemExit) as stop:
        main(["serve", flag, value])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.startswith(f"histate serve: error: argument {flag}") and "\n" not in err


def test_serve_rejects_policies_it_cannot_mirror(capsys):
    assert main(["serve", "--policy", "unlimited"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("histate serve: error: --policy 'unlimited': choose one of histate,") and "\n" not in err
