# mtpc — two commands do everything: `make demo` and `make test`.
# Set-up is idempotent: a .venv is created if missing, torch is installed first when absent
# (TORCH_SPEC overrides, e.g. TORCH_SPEC='torch==2.11.0' for a CUDA machine), then the project + dev extras.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (one test file per worker at a time; every test runs one torch thread); 0: in-process
PYTEST_WORKERS ?= 2

.PHONY: setup kernels setup-compat test test-compat test-triton test-fast demo bench bench-circuits bench-head bench-loss bench-decode pretrain device-prep lint clean-cache

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)"
	$(PY) -m pip install -e '.[dev,data]'
	@touch $@

# the CPU kernels (mtpc/csrc/: the row-dot product, the btree greedy draft), compiled once per machine (~50 s); never fails
kernels: setup
	@$(PY) -m mtpc.kernels

# pytest's exit code 5 (nothing collected) is a failure, not a pass.
test: kernels
	@set +e; $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests — failing"; exit 1; fi; exit $$rc

# The oldest supported transformers (pyproject.toml states the range) in a second venv: the real-model
# conformance tests (tokenkit's byte Llama code imports only under transformers 4.x) and the backbone/decoding
# tests they rest on. COMPAT_PINS are the releases that go with that transformers.
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PINS ?= transformers==4.48.3 tokenizers==0.21.4 'huggingface-hub<1' peft==0.14.0
COMPAT_TESTS ?= tests/mtpc/test_backbones.py tests/mtpc/test_llama_engine.py tests/mtpc/test_decoding_engines.py \
	tests/mtpc/test_tokenizer.py tests/mtpc/test_tpu_llama.py tests/mtpc/test_evabyte_real.py \
	tests/experiments/test_tpu_llama_e2e.py

setup-compat: $(COMPAT_VENV)/.installed

$(COMPAT_VENV)/.installed: pyproject.toml Makefile
	@test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	@$(COMPAT_PY) -c "import torch" 2>/dev/null || $(COMPAT_PY) -m pip install "$(TORCH_SPEC)"
	$(COMPAT_PY) -m pip install -e '.[dev]' $(COMPAT_PINS)
	@touch $@

test-compat: setup-compat
	@set +e; $(COMPAT_PY) -m pytest -p no:cacheprovider -m "not slow or realmodel" $(COMPAT_TESTS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-compat: pytest collected no tests — failing"; exit 1; fi; exit $$rc

# The split-KV decode attention's and the fused ops' Triton kernels under Triton's interpreter on CPU tensors: triton (not a
# dependency; the device image's release) goes into its own folder on PYTHONPATH for these tests only,
# and MTPC_REQUIRE_TRITON=1 turns the kernel tests' skip into a failure.
TRITON_SITE ?= .triton-site
TRITON_SPEC ?= triton==3.6.0
TRITON_TESTS ?= tests/mtpc/test_decode_attention.py tests/mtpc/test_fused_ops.py \
	tests/bench/test_bench_dry_runs.py::test_bench_gpu_split_kv_part_runs_under_the_triton_interpreter

$(TRITON_SITE)/.installed: Makefile
	$(PY) -m pip install -q --no-deps --upgrade --target $(TRITON_SITE) "$(TRITON_SPEC)"
	@touch $@

test-triton: kernels $(TRITON_SITE)/.installed
	@set +e; TRITON_INTERPRET=1 MTPC_REQUIRE_TRITON=1 PYTHONPATH=$(TRITON_SITE) $(PY) -m pytest -p no:cacheprovider \
	$(TRITON_TESTS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-triton: pytest collected no tests — failing"; exit 1; fi; exit $$rc

test-fast: setup
	$(PY) -m pytest -m "not slow and not slurm" $(PYTEST_ARGS)

demo: kernels
	$(PY) -m sweeps.demo

# trains a byte Llama into the cache (load it by its path); the shipped default needs no training
pretrain: setup
	$(PY) -m experiments.pretrain

# before the one GPU device call: corpus streams + git SHA under .device/, travel-size check
device-prep: setup
	$(PY) -m experiments.shipping.device_prep $(if $(PRETRAIN),--pretrain)

bench: bench-circuits bench-head bench-loss bench-decode

bench-circuits: setup
	$(PY) bench/bench_circuits.py --out bench/results/circuits_cpu.json

bench-head: setup
	$(PY) bench/bench_head.py --out bench/results/head_cpu.json

bench-loss: setup
	$(PY) bench/bench_loss_memory.py --out bench/results/loss_memory_cpu.json

bench-decode: setup
	$(PY) bench/bench_decode.py --out bench/results/decode_cpu.json

LINT_DIRS := mtpc tracking experiments sweeps analysis tests bench

# ruff's rules and its formatter (ruff format is the layout of every file; `ruff format $(LINT_DIRS)` applies it)
lint: setup
	$(VENV)/bin/ruff check $(LINT_DIRS)
	$(VENV)/bin/ruff format --check $(LINT_DIRS)
