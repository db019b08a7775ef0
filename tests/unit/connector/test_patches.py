"""The OpenAI-server error path's lookup (connector/patches.py): which request a server-side id
refers to. The end-to-end behaviour is tested against the real server (test_serve_clients)."""

from __future__ import annotations

import pytest

from vllm_kvguard.connector import patches


@pytest.fixture(autouse=True)
def _empty() -> None:
    patches._ENDED.clear()


def test_completion_prompts_and_chat_sub_requests_are_found_by_the_servers_id() -> None:
    # A completion's prompts are `<id>-0`, `<id>-1`; a chat with several prompts `<id>_0`, ...
    patches._remember("cmpl-abc-1", "cmpl-abc-1-deadbeef", "KV-cache corruption: block 3 (layer x)")
    patches._remember("chatcmpl-q", "chatcmpl-q-0badf00d", "KV-cache corruption: block 4 (layer y)")
    patches._remember("chatcmpl-r_2", "chatcmpl-r_2-12345678", "KV-cache corruption: block 5 (layer z)")
    assert patches.ended_by_guard("cmpl-ab") is None  # a prefix of another id is not a match
    assert patches.ended_by_guard("cmpl-abc") == (
        "cmpl-abc-1-deadbeef",
        "KV-cache corruption: block 3 (layer x)",
    )
    assert patches.ended_by_guard("cmpl-abc") is None  # taken out once found
    assert patches.ended_by_guard("chatcmpl-q")[0] == "chatcmpl-q-0badf00d"  # type: ignore[index]
    assert patches.ended_by_guard("chatcmpl-r")[0] == "chatcmpl-r_2-12345678"  # type: ignore[index]
    assert patches._ENDED == {}


def test_the_table_is_bounded() -> None:
    for i in range(patches._ENDED_MAX + 10):
        patches._remember(f"cmpl-{i}", f"cmpl-{i}-x", "m")
    assert len(patches._ENDED) == patches._ENDED_MAX
    assert patches.ended_by_guard("cmpl-0") is None and patches.ended_by_guard(
        f"cmpl-{patches._ENDED_MAX + 9}"
    )


def test_vllms_kernel_scan_survives_numba_once_guarded() -> None:
    """vLLM 0.32's worker start scans every module for Triton kernels and trips over llvmlite
    (numba's compiler, which the guard's row digests import): the control shows vLLM's own scan
    failing, then the guarded scan passes and leaves llvmlite as it was."""
    import llvmlite.binding.ffi as ffi
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels
    original = getattr(scan, "__wrapped__", scan)
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        original([])
    assert patches.guard_kernel_scan() and patches.guard_kernel_scan()  # once; again a no-op
    dispatcher._rebind_kernels([])
    assert vars(ffi)["lib"] is not None and getattr(dispatcher._rebind_kernels, "_kvguard", False)


def test_the_stop_string_check_is_on_the_instance_only_while_such_requests_run() -> None:
    """check_stop_strings wraps the scheduler's per-request token method on the instance while
    requests with stop strings run, ends a request whose tokens complete one as at its length,
    and takes the wrapper away when none run (steps without pay nothing per request)."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    class Scheduler:
        def _update_request_with_output(
            self, request: object, new: list[int], is_stale: bool = False
        ) -> object:
            return new, False

    asked: list[object] = []
    guard = SimpleNamespace(ends_on_stop_string=lambda request, new: asked.append(request) or new == [7])
    scheduler = Scheduler()
    scheduler.connector = object()  # type: ignore[attr-defined]

    def find(_connector: object) -> object:
        return guard

    patches.check_stop_strings(scheduler, find, False)
    assert patches.STOP_CHECK not in vars(scheduler)
    patches.check_stop_strings(scheduler, find, True)
    assert patches.STOP_CHECK in vars(scheduler)
    plain = SimpleNamespace(sampling_params=SimpleNamespace(stop=None), status=RequestStatus.RUNNING)
    stopping = SimpleNamespace(sampling_params=SimpleNamespace(stop=["w7"]), status=RequestStatus.RUNNING)
    assert scheduler._update_request_with_output(plain, [7], is_stale=False) == ([7], False)
    assert asked == []  # no stop strings: the guard is not asked
    assert scheduler._update_request_with_output(stopping, [5]) == ([5], False)
    assert stopping.status == RequestStatus.RUNNING
    assert scheduler._update_request_with_output(stopping, [7]) == ([7], True)
    assert stopping.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(asked) == 2
    patches.check_stop_strings(scheduler, find, True)  # already there: unchanged
    patches.check_stop_strings(scheduler, find, False)
    assert patches.STOP_CHECK not in vars(scheduler)
    assert scheduler._update_request_with_output(stopping, [7]) == ([7], False)  # the class's own
