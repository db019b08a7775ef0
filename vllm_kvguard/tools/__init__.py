"""The ``kvguard`` command and what it runs: fire drill, benchmark, tiny model, workloads.

vLLM is imported only in the engine child processes these tools start
(:mod:`.childrun`), never in the ``kvguard`` process itself.
"""
