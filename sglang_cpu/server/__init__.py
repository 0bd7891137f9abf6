"""SGLang 0.5.23's own server on a CPU-only machine: test and bench support, never imported by `histate`.

  kernels     torch stand-in for the `sgl_kernel` ops SGLang's CPU engine calls (GDN from gdn_kernels)
  patches     post-import patches of the platform checks and Triton-only kernels with no CPU path
  shim        installs stubs, kernels and patches in a process before `import sglang`
  site/       sitecustomize.py: runs the shim in every process SGLang spawns
  checkpoint  the tiny random-weight Qwen3.5 checkpoint and offline tokenizer the server loads
  launch      `python -m sglang.launch_server` with the CPU flags; `CpuServer` for tests and benches
"""
