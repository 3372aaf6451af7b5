# Set-up and everyday targets. Every target installs what it needs into .venv by itself.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The pinned CPU build is installed first, so no other requirement can pull a CUDA build.
TORCH_REQUIREMENT ?= torch==2.13.0

.PHONY: test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch-installed: | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_REQUIREMENT)"
	touch $@

$(VENV)/.dev-installed: pyproject.toml $(VENV)/.torch-installed
	$(BIN)/pip install --quiet -e ".[dev,bench]"
	touch $@

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/pytest

bench: $(VENV)/.dev-installed
	for script in benchmarks/[a-z]*.py; do \
		case $$script in benchmarks/data.py|benchmarks/measure.py) continue;; esac; \
		$(BIN)/python $$script || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
