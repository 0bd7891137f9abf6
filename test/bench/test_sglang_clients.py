"""Other clients measure `histate serve` correctly: SGLang's own `bench_serving` and the `openai` package.

Both stamp TTFT on the first streamed event with non-empty text, so the server must stream real text:
the reference tokenizer (histate/reference/tokenizer.py) gives every token one character. SGLang's
client also tokenizes its datasets itself, with the Hugging Face files the server reports as
`tokenizer_path` in /model_info. bench_serving runs as `python -m sglang.bench_serving` in a
subprocess, with the repository's CPU stubs for triton/torchvision/datasets (sglang_cpu/stubs.py).
"""
import importlib.util
import json
import random
import time

import pytest

from histate.reference.tokenizer import CharTokenizer
from test.server.client import run_sglang_module


def test_every_id_is_one_character_and_decode_then_encode_is_the_identity():
    tokenizer = CharTokenizer(512)
    ids = list(range(512))
    assert all(len(tokenizer.token_text(i)) == 1 for i in ids)
    assert tokenizer.encode(tokenizer.decode(ids)) == ids
    assert tokenizer.encode("caf\u00e9\n") == [99, 97, 102, 233, 10]
    with pytest.raises(ValueError, match=r"\(U\+20AC\) at position 1 has no token"):
        tokenizer.encode("a\u20ac")


def test_the_hugging_face_files_are_the_same_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = CharTokenizer(512)
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer.write_hf_tokenizer(tmp_path, 16384)))
    assert (hf.vocab_size, hf.num_special_tokens_to_add()) == (512, 0)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(512) for _ in range(300)]
        assert hf.decode(ids) == tokenizer.decode(ids)
        assert hf.encode(tokenizer.decode(ids)) == ids
    text = "Hello,  world!\n\tcaf\u00e9 "
    assert hf.encode(text) == tokenizer.encode(text)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai"])
def test_sglang_bench_serving_measures_ttft_and_lengths(histate_server, tmp_path, backend):
    """Text prompts of n random tokens, forced outputs: every request succeeds with a TTFT > 0 that is
    less than its latency, the server counts the prompt the client made, and the text is one
    character per output token."""
    out = tmp_path / "bench_serving.jsonl"
    argv = ["--backend", backend, "--base-url", histate_server.url, "--dataset-name", "random-ids",
            "--num-prompts", "3", "--random-input-len", "150", "--random-output-len", "6", "--random-range-ratio", "1",
            "--output-file", str(out), "--output-details", "--disable-tqdm", "--warmup-requests", "1"]
    done = run_sglang_module("sglang.bench_serving", argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text().splitlines()[-1])
    assert result["completed"] == 3, result.get("errors")
    assert result["input_lens"] == [150] * 3 and result["output_lens"] == [6] * 3
    assert all(ttft > 0 for ttft in result["ttfts"]) and [len(itl) for itl in result["itls"]] == [5] * 3
    assert 0 < result["mean_ttft_ms"] < result["mean_e2e_latency_ms"]
    assert [len(text) for text in result["generated_texts"]] == [6] * 3


def test_openai_client_streams_text_and_measures_ttft(histate_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=histate_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Refactor the parser so that every error names its line."
    whole = client.completions.create(model="histate-tiny-qwen3.5", prompt=prompt, max_tokens=5, temperature=0)
    start = time.perf_counter()
    first_s, texts, usage = None, [], None
    for chunk in client.completions.create(model="histate-tiny-qwen3.5", prompt=prompt, max_tokens=5, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            first_s = first_s or time.perf_counter() - start
            texts.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert first_s is not None and first_s > 0
    assert len(texts) == 5 and "".join(texts) == whole.choices[0].text
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 5)
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model="histate-tiny-qwen3.5", prompt=prompt, max_tokens=1, n=2)
