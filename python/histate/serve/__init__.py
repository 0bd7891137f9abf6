"""histate.serve: `histate serve`, a real server on CPU to run `histate bench` against.

  engine   the reference executor (tiny random-weight Qwen3.5, histate.core deciding what lives in
           which tier, the SSD store on disk) behind one worker thread, streaming greedy tokens
  http     the SGLang `/generate` subset and OpenAI `/v1/completions` (token-id prompts) over aiohttp

Needs the `reference` and `bench` extras and sgl-kernel-ext (`histate_kernels`).
"""
