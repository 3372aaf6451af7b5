# Set-up and everyday targets. Every target installs what it needs into .venv by itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned torch is installed first, so no other requirement can pull a second build.
TORCH_REQUIREMENT ?= torch==2.13.0
# Where that torch comes from; empty: pip's configured index (on this machine, the CPU build on
# disk). The Dockerfile sets the PyTorch CPU or CUDA 12 index.
TORCH_INDEX_URL ?=
# cpu or gpu: the pyproject extra of that name, i.e. which FAISS build (faiss-cpu, faiss-gpu-cu12).
VARIANT ?= cpu

.PHONY: deps install serve test lint redis bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch-installed: | $(BIN)/python
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) \
		"$(TORCH_REQUIREMENT)"
	touch $@

# The service's requirements (pyproject.toml's dependencies, the service extra and the VARIANT
# extra) without rewa itself: the Dockerfile installs them in a layer of their own, before it copies the sources, so
# that editing the sources does not reinstall torch.
$(VENV)/.deps-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/python -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
		extras = project['optional-dependencies']; \
		print('\n'.join(project['dependencies'] + extras['service'] + extras['$(VARIANT)']))" \
		> $(VENV)/requirements.txt
	$(BIN)/pip install --quiet -r $(VENV)/requirements.txt
	touch $@

$(VENV)/.serve-installed: pyproject.toml $(VENV)/.deps-installed
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/pip install --quiet -e ".[$(VARIANT),dev,bench]"
	touch $@

# What the service needs, nothing more: the Dockerfile runs exactly these two.
deps: $(VENV)/.deps-installed

install: $(VENV)/.serve-installed

# The service on port 8000 with the embedded store (settings: REWA_* variables, see README).
serve: $(VENV)/.serve-installed
	$(BIN)/rewa serve

# A real Redis server at 127.0.0.1:6379 for the tests (started, or installed, if missing).
redis:
	sh deploy/ensure-redis.sh

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Test files run on TEST_WORKERS processes (pytest-xdist), a file's tests all on one process, so
# a module's servers and fixtures are started once. OpenMP's idle threads sleep instead of
# spinning (unless the environment sets OMP_WAIT_POLICY): otherwise two processes' threads spin
# against each other on two cores (docs/benchmark-notes.md, "The test suite on two workers").
TEST_WORKERS ?= 2

test: export OMP_WAIT_POLICY ?= PASSIVE
test: lint redis
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

# Every benchmark (gpu.py only where CUDA is available), then docs/benchmarks.md from the results.
bench: $(VENV)/.dev-installed
	for script in benchmarks/[a-z]*.py; do \
		case $$script in benchmarks/data.py|benchmarks/measure.py|benchmarks/report.py) continue;; \
		benchmarks/gpu.py) $(BIN)/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
			|| continue;; esac; \
		$(BIN)/python $$script || exit 1; \
	done
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
