"""histate.serve: `histate serve`, a real server on CPU to run `histate bench` against.

  engine   the reference executor (tiny random-weight Qwen3.5, histate.core deciding what lives in
           which tier, the SSD store on disk) behind one worker thread, streaming greedy tokens
  api      what a request may say: every field of `/generate` and `/v1/completions` served, accepted
           as a no-op, or refused with a 400 naming it
  http     the SGLang `/generate` subset and OpenAI `/v1/completions` over aiohttp, streaming the
           reference tokenizer's text (histate/reference/tokenizer.py) with every token

Needs the `reference` and `bench` extras and sgl-kernel-ext (`histate_kernels`).
"""
