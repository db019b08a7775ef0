"""Starting the real OpenAI API server (`vllm serve`) with the guard on, for the server tests
(the launcher lives in :mod:`vllm_kvguard.tools.server`, shared with the load benchmarks)."""

from __future__ import annotations

from vllm_kvguard.tools.server import Server, free_port, get, serve, wait

__all__ = ["Server", "free_port", "get", "serve", "wait"]
