"""Real SGLang 0.5.23 objects on a CPU-only machine: shared by test/sglang and benchmark/sglang_ops.py.

  stubs  SGLang's own triton stub plus torchvision / datasets stubs, installed before `import sglang`
  pools  builders for SGLang's real FULL + MAMBA pools and caches on device="cpu", and a request driver

Never imported by `histate` (the plugin's production path runs on real CUDA wheels);
test/core/test_layering.py checks that nothing outside test/ imports test modules, and that the package
does not reach this one.
"""
