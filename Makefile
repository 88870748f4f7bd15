# The two commands a user needs: `make run` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.baton-installed
EXTRAS ?= model,serve,bench,cluster,trace,dev

.PHONY: run test setup lint typecheck unit bench clean

setup: $(STAMP)

# Re-install only when the dependency list changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# Starts baton on its embedded defaults: the built-in baton-tiny model (created on first use),
# OpenAI HTTP on 127.0.0.1:8000 and gRPC on 127.0.0.1:50051; no etcd, no GPU.
run: setup
	$(VENV)/bin/baton up

typecheck: setup
	$(VENV)/bin/mypy

lint: setup
	$(VENV)/bin/ruff check .

test: setup typecheck lint
	$(VENV)/bin/pytest -q

bench: setup
	$(VENV)/bin/baton bench --offline

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
