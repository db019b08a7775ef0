"""Python loads this at start-up in every process of a server started with this folder on
``PYTHONPATH`` (``benchmarks/load.py --floor``): with ``KVGUARD_BENCH_FLOOR`` set to ``empty`` or
``facade`` it installs ``profile_hooks``' floor before vLLM builds the engine, so the server runs
the guard's connector with empty hooks, or its facade with idle sides. With
``KVGUARD_BENCH_TIMING`` set (``load.py --timing``) it times vLLM's step calls in every process
(step_timing.py)."""

import os
import sys

_KIND = os.environ.get("KVGUARD_BENCH_FLOOR")
if _KIND:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import profile_hooks

    profile_hooks._install_floor(_KIND)

_TIMING = os.environ.get("KVGUARD_BENCH_TIMING")
if _TIMING:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import step_timing

    step_timing.install(_TIMING)
