"""Several `histate serve` workers behind sglang-router, on loopback.

  workers   start/stop N `histate serve` subprocesses on free 127.0.0.1 ports, each with its own temp
            directory (SSD tier, tokenizer files), and SIGKILL one for failover tests
  router    start/stop sglang-router on 127.0.0.1 in front of them; list/add/remove its workers

Everything binds and talks to 127.0.0.1 only; the router is started with HF_ENDPOINT pointing at a
closed loopback port so it never reaches for a model hub.
"""
