"""histate.bench: replay agent sessions against a live server and put the runs next to the simulator's.

  prompts      page keys -> token ids: a page's tokens are a function of its key, so requests share
               exactly the prompt prefixes the workload says they share
  scaling      token and time scale of a `Workload` (the same scaled workload feeds bench and replay)
  backends     streaming clients: SGLang native `/generate`, OpenAI-compatible `/v1/completions`
  sessions     closed-loop sessions with `histate replay`'s admission, in wall-clock time (asyncio)
  run          `histate bench`: workload -> server -> requests.csv / summary.json in replay's schema
  calibrate    `histate bench --calibrate`: measured prefill latency -> the `--calibration` CSV
  compare      `histate compare`: runs side by side (sim vs live), table and TTFT CDF per policy

Workloads come from `histate.sim` (traces, synthetic generators, admission order) and reports from
`histate.sim.report`, so a live run and a simulated run of the same workload are comparable row by row.
Needs the `bench` extra (aiohttp, tqdm).
"""
