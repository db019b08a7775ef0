"""Requests that end on a stop string end in the engine, so the finish check holds them too.

vLLM finds stop strings in the front end (its output processor detokenizes each step's tokens),
after the step's output left the engine, and then aborts the request in the engine: the finish
check (connector/finish.py), which holds a final output until the pages its request read are
verified, never saw such a request end. The scheduler side runs the same check where the tokens
are made: for each request with stop strings it keeps vLLM's own incremental detokenizer (the
class the front end uses, built from the same request with the model's tokenizer), fed each
step's new tokens as vLLM appends them (a wrapper on the scheduler instance, there only while
such requests run: patches.check_stop_strings). When it finds a stop string, vLLM's scheduler ends the
request in that step as it ends one at its length (``FINISHED_LENGTH_CAPPED``): the final output
keeps every token's text, the front end's detokenizer finds the same stop string in the same
tokens and reports ``finish_reason="stop"`` with the string as ``stop_reason``, trimmed as
before, and the finish check holds the output one step like an EOS end.

The same code on the same tokens gives the same answer, so the step is the one the front end
would have found. Where the engine cannot load the tokenizer (``skip_tokenizer_init``, the front
end then finds no stop string either) nothing changes.
"""

from __future__ import annotations

from typing import Any

from vllm_kvguard.logs import GuardLog


class StopStrings:
    """Per request with stop strings: vLLM's incremental detokenizer, fed as tokens come."""

    def __init__(self, model_config: Any, log: GuardLog, tokenizer: Any = None) -> None:
        """``tokenizer``: the model's, where the caller has it (else loaded at the first request
        with stop strings, from ``model_config`` as vLLM's front end loads it)."""
        self._model_config = model_config
        self._log = log
        self._tokenizer: Any = tokenizer
        self._unavailable = False
        self._detokenizers: dict[str, Any] = {}
        # Requests with stop strings scheduled and not finished: while there is one, vLLM's
        # scheduler calls the check (patches.check_stop_strings); without, nothing per request.
        self._live: set[str] = set()

    def __len__(self) -> int:
        return len(self._detokenizers)

    @property
    def watching(self) -> bool:
        return bool(self._live)

    def watch(self, request: Any) -> None:
        """A request scheduled from the waiting queue (new or resumed)."""
        params = request.sampling_params
        if params is not None and params.stop and params.detokenize:
            self._live.add(request.request_id)

    def ends(self, request: Any, new_token_ids: list[int]) -> bool:
        """Whether ``new_token_ids`` (just appended to ``request``'s output) complete one of
        its stop strings, as vLLM's front end will find."""
        params = request.sampling_params
        if params is None or not params.stop or not params.detokenize:
            return False
        detokenizer = self._detokenizers.get(request.request_id)
        if detokenizer is None:
            tokenizer = self._load_tokenizer()
            if tokenizer is None:
                return False
            from vllm.v1.engine.detokenizer import IncrementalDetokenizer

            detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
            self._detokenizers[request.request_id] = detokenizer
            earlier = list(request.output_token_ids)[: -len(new_token_ids)]
            if earlier and detokenizer.update(earlier, False) is not None:
                return True
        return detokenizer.update(list(new_token_ids), False) is not None

    def forget(self, req_id: str) -> None:
        self._live.discard(req_id)
        self._detokenizers.pop(req_id, None)

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is not None or self._unavailable:
            return self._tokenizer
        if getattr(self._model_config, "skip_tokenizer_init", False):
            self._unavailable = True  # the front end has none either: no stop strings are found
            return None
        try:
            from vllm.tokenizers.registry import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(self._model_config)
        except Exception as exc:
            self._unavailable = True
            self._log.line(
                "kvguard_stop_strings_unchecked",
                level="warning",
                reason=(
                    f"the engine could not load the model's tokenizer ({type(exc).__name__}: {exc}); "
                    "requests that end on a stop string leave without the finish check"
                ),
            )
        return self._tokenizer
