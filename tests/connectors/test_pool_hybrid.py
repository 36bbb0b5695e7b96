"""The pool connector with a sliding-window model: a second engine loads the first one's prefix
(and recomputes when the pool lost it) and gives the plain engine's tokens, nothing leaked."""

from __future__ import annotations

import pytest

import hwkv
from hwkv import SamplingParams

from .test_pool import BS, PROMPT, _close, _engine, _run, _settle, lost_keys_recompute, store_name  # noqa: F401


@pytest.fixture(scope="module")
def windowed_oracle(windowed_dir):
    e = hwkv.Engine(windowed_dir, num_kv_blocks=64, max_model_len=256, block_size=BS)
    return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids


def test_windowed_model_loads_from_the_pool(windowed_dir, windowed_oracle, store_name):  # noqa: F811
    """One window group (window 16 = one block): a 9-chunk hit loads the last chunk only."""
    from hwkv.connectors.pool.store import embedded_store

    from .test_pool_groups import Recording

    store = Recording(embedded_store(store_name))
    a, b = _engine(windowed_dir, store=store), _engine(windowed_dir, store=store)
    try:
        assert [g.window for g in b.config.kv_groups] == [16]
        assert _run(a, PROMPT) == windowed_oracle
        _settle(a)
        assert _run(b, PROMPT) == windowed_oracle
        assert _settle(b)["external_hit_tokens"] == 9 * BS
        assert len(store.got) == 1 and "@g0-w16@" in store.got[0]  # the window's chunk only
    finally:
        _close(a, b)


def test_windowed_model_lost_keys_recompute(windowed_dir, windowed_oracle, store_name):  # noqa: F811
    lost_keys_recompute(windowed_dir, windowed_oracle, store_name)
