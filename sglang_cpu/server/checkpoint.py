"""The tiny hybrid checkpoint the CPU server serves: written by the project, nothing downloaded.

`histate.reference.model.build_tiny_qwen35()` (8 layers: 6 Gated-DeltaNet + 2 gated full attention,
hidden 128, vocab 512, 1.46 M parameters, seeded random weights with slow recurrent decay so a wrong
state shows) saved with `save_pretrained`, plus the project's one-character-per-token tokenizer, which
works offline. Two fields SGLang reads that transformers 5.19 does not save are added:
`full_attention_interval` (configs/qwen3_next.py:264 reads it; transformers saves only `layer_types`)
and `architectures`.

fp32 by default: on a random model bf16 can flip near-tied greedy tokens between two computations of
the same prefix, which would hide what the exactness tests look for; bf16 is written on request.
A directory is written once per (spec, dtype) and reused: `ensure_checkpoint` checks a stamp.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

STAMP = "histate-checkpoint.json"
CONTEXT_NUM_TOKENS = 16384


def ensure_checkpoint(directory: Path, dtype: str = "float32") -> Path:
    """Write the checkpoint to `directory` unless the same one is there; return the directory. Servers
    started together call this at once: an exclusive lock next to the directory makes one write it and
    the others wait (the stamp is written last, so a half-written checkpoint is never taken)."""
    import fcntl

    from histate.reference.model import TinyModelSpec

    directory = Path(directory)
    spec = TinyModelSpec()
    stamp = {"spec": asdict(spec), "dtype": dtype, "format": 1}
    stamp_path = directory / STAMP
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp_path.is_file() and json.loads(stamp_path.read_text()) == stamp:
            return directory
        stamp_path.unlink(missing_ok=True)
        _write(directory, spec, dtype)
        stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
    return directory


def _write(directory: Path, spec, dtype: str) -> None:
    import torch

    from histate.reference.model import build_tiny_qwen35
    from histate.reference.tokenizer import CharTokenizer

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = build_tiny_qwen35(spec).to(torch_dtype)
    model.config.torch_dtype = torch_dtype
    model.config.architectures = ["Qwen3_5ForCausalLM"]
    model.config.full_attention_interval = 4  # the reference pattern: 3 GDN layers, then 1 attention layer
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    CharTokenizer(spec.vocab_size).write_hf_tokenizer(directory, CONTEXT_NUM_TOKENS)
