"""Which loads nobody here can vouch for are audited by recomputation: a pure sampling plan.

A page another KV connector loads whose identity this engine (and the digest folder) never saw
has no digest or sketch to be checked against. An audit reports it unreadable, so vLLM computes it
again, and compares what was loaded with what was computed (their sketches, digest/sketch.py).
Audited: the first :data:`FIRST` such loads after start and after each connector error, then a
share of them (``rate``), counted, not timed (no clock). A load is one request's run of loaded
pages, audited whole (vLLM computes the request again from the first page reported: no token of
it comes from a page nobody checked). Once an audit finds a loaded page that differs from the
recomputation, the connector is distrusted: every such page is refused (reported unreadable,
recomputed, compared) for the rest of the engine's life.
"""

from __future__ import annotations

FIRST = 4


class LoadAudit:
    def __init__(self, rate: float, first: int = FIRST) -> None:
        self.rate = rate
        self.first = first if rate > 0 else 0
        self.owed = self.first
        self._credit = 0.0
        self.distrusted = False

    def choose(self) -> bool:
        """Whether the next unverifiable load is audited."""
        if self.rate <= 0:
            return False
        if self.owed > 0:
            self.owed -= 1
            return True
        self._credit += self.rate
        if self._credit >= 1.0:
            self._credit -= 1.0
            return True
        return False

    def error(self) -> None:
        """A connector error (a load found bad): audit the next loads again."""
        if self.rate > 0:
            self.owed = max(self.owed, self.first)

    def distrust(self) -> bool:
        """An audit found a wrong load: refuse every unverifiable page from now on. Whether
        this is news (to be logged once)."""
        news = not self.distrusted
        self.distrusted = True
        return news
