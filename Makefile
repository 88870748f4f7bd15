# The two commands a user needs: `make run` and `make test`. Everything else is plumbing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.baton-installed
EXTRAS ?= model,serve,bench,cluster,trace,dev

.PHONY: run test setup lint proto-lint typecheck unit bench clean lock

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

# buf (from npm, pinned with its integrity hashes in tools/buf/package-lock.json) checks
# proto/ against buf's STANDARD lint rules (buf.yaml). Install scripts are skipped: the
# platform's binary comes as an optional dependency (@bufbuild/buf-linux-x64, ...), which the
# package's bin/buf finds and runs.
BUF       := tools/buf/node_modules/.bin/buf
BUF_STAMP := tools/buf/node_modules/.baton-installed

$(BUF_STAMP): tools/buf/package.json tools/buf/package-lock.json
	npm ci --prefix tools/buf --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

proto-lint: $(BUF_STAMP)
	$(BUF) lint

# --durations: the slowest tests in every CI log, where the 20-minute bound is kept or lost
test: setup typecheck lint proto-lint
	$(VENV)/bin/pytest -q --durations=20

bench: setup
	$(VENV)/bin/baton bench --offline

# The image's lock files (requirements/README.md): after a pin in pyproject.toml changes.
# TORCH_CPU_INDEX: PyTorch's CPU wheel index, where the CPU lock takes torch's dependencies from.
IMAGE_EXTRAS := --extra model --extra serve --extra cluster --extra trace --extra k8s
LOCK := env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null \
	$(VENV)/bin/pip-compile -q --rebuild --generate-hashes --strip-extras \
	--no-header --no-emit-index-url --no-emit-find-links
lock: setup
	$(PY) -m pip install -q pip-tools==7.7.0
	$(LOCK) --allow-unsafe $(IMAGE_EXTRAS) --extra gpu -o requirements/image-gpu.lock pyproject.toml requirements/image.in
	test -n "$(TORCH_CPU_INDEX)" || { echo "make lock TORCH_CPU_INDEX=<PyTorch's CPU wheel index>" >&2; exit 2; }
	$(LOCK) --extra-index-url "$(TORCH_CPU_INDEX)" --unsafe-package torch $(IMAGE_EXTRAS) \
		-o requirements/image-cpu.lock pyproject.toml requirements/image.in

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache tools/buf/node_modules
