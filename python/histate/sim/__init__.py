"""histate.sim: trace replay simulator.

  request     Request / Session / Workload records shared by every workload source
  traces      loaders: Weka Claude Code sessions, TraceLab rounds, Mooncake requests
  workloads   synthetic agent workloads (mutations) and the paper's mutation microbenchmark
  costs       model specs, hardware presets, transfer (eq. 2) and step-time (roofline) costs
  engine      discrete-event GPU model: restores, continuous batching, chunked prefill

Depends on histate.core only (one way); orjson and tqdm come with the `sim` extra.
"""
