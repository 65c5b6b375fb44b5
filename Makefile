# The README's two commands: `make train` and `make test`. Both install first (idempotent).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# The dev/CI environment pins torch (a CPU wheel); the package itself declares a range.
TORCH_PIN ?= torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: install train test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	@touch $(STAMP)

train: install
	OMP_NUM_THREADS=1 $(BIN)/shardwise train

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

bench: install
	OMP_NUM_THREADS=1 $(BIN)/shardwise bench

clean:
	rm -rf $(VENV) runs .pytest_cache
