# Set-up and everyday targets. Every target installs what it needs into .venv by itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned CPU build is installed first, so no other requirement can pull a CUDA build.
TORCH_REQUIREMENT ?= torch==2.13.0

.PHONY: serve test lint redis bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch-installed: | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_REQUIREMENT)"
	touch $@

$(VENV)/.serve-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	touch $@

# The service on port 8000 with the embedded store (settings: REWA_* variables, see README).
serve: $(VENV)/.serve-installed
	$(BIN)/rewa serve

# A real Redis server at 127.0.0.1:6379 for the tests (started, or installed, if missing).
redis:
	sh deploy/ensure-redis.sh

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint redis
	$(BIN)/pytest

bench: $(VENV)/.dev-installed
	for script in benchmarks/[a-z]*.py; do \
		case $$script in benchmarks/data.py|benchmarks/measure.py) continue;; esac; \
		$(BIN)/python $$script || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
