"""Page fingerprints (digest/identity.py): chained, keyed by every input, computed once."""

from __future__ import annotations

import numpy as np

from vllm_kvguard.digest.identity import Media, PageIdentity, RequestInputs, context_bytes

BS = 4


def fps(inputs: RequestInputs, pages: int) -> list[int]:
    identity = PageIdentity(BS)
    identity.add("r", inputs)
    return identity.fingerprints("r", np.arange(pages)).tolist()


def test_same_inputs_same_fingerprints_and_every_page_known() -> None:
    a = fps(RequestInputs(list(range(12))), 3)
    assert a == fps(RequestInputs(list(range(12))), 3)
    assert all(a) and len(set(a)) == 3


def test_fingerprints_chain_from_the_first_token() -> None:
    a = fps(RequestInputs([1, 2, 3, 4, 5, 6, 7, 8]), 2)
    b = fps(RequestInputs([9, 2, 3, 4, 5, 6, 7, 8]), 2)
    # Page 1 holds the same tokens, computed after a different page 0: not the same KV.
    assert a[0] != b[0] and a[1] != b[1]


def test_every_input_vllm_must_key_pages_by_changes_the_fingerprint() -> None:
    tokens = list(range(8))
    base = fps(RequestInputs(tokens), 2)
    salted = fps(RequestInputs(tokens, context_bytes(salt="tenant-1")), 2)
    lora = fps(RequestInputs(tokens, context_bytes(lora="adapter#1#/p")), 2)
    # An image whose placeholder tokens start in page 1: page 0 is unchanged.
    image = fps(RequestInputs(tokens, media=(Media("img-hash", 5, 2),)), 2)
    other_image = fps(RequestInputs(tokens, media=(Media("img-hash-2", 5, 2),)), 2)
    embeds = fps(RequestInputs(tokens, embeds=lambda s, e: bytes(range(s, e))), 2)
    assert len({base[0], salted[0], lora[0], embeds[0]}) == 4
    assert image[0] == base[0] and image[1] != base[1] and other_image[1] != image[1]


def test_pages_not_yet_written_are_unknown_and_computed_once() -> None:
    tokens = list(range(6))  # one full page, half of the next
    identity = PageIdentity(BS)
    identity.add("r", RequestInputs(tokens))
    first = identity.fingerprints("r", [0, 1])
    assert first[0] != 0 and first[1] == 0
    tokens.extend([6, 7])  # the request's live token list grows
    second = identity.fingerprints("r", [1, 0])
    assert second[1] == first[0] and second[0] != 0
    assert identity.requests["r"].pages[0] == first[0]
    assert identity.fingerprints("unknown", [0]).tolist() == [0]
    identity.drop("r")
    assert identity.requests == {}


def test_one_position_answers_as_the_array_path_does() -> None:
    # A decode step asks for one page at a time (a short path without array work).
    import numpy as np

    from vllm_kvguard.digest.identity import PageIdentity, RequestInputs, context_bytes

    identity = PageIdentity(4)
    identity.add("a", RequestInputs(list(range(30)), context_bytes(), (), None))
    for p in range(9):  # pages 0..6 known, 7 and 8 past the tokens
        assert identity.owner_keys("a", np.array([p]))[0] == identity.owner_keys("a", np.array([p, p]))[0]
        assert identity.fingerprints("a", [p])[0] == identity.fingerprints("a", [p, p])[0]
    assert identity.fingerprints("a", [7])[0] == 0 and identity.owner_keys("a", np.array([7]))[0] != 0
    assert (
        identity.owner_keys("unknown", np.array([0]))[0]
        == 0
        == identity.owner_keys("unknown", np.array([0, 1]))[0]
    )


def test_a_decode_batch_of_pages_answers_as_each_request_would() -> None:
    # fingerprint_each / owner_key_each (one page each of many requests) against the per-request calls.
    import numpy as np

    from vllm_kvguard.digest.identity import PageIdentity, RequestInputs, context_bytes

    identity = PageIdentity(4)
    identity.add("a", RequestInputs(list(range(30)), context_bytes(), (), None))
    identity.add("b", RequestInputs(list(range(5, 20)), context_bytes(salt="s"), (), None))
    names = ["a", "b", "unknown", "a", "b", "a"]
    positions = np.array([0, 2, 1, 6, 4, 8])
    fingerprints = identity.fingerprint_each(names, positions)
    keys = identity.owner_key_each(names, positions)
    for i, (name, p) in enumerate(zip(names, positions.tolist(), strict=True)):
        assert fingerprints[i] == identity.fingerprints(name, [p])[0]
        assert keys[i] == identity.owner_keys(name, np.array([p, p]))[0]
    assert fingerprints.dtype == keys.dtype == np.uint64
    assert fingerprints[2] == keys[2] == 0 and fingerprints[0] != 0 and fingerprints[4] == 0


def test_fingerprints_are_the_documented_chain_whether_computed_at_once_or_page_by_page() -> None:
    """XXH3-64 keyed by the parent (ROOT for page 0) over the page's tokens as int64, 0x1e and
    the context; media placed in a page go after, through the streaming path: the same values
    for a prefix computed in one go (a new request) and a page at a time (a decode)."""
    import xxhash

    from vllm_kvguard.digest.identity import ROOT

    tokens = [7, 1, 9, 4, 100_000, 2, 3, 5, 8, 6, 0, 11]
    context = context_bytes(salt="s")
    parent, want = ROOT, []
    for i in range(3):
        page = np.asarray(tokens[i * BS : (i + 1) * BS], dtype=np.int64).tobytes()
        parent = xxhash.xxh3_64_intdigest(page + b"\x1e" + context, parent) or 1
        want.append(parent)
    assert fps(RequestInputs(tokens, context), 3) == want
    live: list[int] = []
    identity = PageIdentity(BS)
    identity.add("r", RequestInputs(live, context))
    for i in range(3):
        live.extend(tokens[i * BS : (i + 1) * BS])
        assert identity.fingerprints("r", [i]).tolist() == [want[i]]
    media = (Media("img", 5, 2),)
    h = xxhash.xxh3_64(seed=want[0])
    h.update(np.asarray(tokens[BS : 2 * BS], dtype=np.int64).tobytes() + b"\x1e" + context)
    h.update(b"\x1dimg@1+2")
    got = fps(RequestInputs(tokens, context, media=media), 2)
    assert got == [want[0], h.intdigest()]
