# Two commands for a fresh machine with only Python >= 3.11:
#   make up     start kvswitch on its embedded default
#   make test   run the test suite
#   make lint   ruff and mypy
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvswitch-installed
# The interop tests' independent gRPC client (@grpc/grpc-js), pinned by package-lock.json.
NPM ?= npm
NODE_DIR := tests/interop/node
NODE_STAMP := $(NODE_DIR)/node_modules/.kvswitch-installed

.PHONY: up test lint bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,bench,lint]'
	touch $(STAMP)

# Without node/npm the grpc-js interop tests skip; every other test still runs.
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v node >/dev/null 2>&1 && command -v $(NPM) >/dev/null 2>&1; then \
		$(NPM) ci --prefix $(NODE_DIR) --ignore-scripts --no-audit --no-fund --loglevel=error \
			&& touch $@; \
	else echo "node/npm not found: the @grpc/grpc-js interop tests will be skipped"; fi

install: $(STAMP)

up: $(STAMP)
	$(BIN)/kvswitch up $(ARGS)

bench: $(STAMP)
	$(BIN)/kvswitch bench $(ARGS)

test: $(STAMP) $(NODE_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy kvswitch

clean:
	rm -rf $(VENV) build *.egg-info $(NODE_DIR)/node_modules
