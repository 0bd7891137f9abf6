# HiState developer entry points. `make help` lists them.
# Every install passes the torch constraint: an unpinned torch pulls multi-GB CUDA wheels.
PY        ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
PIP       := $(VPY) -m pip install -q -c constraints/cpu.txt
STAMP     := $(VENV)/.histate-installed-v3
PYTEST    := $(VPY) -m pytest
HYPOTHESIS_PROFILE ?= ci
TEST_JOBS ?= 2

.PHONY: help venv demo test test-fast test-gpu gpu-check mutants cpu-server bench golden size clean cluster upstream-check

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): python/pyproject.toml constraints/cpu.txt Makefile
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e "python[sim,storage,test,reference,sglang,bench,server]"
	# State-capture kernels (pure Python; triton only imported on CUDA, never installed here).
	$(PIP) -e sgl-kernel-ext
	# SGLang without its dependency tree (it would pull CUDA torch, sgl-kernel, flashinfer ...).
	$(PIP) --no-deps sglang==0.5.23
	# SGLang's grammar backend, imported by its server; --no-deps: its metadata asks for triton (~1 GB, CUDA).
	$(PIP) --no-deps xgrammar==0.2.7
	# NIXL: the meta package plus one backend wheel only (the cu12 twin is 250 MB of dead weight on CPU).
	$(PIP) --no-deps nixl==1.5.1 nixl-cu13==1.5.1 || echo "NIXL unavailable: storage uses the file fallback"
	# Scale-out: Mooncake Store (L3) and sglang-router. Mooncake's store module links libibverbs.so.1
	# (Debian's libibverbs1) even for TCP; the cluster tests skip, naming what is missing, without them.
	ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq libibverbs1; } \
		|| echo "libibverbs1 unavailable: the L3/cluster tests will skip"
	$(PIP) -e "python[cluster]" || echo "Mooncake/sglang-router unavailable: the L3/cluster tests will skip"
	touch $(STAMP)

venv: $(STAMP)  ## create .venv with everything the tests need (idempotent)

WEKA_TRACE ?= ../shared/traces/cc-traces-weka-042026/traces.jsonl.gz

demo: venv  ## replay ../shared's Weka sessions (--preset paper: the paper's load, 125 sessions) or, without them, the synthetic agent workload, through every policy
	if [ -f $(WEKA_TRACE) ]; then $(VENV)/bin/histate replay --trace $(WEKA_TRACE) --preset paper --out out/demo; \
	else $(VENV)/bin/histate replay --out out/demo; fi

cluster: venv  ## a loopback fleet (Mooncake L3, 2 histate serve workers, sglang-router): four runs, one killing a worker mid-run, one the store service (docs/scaleout.md)
	$(VENV)/bin/histate cluster --out out/cluster

test: venv  ## run the CPU test suite (what CI runs): TEST_JOBS pytest workers, the tests that start servers all in one
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(PYTEST) test -q -n $(TEST_JOBS) --dist loadgroup

upstream-check: venv  ## apply upstream/series to a copy of the installed SGLang and test the copy (docs/upstream.md; also in `make test`)
	$(VPY) upstream/check.py

test-fast: venv  ## core tests only, small hypothesis budget
	HYPOTHESIS_PROFILE=dev $(PYTEST) test/core -q

test-gpu: venv  ## GPU-only tests (kernels, exactness on CUDA); skipped without CUDA
	$(PYTEST) test -q -m gpu

ARGS ?=
cpu-server: venv  ## SGLang's own server on this CPU, in the foreground: make cpu-server ARGS="--enable-histate" (tiny random Qwen3.5, stand-in kernels: docs/sglang.md)
	$(VPY) -m sglang_cpu.server.launch $(ARGS)

gpu-check:  ## on a lent GPU machine: SGLang's Triton GDN kernels under HiState's capture, the GPU tests (benchmark/gpu_check/README.md)
	bash benchmark/gpu_check/run.sh

mutants: venv  ## one-line mutants (benchmark/mutants/mutants.toml) applied to a temporary copy, each must fail its targeted tests; ~3 min
	HYPOTHESIS_PROFILE=dev $(VPY) benchmark/mutants/run.py

bench: venv  ## run every benchmark and print tables (numbers go to docs/results.md by hand)
	$(VPY) benchmark/core_ops.py
	$(VPY) benchmark/paper_weka.py --seeds 0 1 2
	$(VPY) benchmark/storage_io.py --reps 15
	$(VPY) benchmark/mutation.py
	$(VPY) benchmark/ablation.py
	$(VPY) benchmark/sim_substrate.py
	$(VPY) benchmark/sglang_ops.py
	$(VPY) benchmark/sglang_step.py

golden: venv  ## regenerate test/core/golden_core.json and test/sim/golden_replay.json (the only writer: tests never rewrite them); prints what moved -- review `git diff` before committing
	$(VPY) test/update_golden.py

size:  ## line counts per module
	@find python/histate -name '*.py' | xargs wc -l | sort -n

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .hypothesis
