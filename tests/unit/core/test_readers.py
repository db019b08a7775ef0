from vllm_kvguard.core.readers import FinishedReaders


def test_finished_readers_after_the_last_good_step_are_named_once() -> None:
    readers = FinishedReaders(retention_s=60.0)
    readers.record("early", step=4, now=1.0, blocks=[1, 2, 3])
    readers.record("late", step=9, now=2.0, blocks=[2, 7])
    readers.record("other", step=9, now=2.0, blocks=[5])
    # Page 2 last known good at step 6: only the request that ran after it read it unverified.
    assert readers.take_readers_since(2, last_good_step=6) == ["late"]
    assert readers.take_readers_since(2, last_good_step=6) == []  # named once
    assert readers.take_readers_since(2, last_good_step=-1) == ["early"]
    assert len(readers) == 1


def test_history_is_kept_for_the_retention_and_capped() -> None:
    readers = FinishedReaders(retention_s=10.0, max_entries=2)
    readers.record("a", 1, 0.0, [1])
    readers.record("b", 2, 5.0, [1])
    assert not readers.truncated
    readers.record("c", 3, 6.0, [1])  # the cap drops "a" although it is within the retention
    assert readers.truncated and len(readers) == 2
    readers.record("d", 4, 20.0, [1])  # past the retention: "b" and "c" go first
    assert readers.take_readers_since(1, -1) == ["d"]
