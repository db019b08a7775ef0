"""The shape of a corruption, and what a history of shapes points at.

A failing GPU memory cell and a vLLM scheduler bug both show up as a page that no longer
matches its seal, and they call for opposite responses (drain the node vs. roll back the
release). The shape of the change tells them apart: memory faults flip single bits in
single words, again and again on one device; software bugs write whole pages (a copy of
another block, an old generation of this one, zeros, garbage) and spread over ranks.
Pure: the worker gathers the facts (:func:`classify`), ``kvguard report`` and the drill read
the shapes back from the log (:func:`diagnose`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum


class Shape(StrEnum):
    SINGLE_BIT = "single_bit"  # one bit of one 64-bit word (located by the syndrome)
    SINGLE_WORD = "single_word"  # several bits, all in one 64-bit word
    MULTI_WORD = "multi_word"  # more than one word, none of the whole-page shapes below
    ZEROED = "zeroed"  # the whole page is zero
    NONFINITE = "nonfinite"  # the page now holds NaN/Inf
    COPY_OF_BLOCK = "copy_of_block"  # it equals another sealed page: a misdirected copy
    STALE = "stale"  # it equals this block's previous seal: a write that never landed
    UNFILLED_ROWS = "unfilled_rows"  # rows written before the page was sealed changed (slots named)
    UNDIAGNOSED = "undiagnosed"  # not (yet) looked at: device path, diagnosed a step later


SHAPES = tuple(s.value for s in Shape)
# What each fire-drill fault kind should be diagnosed as (the drill's "diagnosed" column).
EXPECTED = {
    "bitflip": Shape.SINGLE_BIT,
    "overwrite": Shape.COPY_OF_BLOCK,
    "zero": Shape.ZEROED,
    "nan": Shape.NONFINITE,
    "nan@write": Shape.NONFINITE,
    "partial": Shape.UNFILLED_ROWS,
    "lost_write": Shape.STALE,
}


def classify(
    *,
    zeroed: bool,
    nonfinite: bool,
    copy_of: int | None,
    stale: bool,
    single_word: bool,
    single_bit: bool,
) -> Shape:
    """The shape of one bad page from what the worker found. Whole-page shapes first (they name
    a cause), then a single flipped bit (a bit flip that lands in a float's exponent can make it
    Inf/NaN: still a bit flip, the memory's signature), then NaN/Inf (bad values written: a NaN
    stored over one element changes many bits of its word), then the rest."""
    if zeroed:
        return Shape.ZEROED
    if copy_of is not None:
        return Shape.COPY_OF_BLOCK
    if stale:
        return Shape.STALE
    if single_word and single_bit:
        return Shape.SINGLE_BIT
    if nonfinite:
        return Shape.NONFINITE
    if single_word:
        return Shape.SINGLE_WORD
    return Shape.MULTI_WORD


HARDWARE = "memory hardware"
SOFTWARE = "software"
UNKNOWN = "not enough to tell"
_SOFTWARE_SHAPES = {Shape.COPY_OF_BLOCK, Shape.STALE, Shape.ZEROED, Shape.MULTI_WORD, Shape.NONFINITE}
_HARDWARE_SHAPES = {Shape.SINGLE_BIT, Shape.SINGLE_WORD}


@dataclass
class Diagnosis:
    verdict: str
    why: str
    next_steps: list[str] = field(default_factory=list)
    runbook: str = ""


def diagnose(findings: Iterable[tuple[str, int, str]]) -> Diagnosis:
    """What a history of corruptions points at, from ``(shape, rank, device)`` per bad page.

    Repeated single-bit/single-word faults confined to one rank point at that device's
    memory; whole-page shapes (copies, stale pages, zeros, garbage), or faults spread over
    ranks, point at software (vLLM, its KV connectors, the release).
    """
    rows = [(Shape(s), rank, device) for s, rank, device in findings]
    if not rows:
        return Diagnosis(UNKNOWN, "no corrupted pages in the log")
    shapes = Counter(s for s, _, _ in rows)
    places = Counter((rank, device) for s, rank, device in rows if s in _HARDWARE_SHAPES)
    software = sum(n for s, n in shapes.items() if s in _SOFTWARE_SHAPES)
    hardware = sum(places.values())
    ranks = {rank for _, rank, _ in rows}
    if software >= max(1, hardware):
        return Diagnosis(
            SOFTWARE,
            f"{software} of {len(rows)} bad pages changed as whole pages or many words "
            f"({', '.join(f'{s}: {n}' for s, n in shapes.most_common())}) over {len(ranks)} rank(s): "
            "memory faults flip bits, they do not copy pages",
            [
                "compare with the vLLM version, KV connector stack and config of the last rollout; roll back "
                "if it started with it",
                "look for kv_block_lifecycle_violation lines (block handed out twice, stale block tables)",
                "copy_of_block names the source block: a misdirected copy or a block shared by two requests",
            ],
            "docs/runbook.md#software-shapes",
        )
    (rank, device), most = places.most_common(1)[0]
    if hardware >= 2 and most == hardware:
        return Diagnosis(
            HARDWARE,
            f"{hardware} single-word faults, all on rank {rank} (device {device}): the pattern of "
            "failing memory",
            [
                f"check device {device}'s ECC counters (nvidia-smi -q -d ECC) and Xid errors in the "
                "kernel log (dmesg | grep -i xid)",
                "run DCGM diagnostics (dcgmi diag -r 3) and drain the node if they confirm",
            ],
            "docs/runbook.md#single-bit-and-single-word",
        )
    return Diagnosis(
        UNKNOWN if hardware < 2 else SOFTWARE,
        f"{hardware} single-word fault(s) over {len({p for p in places})} device(s): "
        + ("one fault is not a pattern" if hardware < 2 else "spread over devices, unlike failing memory"),
        ["watch for more: repeated single-bit faults on one device point at its memory"],
        "docs/runbook.md#single-bit-and-single-word",
    )
