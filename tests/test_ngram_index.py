"""drafts.NgramIndex: prompt lookup over the whole context, O(1) per appended token, with the
selection of a brute-force scan (longest suffix first, its most recent earlier occurrence,
one token for a one-token match), however the list was built up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen38_backend import drafts
from qwen38_backend.drafts import NgramIndex


def brute_force(tokens: list[int], k: int, max_n: int) -> tuple[list[int], int]:
    """Scan every earlier start, latest first, for the longest suffix that occurred before."""
    if k <= 0:
        return [], 0
    size = len(tokens)
    for n in range(min(max_n, size - 1), 0, -1):
        suffix = tokens[size - n :]
        for j in range(size - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + (k if n > 1 else 1)], n
    return [], 0


@st.composite
def chunked_streams(draw) -> tuple[list[list[int]], int]:
    """Token chunks over a vocabulary of 1-4 ids (matches and ties everywhere) drawn from the
    whole id range (keys pack ids: their bits must not mix), and a max_n (4: keys too wide for
    int64, every chunk goes token by token). Chunk lengths reach past BULK_TOKENS, so both
    ways of extending run, after each other in any order."""
    vocab = draw(st.lists(st.integers(0, 2**drafts.TOKEN_BITS - 1), min_size=1, max_size=4))
    ids = st.sampled_from(vocab)
    chunk = st.integers(1, 2 * drafts.BULK_TOKENS).flatmap(
        lambda n: st.lists(ids, min_size=n, max_size=n)
    )
    return draw(st.lists(chunk, max_size=6)), draw(st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(chunked_streams(), st.integers(0, 6))
def test_index_equals_brute_force_after_every_step(stream, k):
    chunks, max_n = stream
    index, tokens = NgramIndex(max_n=max_n), []
    assert index.match(k) == ([], 0)
    for chunk in chunks:
        index.extend(chunk)
        tokens += chunk
        assert index.tokens == tokens
        assert index.match(k) == brute_force(tokens, k, max_n)
    # built at once, and one token at a time: the same answers
    assert NgramIndex(tokens, max_n).match(k) == brute_force(tokens, k, max_n)
    one_by_one = NgramIndex(max_n=max_n)
    for i, token in enumerate(tokens):
        one_by_one.append(token)
        assert one_by_one.match(k) == brute_force(tokens[: i + 1], k, max_n)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=80), st.integers(0, 6))
def test_ngram_match_is_the_index_answer(tokens, k):
    assert drafts.ngram_match(tokens, k) == brute_force(tokens, k, drafts.MAX_NGRAM)


@pytest.mark.parametrize("build", ["at_once", "appended"])
def test_a_match_further_back_than_8192_tokens_is_found(build):
    """ "Answer from a given passage": the passage lies 20,000 tokens back, past the 8192-token
    window the lookup used to scan, and its continuation is still proposed."""
    passage = [5, 6, 7, 8, 9, 10, 11]
    filler = list(range(100, 20_100))  # no n-gram of it recurs, none meets the passage's
    tokens = passage + filler + passage[:3]
    if build == "at_once":
        assert drafts.ngram_match(tokens, 4) == ([8, 9, 10, 11], 3)
    else:
        index = NgramIndex(passage + filler)
        for token in passage[:3]:
            index.append(token)
        assert index.match(4) == ([8, 9, 10, 11], 3)


@pytest.mark.parametrize("bad", [-1, 2**drafts.TOKEN_BITS, 1.0])
def test_ids_the_keys_cannot_hold_are_refused_and_change_nothing(bad):
    for chunk in ([bad], [1] * drafts.BULK_TOKENS + [bad]):  # one append, and numpy keys
        index = NgramIndex([1, 2, 1])
        with pytest.raises((ValueError, TypeError)):
            index.extend(chunk)
        assert index.tokens == [1, 2, 1] and index.match(2) == ([2], 1)
    assert NgramIndex(np.array([3, 4, 3])).match(1) == ([4], 1)  # numpy integers are ids
