# The README's commands. `make demo` sets up and runs the fire drill; `make test` runs the tests.
PY := .venv/bin/python

.PHONY: setup demo test unit lint bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvguard drill

test: setup lint
	$(PY) -m pytest -v

unit:
	$(PY) -m pytest -q -m "not engine"

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
