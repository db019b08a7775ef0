from vllm_kvguard.core.shapes import HARDWARE, SOFTWARE, UNKNOWN, Shape, classify, diagnose


def _c(**kw: object) -> Shape:
    facts = {"zeroed": False, "nonfinite": False, "copy_of": None, "stale": False}
    facts |= {"single_word": False, "single_bit": False}
    return classify(**{**facts, **kw})  # type: ignore[arg-type]


def test_whole_page_shapes_come_before_a_located_word() -> None:
    assert _c() == Shape.MULTI_WORD
    assert _c(single_word=True) == Shape.SINGLE_WORD
    assert _c(single_word=True, single_bit=True) == Shape.SINGLE_BIT
    assert _c(zeroed=True, copy_of=3) == Shape.ZEROED
    assert _c(nonfinite=True, single_word=True) == Shape.NONFINITE  # a NaN stored over an element
    assert _c(nonfinite=True, single_word=True, single_bit=True) == Shape.SINGLE_BIT  # a flip into NaN
    assert _c(zeroed=True, single_word=True, single_bit=True) == Shape.ZEROED
    assert _c(copy_of=3, stale=True) == Shape.COPY_OF_BLOCK
    assert _c(stale=True) == Shape.STALE


def test_repeated_single_bit_faults_on_one_device_point_at_its_memory() -> None:
    d = diagnose([("single_bit", 2, "cuda:2")] * 3 + [("single_word", 2, "cuda:2")])
    assert d.verdict == HARDWARE and "rank 2" in d.why
    assert any("nvidia-smi -q -d ECC" in s for s in d.next_steps) and any("dcgmi" in s for s in d.next_steps)


def test_copies_stale_pages_and_spread_point_at_software() -> None:
    d = diagnose([("copy_of_block", 0, "cuda:0"), ("stale", 1, "cuda:1"), ("single_bit", 0, "cuda:0")])
    assert d.verdict == SOFTWARE and d.runbook.endswith("#software-shapes")
    spread = diagnose([("single_bit", 0, "cuda:0"), ("single_bit", 1, "cuda:1")])
    assert spread.verdict == SOFTWARE and "spread over devices" in spread.why


def test_one_fault_or_none_is_not_a_pattern() -> None:
    assert diagnose([]).verdict == UNKNOWN
    assert diagnose([("single_bit", 0, "cuda:0")]).verdict == UNKNOWN
