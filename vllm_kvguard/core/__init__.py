"""The guard's pure core: no vLLM, no torch (stdlib and numpy only), unit-tested in milliseconds.

:mod:`.ledger` (block states, per-step plan, lifecycle audit), :mod:`.scrub` (idle pages
to verify), :mod:`.policy` (mode x finding -> action), :mod:`.faults` (fire-drill fault
specs), :mod:`.events` (what the guard reports), :mod:`.counters` (metric deltas).
The layer contracts in pyproject.toml keep it that way.
"""
