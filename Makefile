# talking-head lab: `make run` (every notebook headless → outputs/), `make test`, `make lab`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned in every install so pip can never swap torch for another build.
TORCH_PINS := "torch==2.11.*" "torchaudio==2.11.0" "torchvision==0.26.*"
STAMP := $(VENV)/.installed

.PHONY: setup run test test-gpu lab clean-outputs

$(STAMP): pyproject.toml jupyter/overrides.json jupyter/jupyter_server_config.json
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]" $(TORCH_PINS)
	$(BIN)/python -m ipykernel install --sys-prefix --name talking-head-lab --display-name "talking-head lab" >/dev/null
	mkdir -p $(VENV)/share/jupyter/lab/settings $(VENV)/etc/jupyter
	cp jupyter/overrides.json $(VENV)/share/jupyter/lab/settings/overrides.json
	cp jupyter/jupyter_server_config.json $(VENV)/etc/jupyter/jupyter_server_config.json
	touch $(STAMP)

setup: $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then $(BIN)/nbdime config-git --enable >/dev/null && echo "nbdime git diff/merge drivers enabled"; fi

run: setup
	$(BIN)/lab reproduce $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu -p no:cacheprovider $(ARGS)

# Serves the repository root (so executed runs under outputs/ open too) and starts in notebooks/.
lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/notebooks
