# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv when missing and install everything first.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned, so that pip never swaps in a multi-GB CUDA build on a CPU
# machine. Override on GPU machines, e.g. `make TORCH=torch==2.14.1 test`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(TORCH))))
PYTEST_ARGS ?=
# Nothing here may reach a model hub; a hub id fails at once instead of retrying.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1

.PHONY: install demo test test-fast lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q "$(TORCH)"
	echo "$(TORCH)" > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/rlcli run -r recipes/quickstart.yaml
	$(BIN)/rlcli runs plot quickstart --out runs/quickstart/curves.png

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-fast: install
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python bench/rollout.py

clean:
	rm -rf $(VENV) build src/*.egg-info
