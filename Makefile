# Two commands: `make up` runs the platform locally, `make test` runs the whole suite.
# Both install what they need first (idempotent; a stamp file skips work already done).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml scripts/install.sh | sha1sum | cut -c1-12)

.PHONY: install kernels up down status test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) bash scripts/install.sh
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# the engine's fused CPU kernels: built once per source and machine, a no-op (~2 s) when up to date
kernels: install
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m python_backends.engine.cpu_kernels || \
		echo "fused CPU kernels not built; the engine uses torch ops"

up: kernels
	$(PY) -m fleet.cli up

down:
	@if [ -x $(PY) ]; then $(PY) -m fleet.cli down; fi

status: install
	$(PY) -m fleet.cli status

test: kernels
	$(PY) -m pytest -q -rs --durations=20

bench: install
	$(PY) -m bench.run_all

clean: down
	rm -rf .fleet/run .fleet/logs
