# The README's commands. `make demo` sets up and runs the fire drill; `make test` runs the tests.
PY := .venv/bin/python

.PHONY: setup demo test unit lint package bench vllm034 load soak

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/kvguard drill

# The tests in parallel (pytest-xdist): a module per worker at a time, so module fixtures (servers
# among them) start once; the slowest modules first (tests/conftest.py, SLOW_MODULES).
TEST_WORKERS ?= 2

test: setup lint package vllm034
	$(PY) -m pytest -v -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The sdist and wheel as they would be published (isolated build), checked by twine.
package: setup
	rm -rf dist
	$(PY) -m build --outdir dist . > .venv/build.log 2>&1 || (tail -30 .venv/build.log; exit 1)
	.venv/bin/twine check --strict dist/*

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

# Under load, with a real client (docs/reliability.md): guard off vs on, then drill faults at a
# steady rate in quarantine and log mode (~12 min). The soak: 30 minutes of traffic, memory sampled.
load: setup
	$(PY) benchmarks/load.py --workdir .cache/load

soak: setup
	$(PY) benchmarks/soak.py --minutes 30 --faults "bitflip:rate=0.01,seed=1" --plot --workdir .cache/soak
