# Two commands for a fresh machine (see README.md):
#   make demo   - build .venv if needed, then a real 2-rank CPU training run (tiny DeepSeek-V3
#                 architecture through Megatron-Bridge's pretrain, every plugin feature on)
#   make test   - build .venv if needed, then the test suite
# Both build the virtual environment from a Python 3.12 interpreter; a second run with nothing
# changed reuses it (the stamp file records the hash of pyproject.toml, this Makefile and the
# constraints file).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.nemo_lw_fp8-installed
# Transformer Engine's pure-Python package for the CPU MXFP8 emulation, kept off the default
# import path (a bare TE in site-packages makes `import megatron.core` fail without CUDA).
TE_VERSION := 2.20.2
TE_DIR := $(VENV)/te-emulation
# Installed with --no-deps: their declared requirements do not resolve on PyPI (pyproject.toml,
# extra "bridge", lists what they import).
BRIDGE_VERSION := 0.6.2
NEMO_RUN_VERSION := 0.11.1
# The exact versions the suite passed with (docs/install.md): every pip install below takes it as
# `-c`, so a fresh machine gets the tested environment, not whatever the ranges resolve to today;
# `nemo-lw-fp8 doctor` names any drift from it.
CONSTRAINTS := nemo_lw_fp8/tested-constraints.txt
PYPROJECT_HASH := $(shell cat pyproject.toml Makefile $(CONSTRAINTS) | sha256sum | cut -c1-16)

# A Python 3.12 that really runs: $(PYTHON312) if given, else python3.12 on PATH (a pyenv shim
# counts only if it works), else the newest pyenv-installed 3.12.x.
ifeq ($(origin PYTHON312),undefined)
PYTHON312 := $(shell for c in $$(command -v python3.12 2>/dev/null) \
	$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12 2>/dev/null | sort -rV); do \
	"$$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && { echo "$$c"; break; }; \
	done)
endif

.PHONY: env demo test test-all test-mcore-0.19.0 test-next-release gpu-check lint clean-env doctor

env: $(STAMP)

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	@if [ ! -x "$(PY)" ] || ! $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then \
		if [ -z "$(PYTHON312)" ]; then \
			echo "error: no Python 3.12 found (megatron-core 0.19.2 needs it)." >&2; \
			echo "  Install one, e.g. 'pyenv install 3.12' or your OS package python3.12," >&2; \
			echo "  or point to it: make PYTHON312=/path/to/python3.12 $(MAKECMDGOALS)" >&2; \
			exit 1; \
		fi; \
		echo ">> creating $(VENV) from $(PYTHON312)"; \
		rm -rf $(VENV) && "$(PYTHON312)" -m venv $(VENV); \
	fi
	@if [ -f "$(STAMP)" ] && [ "$$(cat $(STAMP))" = "$(PYPROJECT_HASH)" ]; then exit 0; fi; \
	echo ">> installing nemo_lw_fp8 with its test and bridge extras into $(VENV) (first time: ~10 minutes)"; \
	$(PY) -m pip install --quiet --upgrade pip && \
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[test,bridge]' && \
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --no-deps \
		megatron-bridge==$(BRIDGE_VERSION) nemo-run==$(NEMO_RUN_VERSION) && \
	rm -rf $(TE_DIR) && \
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) --no-deps --target $(TE_DIR) \
		transformer-engine==$(TE_VERSION) && \
	echo "$(PYPROJECT_HASH)" > $(STAMP)

demo: env
	$(VENV)/bin/nemo-lw-fp8 demo

# The gate (CI runs it, 90 minutes at most on 2 cores): everything but the tests marked
# `extended` (repeats of a claim the gate checks; docs/testing.md, "Two tiers"), then the
# megatron-core 0.19.0 subset (test-mcore-0.19.0, below). It runs even when the main suite
# failed, and the gate fails if either did. The 40 slowest tests are listed at the end (the
# suite's time budget, docs/testing.md).
test: env
	@NEMO_LW_FP8_REQUIRE_TE=1 $(PY) -m pytest -m "not extended" --durations=40; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; rc=1; fi; \
	$(MAKE) --no-print-directory test-mcore-0.19.0; rc_0190=$$?; \
	rc_next=0; if [ -d "$(NEXT_RELEASE_WHEELS)" ]; then \
		$(MAKE) --no-print-directory test-next-release; rc_next=$$?; fi; \
	if [ $$rc -ne 0 ]; then exit $$rc; fi; \
	if [ $$rc_0190 -ne 0 ]; then exit $$rc_0190; fi; \
	exit $$rc_next

# The gate and the extended tier.
test-all: env
	@NEMO_LW_FP8_REQUIRE_TE=1 $(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# megatron-core 0.19.0, the other release the patches accept (docs/install.md): installed beside
# the tested 0.19.2 in $(MCORE_0190_DIR) (first on PYTHONPATH, so it shadows 0.19.2 for these
# tests only), then a subset that applies and fingerprints every patch and trains through them
# once (the README's megatron-core example); part of `make test`, so kept to about 5 minutes on
# 2 cores (docs/testing.md). Left out: the 0.19.2 suite's longer trainings (the same code paths)
# and test_apply_after_models_exist_says_so (the framework's warning, not version-dependent).
MCORE_0190_DIR := $(VENV)/megatron-core-0.19.0
MCORE_0190_TESTS := tests/patches/test_upstream_fingerprints.py tests/patches/test_patch_framework.py \
	tests/cli/test_readme_example.py
MCORE_0190_SKIP := --deselect tests/patches/test_patch_framework.py::test_apply_after_models_exist_says_so
test-mcore-0.19.0: env
	@[ -d $(MCORE_0190_DIR) ] || $(PY) -m pip install --quiet --no-deps \
		--target $(MCORE_0190_DIR) megatron-core==0.19.0
	@PYTHONPATH=$(CURDIR)/$(MCORE_0190_DIR) NEMO_LW_FP8_REQUIRE_TE=1 \
		$(PY) -m pytest -m "not extended" $(MCORE_0190_SKIP) $(MCORE_0190_TESTS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# The next upstream pair, megatron-core 0.20.0-dev + Megatron-Bridge 0.7.0-dev (docs/install.md,
# "The next release"), not on the package registry yet: $(NEXT_RELEASE_WHEELS) holds their wheels
# and SHA256SUMS. The wheels it lists are checked against it, installed (--no-deps, again whenever
# SHA256SUMS changes) beside the tested stack in $(NEXT_RELEASE_DIR) and put first on PYTHONPATH
# for tests/next_release/ only (a plain pytest run does not collect that folder): the versions
# imported, tiny DeepSeek-V3 (MXFP8) and Qwen3-30B-A3B Hopper (blockwise) through Bridge's
# pretrain with FP8 param gather ON = OFF bitwise, a bitwise resume, controls that diverge;
# 45-70 s on 2 cores. `make test` runs it after the 0.19.0 subset when $(NEXT_RELEASE_WHEELS)
# exists (a clone without the wheels skips it).
NEXT_RELEASE_WHEELS ?= $(CURDIR)/../shared/upstream-next
NEXT_RELEASE_DIR := $(VENV)/upstream-next
test-next-release: env
	@[ -f "$(NEXT_RELEASE_WHEELS)/SHA256SUMS" ] || { \
		echo "error: no $(NEXT_RELEASE_WHEELS)/SHA256SUMS" \
		"(make NEXT_RELEASE_WHEELS=DIR names the wheels' folder)" >&2; exit 1; }
	@cd "$(NEXT_RELEASE_WHEELS)" && sha256sum --check --strict --quiet SHA256SUMS || { \
		echo "error: the wheels in $(NEXT_RELEASE_WHEELS) do not match its SHA256SUMS" >&2; exit 1; }
	@if ! cmp -s "$(NEXT_RELEASE_WHEELS)/SHA256SUMS" "$(NEXT_RELEASE_DIR)/.SHA256SUMS"; then \
		echo ">> installing the wheels of $(NEXT_RELEASE_WHEELS) into $(NEXT_RELEASE_DIR)"; \
		wheels=$$(awk '$$2 ~ /\.whl$$/ {sub(/^\*/, "", $$2); print "$(NEXT_RELEASE_WHEELS)/" $$2}' \
			"$(NEXT_RELEASE_WHEELS)/SHA256SUMS"); \
		[ -n "$$wheels" ] || { echo "error: SHA256SUMS lists no wheel" >&2; exit 1; }; \
		rm -rf $(NEXT_RELEASE_DIR) && \
		$(PY) -m pip install --quiet --no-deps --target $(NEXT_RELEASE_DIR) $$wheels && \
		cp "$(NEXT_RELEASE_WHEELS)/SHA256SUMS" "$(NEXT_RELEASE_DIR)/.SHA256SUMS" || exit 1; \
	fi
	@PYTHONPATH=$(CURDIR)/$(NEXT_RELEASE_DIR) NEMO_LW_FP8_NEXT_RELEASE=1 NEMO_LW_FP8_REQUIRE_TE=1 \
		$(PY) -m pytest -m "not extended" tests/next_release; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; \
	exit $$rc

# For a GPU owner (docs/testing.md, "On a GPU"): every gpu-marked test, then the tiny recipe of
# the machine's generation on 2 GPUs over NCCL, FP8 param gather ON vs OFF bitwise, a resume, a
# step-time and memory table. Runs in the Python that has TE with CUDA (GPU_PYTHON, default
# this checkout's .venv if present); without a GPU it says so in one line and fails.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	@$(GPU_PYTHON) -m tests.gpu_check.check

lint: env
	$(VENV)/bin/ruff check nemo_lw_fp8 tests benchmarks

doctor: env
	$(VENV)/bin/nemo-lw-fp8 doctor

clean-env:
	rm -rf $(VENV)
