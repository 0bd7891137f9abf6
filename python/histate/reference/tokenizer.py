"""The reference model's tokenizer: one token per character, so text prompts work and streamed text is real.

The tiny Qwen3.5 (model.py) has random weights and a 512-token vocabulary but no tokenizer, so a
server of it could only take token ids and stream empty text -- and SGLang's and OpenAI's clients
stamp TTFT on the first event with non-empty text. This tokenizer gives every id a text:

    token id i  <->  the character U+0000 + i   (0-127 ASCII, 128-255 Latin-1, 256-511 Latin Extended)

Why one character per token and not a byte-level BPE: a byte token can be half of a UTF-8 character
and decode to nothing on its own, while here (a) every token, decoded alone, is exactly one
character, so each streamed token carries non-empty text and text streams token by token with no
state; (b) `encode(decode(ids)) == ids` for every id sequence, so a client that draws n random ids
and sends them as text (sglang.bench_serving's random datasets) sends exactly n tokens. ASCII and
Latin-1 text round-trips. A character above U+01FF has no token: `encode` raises ValueError naming it
(the server answers 400) instead of dropping or replacing it, so a prompt is never silently changed.

`write_hf_tokenizer(directory)` writes the same mapping as Hugging Face files (tokenizer.json: a BPE
with no merges over the 512 characters, one pre-token per character; tokenizer_config.json), which
`transformers.AutoTokenizer.from_pretrained(directory)` loads. `histate serve` writes them and reports
the directory as `tokenizer_path` in `/model_info`, where sglang.bench_serving looks for a tokenizer.
(The Hugging Face tokenizer drops a character above U+01FF where this one refuses it.)
"""
from __future__ import annotations

import json
from pathlib import Path

HF_FILES = ("tokenizer.json", "tokenizer_config.json")


class CharTokenizer:
    """Token id i is the character chr(i), for i below the model's vocabulary size."""

    def __init__(self, vocab_size: int) -> None:
        if not 1 <= vocab_size <= 0xD800:  # stay below the surrogates: every id is a real character
            raise ValueError(f"vocab size must be in [1, {0xD800}], got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list:
        ids = [ord(ch) for ch in text]
        for position, token_id in enumerate(ids):
            if token_id >= self.vocab_size:
                raise ValueError(f"character {text[position]!r} (U+{token_id:04X}) at position {position} has "
                                 f"no token: the tokenizer covers U+0000-U+{self.vocab_size - 1:04X}")
        return ids

    def decode(self, token_ids) -> str:
        return "".join(self.token_text(t) for t in token_ids)

    def token_text(self, token_id: int) -> str:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return chr(token_id)

    def write_hf_tokenizer(self, directory: Path, model_max_length: int) -> Path:
        """Write tokenizer.json and tokenizer_config.json (needs the `tokenizers` package, which
        transformers brings); returns the directory."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        vocab = {chr(i): i for i in range(self.vocab_size)}
        hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one per character
        hf.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hf.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
        return directory
