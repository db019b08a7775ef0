"""The finish check (``sampled`` mode): no request's final output leaves the engine before every
page it read since that page was last verified is verified once more.

``sampled`` verifies the pages running requests read a sweep at a time, so a page that goes bad
is caught within a bound of steps (docs/configuration.md). A request that finishes inside that
window would otherwise leave with text computed from the bad page and no flag. Instead:

1. When vLLM finishes a request (stopped or at its length), the scheduler side looks up the pages
   in its block table that were not verified in the step that produced its last token (its
   unfilled page by its rows). None: it leaves as usual. Else the guard asks vLLM to keep its
   blocks (``request_finished`` returns ``delay_free_blocks``), and its final output is taken out
   of the step's outputs and held.
2. The next step's plan carries those pages, every held request's once (``finish``,
   ``finish_filling``); the workers verify them before that step's forward, with the step's own
   prefix-hit and scrub pages (on the device in the same launch), and report the held requests
   as done (``get_finished``: vLLM frees their blocks).
3. When that step's output is handled, a bad page's finding names the held requests that read
   it (they read it unverified: failed, or flagged with ``VLLM_KVGUARD_SUSPECT=flag``), and each
   held output is put back into the outputs: as it was, flagged (its ``stop_reason``), or
   replaced by the guard's error (its last tokens dropped).

vLLM keeps stepping while a finished request holds blocks (``Scheduler.has_finished_requests``),
so a held output is released in the next step even when nothing else runs. The price: each such
request's final output leaves one engine step later.

A request that ends at its length (``max_tokens``, or the model's length) needs no hold: the step
that produces its last token is known when it is scheduled. Its pages not verified yet in that
step are verified before that step's forward (``finish``, ``finish_filling``, with no release), as
the sweep verifies pages before the attention that reads them; a bad one is found before its last
token is computed, and the request is failed or flagged in that very step. Only requests that
stop on EOS or a stop token id, which no one can foresee, are held.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import FILLING, SEALED, block_array


def _merged(planned: list[int], more: np.ndarray) -> list[int]:
    """``planned`` (sorted block ids) with ``more``, each once, sorted."""
    if not len(more):
        return planned
    return sorted(set(planned).union(more.tolist())) if planned else more.tolist()


@dataclass
class Held:
    """A finished request whose final output waits for the pages it read to be verified."""

    req_id: str
    client_index: int
    pages: np.ndarray  # sealed pages not verified since the step of its last token
    filling: np.ndarray  # its unfilled pages (verified by their rows)
    streaming: bool
    output_tokens: int  # tokens it produced in all
    output: Any = None  # its final EngineCoreOutput, once taken out of the step's outputs
    step: int | None = None  # the step whose workers verify its pages

    def streamed(self) -> int:
        """Tokens the client already has (streaming: every token but the held output's)."""
        if not self.streaming:
            return 0
        held = len(getattr(self.output, "new_token_ids", None) or ())
        return max(0, self.output_tokens - held)


class FinishCheck:
    def __init__(self, ledger: BlockLedger, rows: bool, max_model_len: int = 0, spec_tokens: int = 0) -> None:
        self.ledger = ledger
        self.rows = rows
        self.held: dict[str, Held] = {}
        # Requests that end at a known length: vLLM's Request and the token count it ends at,
        # and (step, id) by the first step each could end in (a heap; entries of requests gone
        # are dropped as they come up). ``spec_tokens``: draft tokens a step may add.
        self.max_model_len = max_model_len
        self.spec_tokens = spec_tokens
        self._ends: dict[str, tuple[Any, int]] = {}
        self._due: list[tuple[int, str]] = []

    def _stale(self, req_ids: list[str], step: int) -> tuple[np.ndarray, np.ndarray]:
        """(sealed pages, unfilled pages) of the block tables of ``req_ids`` not verified in or
        after ``step``: each page once, in block order."""
        ledger = self.ledger
        if len(req_ids) == 1:
            table = ledger.table(req_ids[0])
            table = table[table >= 0].astype(np.int64)
        else:
            # (Sets, not np.unique: docs/design/decisions.md, "The GIL".)
            ids = set(np.concatenate([ledger.table(r) for r in req_ids]).tolist())
            ids.discard(-1)
            table = block_array(sorted(ids))
        if not len(table):
            return table, table
        states = ledger.state[table]
        stale = ledger.verified_step[table] < step
        pages = table[(states == SEALED) & stale]
        filling = table[(states == FILLING) & stale] if self.rows else table[:0]
        return pages, filling

    def hold(self, req_id: str, client_index: int, streaming: bool, output_tokens: int, last: int) -> bool:
        """Whether to hold ``req_id``'s final output: the pages of its block table not verified
        in or after step ``last`` (the step that produced its last token)."""
        self._ends.pop(req_id, None)
        pages, filling = self._stale([req_id], last)
        if not len(pages) and not len(filling):
            return False
        self.held[req_id] = Held(req_id, client_index, pages, filling, streaming, output_tokens)
        return True

    # ------------------------------------------------------------ ending at a known length

    def watch(self, request: Any) -> None:
        """A request scheduled from the waiting queue: note the token count it ends at (its
        prompt and ``max_tokens``, at most the model's length) and the first step it could."""
        max_tokens = getattr(request, "max_tokens", None)
        prompt = getattr(request, "num_prompt_tokens", None)
        if getattr(request, "sampling_params", None) is None or not isinstance(max_tokens, int):
            return  # (a pooling request: no tokens to sample)
        if not isinstance(prompt, int):
            return
        end = prompt + max_tokens
        if self.max_model_len > 0:
            end = min(end, self.max_model_len)
        req_id = request.request_id
        self._ends[req_id] = (request, end)
        # Scheduled in the step being planned (the ledger's next); each step adds at most
        # 1 + spec_tokens tokens, and it samples its first in that step at the earliest.
        left = end - self._known(request)
        heapq.heappush(self._due, (self.ledger.step + self._steps(left), req_id))

    @staticmethod
    def _known(request: Any) -> int:
        """Tokens ``request`` has or has sampled (with async scheduling, the sampled ones whose
        ids have not come back yet are placeholders)."""
        return int(request.num_tokens) + int(getattr(request, "num_output_placeholders", 0) or 0)

    def _steps(self, tokens: int) -> int:
        """The fewest steps that add ``tokens`` tokens (at least 1)."""
        return max(1, -(-tokens // (1 + self.spec_tokens)))

    def forget(self, req_id: str) -> None:
        if self._ends.pop(req_id, None) is not None and len(self._due) > 2 * len(self._ends) + 64:
            self._due = [d for d in self._due if d[1] in self._ends]
            heapq.heapify(self._due)

    def ahead(self, meta: KVGuardMetadata, so: Any, now: float) -> int:
        """Requests this step surely ends at their length (it samples their last token): their
        pages not verified in this step go into its check before the forward (``finish``,
        ``finish_filling``), so that no hold is needed. Returns how many. A step with no such
        request pays one comparison."""
        due, step = self._due, meta.plan.step
        if not due or due[0][0] > step:
            return 0
        ntok = so.num_scheduled_tokens
        spec = so.scheduled_spec_decode_tokens or {}
        ending: list[str] = []
        later: list[tuple[int, str]] = []
        while due and due[0][0] <= step:
            _, req_id = heapq.heappop(due)
            entry = self._ends.get(req_id)
            if entry is None:
                continue  # finished, aborted, or already checked ahead
            request, end = entry
            scheduled = ntok.get(req_id)
            if scheduled is None:
                later.append((step + 1, req_id))
                continue
            # Positions computed once this step is done; it samples if that covers its tokens.
            computed = int(request.num_computed_tokens) + scheduled - len(spec.get(req_id, ()))
            if computed >= int(request.num_tokens) and computed + 1 >= end:
                ending.append(req_id)
                later.append((step + 1, req_id))  # (should it go on after all: checked again)
            else:
                # It samples at most 1 + spec_tokens tokens a step (a prefill chunk or a
                # recompute may compute many more positions, but samples none of them).
                left = end - self._known(request)
                later.append((max(step + 1, step - 1 + self._steps(left)), req_id))
        for item in later:
            heapq.heappush(due, item)
        if not ending:
            return 0
        # Their block tables in one pass (pages they share, a prefix, once).
        pages, filling = self._stale(ending, step)
        if len(pages) or len(filling):
            meta.finish = _merged(meta.finish, pages)
            meta.finish_filling = _merged(meta.finish_filling, filling)
            self.ledger.mark_verified(np.concatenate([pages, filling]), now)
        return len(ending)

    def plan(self, meta: KVGuardMetadata, now: float) -> None:
        """Put the held requests not planned yet into this step: their pages once each (none that
        this step verifies anyway), and their ids, reported done once verified."""
        new = [h for h in self.held.values() if h.step is None]
        if not new:
            return
        if len(new) == 1:
            pages, filling = new[0].pages, new[0].filling
        else:
            # (Sets, not np.unique: docs/design/decisions.md, "The GIL".)
            pages = block_array(sorted(set(np.concatenate([h.pages for h in new]).tolist())))
            filling = block_array(sorted(set(np.concatenate([h.filling for h in new]).tolist())))
        # Pages freed or quarantined since (another finding) are no longer theirs to verify.
        pages = pages[self.ledger.state[pages] == SEALED]
        filling = filling[self.ledger.state[filling] == FILLING]
        if meta.plan.verify or meta.scrub:  # verified this step anyway
            anyway = set(meta.plan.verify) | set(meta.scrub)
            pages = block_array([b for b in pages.tolist() if b not in anyway])
        meta.finish = pages.tolist()
        meta.finish_filling = filling.tolist()
        meta.release = [h.req_id for h in new]
        self.ledger.mark_verified(np.concatenate([pages, filling]), now)
        for h in new:
            h.step = meta.step

    def readers_of(self, block: int) -> list[str]:
        """Held requests whose finish check covers ``block`` (they read it unverified)."""
        return [h.req_id for h in self.held.values() if block in h.pages or block in h.filling]

    def stash(self, outputs: dict[int, Any]) -> None:
        """Take the held requests' final outputs out of a step's outputs."""
        waiting = {h.req_id for h in self.held.values() if h.output is None}
        if not waiting:
            return
        for engine_outputs in outputs.values():
            keep = []
            for out in engine_outputs.outputs:
                if out.request_id in waiting and out.finish_reason is not None:
                    self.held[out.request_id].output = out
                else:
                    keep.append(out)
            if len(keep) != len(engine_outputs.outputs):
                engine_outputs.outputs[:] = keep

    def due(self, step: int) -> list[Held]:
        """The held requests whose pages were verified by ``step`` (its output now handled)."""
        done = [h for h in self.held.values() if h.step is not None and h.step <= step]
        for h in done:
            del self.held[h.req_id]
        return done
