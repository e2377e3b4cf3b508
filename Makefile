# `make test` and `make demo` each create or reuse .venv and install what they need.
# Override the torch build with e.g. `make test TORCH_SPEC="torch==2.13.0+cu126 --index-url ..."`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that nothing below can pull a different (CUDA) build.
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) examples/train_gpt.py

bench: $(STAMP)
	$(PY) benchmarks/engine.py --threads 1

clean:
	rm -rf $(VENV) build *.egg-info
