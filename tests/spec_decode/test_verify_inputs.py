"""The verify graphs' padded inputs built straight from the runner's tables
(:func:`hwkv.spec_decode.verify_inputs.verify_batch`, and row by row: ``verify_batch_rows``) equal,
array for array (values, dtypes, shapes), the general route's: ``build_batch`` of the rows' last
token plus drafts, then ``pad_queries``."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hwkv.engine.graph_runner import pad_queries
from hwkv.engine.inputs import build_batch
from hwkv.spec_decode.verify_inputs import verify_batch, verify_batch_rows


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.integers(1, 6), st.sampled_from([1, 4, 16]), st.integers(0, 2**31 - 1))
def test_verify_batch_equals_padded_build_batch(R: int, q: int, bs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    width = 64
    token_ids = rng.integers(0, 1000, (10, width)).astype(np.int32)
    block_table = rng.integers(0, 50, (10, width // bs + 1)).astype(np.int32)
    slots = rng.permutation(10)[:R].astype(np.int64)
    ks = rng.integers(0, q, R).astype(np.int64)  # 0 drafts (an n-gram miss) up to q - 1
    ctx = rng.integers(0, width - q, R).astype(np.int64)
    want = pad_queries(build_batch(token_ids, block_table, slots, ctx, ks + 1, ctx + ks + 1, bs), q, bs)
    for got in (verify_batch(token_ids, block_table, slots, ctx, ks, q, bs),  # numpy grids
                verify_batch_rows(token_ids, block_table, slots.tolist(), ctx.tolist(), ks.tolist(), q, bs)):
        for name in want._fields:
            a, b = getattr(want, name), getattr(got, name)
            if isinstance(a, np.ndarray):
                assert (a.dtype, a.shape) == (b.dtype, b.shape), name
                assert np.array_equal(a, b), name
            else:
                assert a == b, name
