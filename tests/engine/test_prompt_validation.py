"""Token-id prompt validation (hwkv.engine.prompt): the C-level fast path accepts and rejects exactly
what the per-element checks do, and names the first bad id."""

from __future__ import annotations

import enum

import numpy as np
import pytest

from hwkv.engine.prompt import tokenize_prompt


class Tok(enum.IntEnum):
    A = 7


@pytest.mark.parametrize("ids", [[1, 2, 3], (4, 5), [Tok.A, 3], [0, 99]])
def test_valid_token_ids_come_back_as_a_new_list(ids):
    text, out = tokenize_prompt(ids, None, 100)
    assert text is None and out == list(ids) and type(out) is list and out is not ids


@pytest.mark.parametrize("ids", [[1, True], [1, 2.0], [1, "2"], [np.int64(3)], [[1]]])
def test_non_int_ids_are_refused(ids):
    with pytest.raises(ValueError, match="list of int token ids"):
        tokenize_prompt(ids, None, 100)


@pytest.mark.parametrize(("ids", "bad", "at"),
                         [([1, 100, -1], 100, 1), ([5, -1, 7], -1, 1), ([0] * 5000 + [10**9], 10**9, 5000)])
def test_the_first_out_of_vocabulary_id_is_named(ids, bad, at):
    msg = rf"token id {bad} at index {at} is outside the vocabulary \(allowed: 0\.\.99\)"
    with pytest.raises(ValueError, match=msg):
        tokenize_prompt(ids, None, 100)
