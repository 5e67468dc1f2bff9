# specjax: `make demo` runs the main job, `make test` the tests, `make bench` the benchmarks.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench embedded clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m serve.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) -m bench.run_all

embedded: $(STAMP)
	$(PY) -m train.build_embedded

clean:
	rm -rf demo_output .pytest_cache
