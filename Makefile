# `make test` and `make demo` each create or reuse .venv and install what they need.
# Override the torch build with e.g. `make test TORCH_SPEC="torch==2.13.0+cu126 --index-url ..."`.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench venv clean gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that nothing below can pull a different (CUDA) build.
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# The suite's worker processes (pytest-xdist): one per core, up to 4; TEST_JOBS=0 runs it
# in this process.
TEST_JOBS ?= auto

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_JOBS) --maxprocesses 4

demo: $(STAMP)
	$(PY) examples/train_gpt.py

bench: $(STAMP)
	$(PY) benchmarks/engine.py --threads 1

# On a bare GPU machine with no package registry: installs ckptwrap from this checkout
# (pip --no-deps --no-build-isolation), runs the CUDA checks and benchmarks and writes
# OUT/gpu-report.md (docs/gpu.md). GPU_PYTHON is the interpreter that has torch; no .venv
# is made. STEPS=a,b runs some steps only; DRY_RUN=1 runs on the CPU at tiny sizes.
GPU_PYTHON ?= python3

gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=DIR [STEPS=a,b] [DRY_RUN=1]"; exit 2; }
	$(GPU_PYTHON) scripts/gpu_check.py --out "$(OUT)" $(if $(STEPS),--steps $(STEPS)) $(if $(DRY_RUN),--dry-run)

clean:
	rm -rf $(VENV) build *.egg-info
