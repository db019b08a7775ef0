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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_kvguard.connector.metadata import KVGuardMetadata
from vllm_kvguard.core.ledger import BlockLedger
from vllm_kvguard.core.plan import FILLING, SEALED, block_array


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
    def __init__(self, ledger: BlockLedger, rows: bool) -> None:
        self.ledger = ledger
        self.rows = rows
        self.held: dict[str, Held] = {}

    def hold(self, req_id: str, client_index: int, streaming: bool, output_tokens: int, last: int) -> bool:
        """Whether to hold ``req_id``'s final output: the pages of its block table not verified
        in or after step ``last`` (the step that produced its last token)."""
        ledger = self.ledger
        table = ledger.table(req_id)
        table = table[table >= 0].astype(np.int64)
        if not len(table):
            return False
        states = ledger.state[table]
        stale = ledger.verified_step[table] < last
        pages = table[(states == SEALED) & stale]
        filling = table[(states == FILLING) & stale] if self.rows else table[:0]
        if not len(pages) and not len(filling):
            return False
        self.held[req_id] = Held(req_id, client_index, pages, filling, streaming, output_tokens)
        return True

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
