"""Several `histate serve` workers behind sglang-router, on loopback.

  workers   start/stop N `histate serve` subprocesses on free 127.0.0.1 ports, each with its own temp
            directory (SSD tier, tokenizer files), and SIGKILL one for failover tests
  router    start/stop sglang-router on 127.0.0.1 in front of them; list/add/remove its workers
  run       `histate cluster`: a Mooncake L3 (histate.l3.services), the workers, the router, and the
            workload through them four times (failover with and without L3, a killed store service)
  faults    `histate cluster --faults`: every L3 fault (damaged objects, a full store, a paused store
            service, a killed store service, a killed and restarted master) on one cluster, each a miss
  sim_twin  the simulator's twin of a `histate cluster` run (benchmark/cluster_sim_vs_live.py)

Everything binds and talks to 127.0.0.1 only; the router is started with HF_ENDPOINT pointing at a
closed loopback port so it never reaches for a model hub.
"""
