"""Public exception types."""

from __future__ import annotations


class KVGuardConfigError(ValueError):
    """A ``VLLM_KVGUARD_*`` variable has a value the guard does not accept.

    The message names the variable, the value and what is accepted, so that
    start-up stops with one line an operator can act on.
    """

    def __init__(self, variable: str, value: str, accepted: str) -> None:
        self.variable = variable
        self.value = value
        self.accepted = accepted
        super().__init__(f"{variable}={value!r} is not valid: expected {accepted}")


class KVCacheCorruptionError(RuntimeError):
    """A request read a KV-cache page whose contents changed after it was sealed.

    In ``raise`` mode vLLM ends the affected request with ``finish_reason ==
    "error"`` and the guard puts this error's message in the output's
    ``stop_reason``; :func:`vllm_kvguard.raise_for_corruption` turns such an
    output back into this exception.
    """

    PREFIX = "KV-cache corruption"

    def __init__(
        self, block_id: int, layer: str, request_id: str | None = None, message: str | None = None
    ) -> None:
        self.block_id = block_id
        self.layer = layer
        self.request_id = request_id
        super().__init__(message or self.describe(block_id, layer))

    @classmethod
    def describe(cls, block_id: int, layer: str, outcome: str = "failed", unverified_steps: int = 0) -> str:
        """The message a failed (or, ``outcome="suspect"``, flagged) request carries.
        ``unverified_steps``: how many steps *this* request read the page unverified (0: its
        read was verified first, so it emitted nothing computed from the page)."""
        head = f"{cls.PREFIX}: block {block_id} (layer {layer}) failed its checksum"
        if unverified_steps:
            head += (
                f" after this request had read it unverified for {unverified_steps} step(s) and emitted "
                "tokens computed from it"
            )
        else:
            head += " when it was verified, before this request read it"
        return head + cls._ending(outcome, "a corrupted page")

    @classmethod
    def describe_nonfinite(cls, block_id: int, layer: str, outcome: str = "failed") -> str:
        return (
            f"{cls.PREFIX}: block {block_id} (layer {layer}) was written with non-finite "
            "values (NaN/Inf)" + cls._ending(outcome, "them")
        )

    @classmethod
    def describe_violation(cls, block_id: int, what: str, request_id: str, outcome: str = "failed") -> str:
        return (
            f"{cls.PREFIX}: block {block_id} (layer all) lifecycle violation {what} "
            f"(request {request_id}); the scheduler gave this request's KV block to another use"
            + cls._ending(outcome, "a page another request wrote")
        )

    @classmethod
    def describe_identity(cls, block_id: int, position: int, sealed_by: str, outcome: str = "failed") -> str:
        return (
            f"{cls.PREFIX}: block {block_id} (layer all) identity mismatch: this request's prefix-cache "
            f"hit at page {position} was served a page sealed for other inputs (request {sealed_by})"
            + cls._ending(outcome, "another prompt's KV")
        )

    @classmethod
    def describe_write_lost(cls, block_id: int, slots: tuple[int, ...], outcome: str = "failed") -> str:
        return (
            f"{cls.PREFIX}: block {block_id} (layer all) write lost: slots {list(slots)} still hold the "
            "previous owner's KV after this request's forward wrote them"
            + cls._ending(outcome, "another request's KV")
        )

    @staticmethod
    def _ending(outcome: str, source: str) -> str:
        if outcome == "suspect":
            return f"; the request finished, but its text may include tokens computed from {source} (suspect)"
        return f"; the request was ended so that it does not return text computed from {source}"

    @classmethod
    def parse(cls, message: str, request_id: str | None = None) -> KVCacheCorruptionError | None:
        """Rebuild the error from the message :meth:`describe` wrote, or None."""
        if not message.startswith(cls.PREFIX + ": block "):
            return None
        rest = message[len(cls.PREFIX) + len(": block ") :]
        block_text, _, rest = rest.partition(" (layer ")
        layer, _, _ = rest.partition(")")
        if not block_text.isdigit() or not layer:
            return None
        return cls(int(block_text), layer, request_id, message)
