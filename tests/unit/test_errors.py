"""The messages a failed or flagged request carries: true for that request, and parseable."""

from __future__ import annotations

from vllm_kvguard.errors import KVCacheCorruptionError


def test_a_reader_verified_first_is_not_told_it_emitted_tokens_from_the_page() -> None:
    text = KVCacheCorruptionError.describe(5, "all", "failed", unverified_steps=0)
    assert "before this request read it" in text and "unverified" not in text and "emitted" not in text
    assert text.endswith(
        "the request was ended so that it does not return text computed from a corrupted page"
    )


def test_a_reader_that_read_the_page_unverified_is_told_for_how_many_steps() -> None:
    text = KVCacheCorruptionError.describe(5, "model.layers.0", "suspect", unverified_steps=3)
    assert "read it unverified for 3 step(s) and emitted tokens computed from it" in text
    assert text.endswith("(suspect)")


def test_messages_parse_back_to_the_block_and_layer() -> None:
    for text in (
        KVCacheCorruptionError.describe(7, "model.layers.1", "failed", 0),
        KVCacheCorruptionError.describe(7, "model.layers.1", "failed", 2),
    ):
        error = KVCacheCorruptionError.parse(text, "req-1")
        assert error is not None and (error.block_id, error.layer, error.request_id) == (
            7,
            "model.layers.1",
            "req-1",
        )
    assert KVCacheCorruptionError.parse("something else") is None
