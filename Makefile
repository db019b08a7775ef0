# The README's commands. `make demo` sets up and runs the fire drill; `make test` runs the tests.
PY := .venv/bin/python

.PHONY: setup demo test unit lint bench vllm034

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvguard drill

test: setup lint vllm034
	$(PY) -m pytest -v

# vLLM 0.34's Python source for tests/compat (the guard on its scheduler and runner driver).
vllm034: setup
	bash scripts/fetch_vllm034.sh

unit:
	$(PY) -m pytest -q -m "not engine and not compat"

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/lint-imports
