"""P/D (p2p connector) with a sliding-window model: decode continues from the remote prefill with
the plain engine's tokens, nothing left pinned on either side."""

from __future__ import annotations

import pytest

from hwkv.testing.mooncake import skip_unless_mooncake

from .conftest import engine, greedy
from .test_p2p_engine import assert_round_trip, cfg, prompts

skip_unless_mooncake(allow_module_level=True)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_windowed_model_decode_from_remote_prefill_token_identical(windowed_dir, mode):
    want = [o.token_ids for o in engine(windowed_dir, num_kv_blocks=16).generate(prompts(), greedy(6),
                                                                                    use_tqdm=False)]
    p = engine(windowed_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", mode))
    d = engine(windowed_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("consumer", mode))
    assert_round_trip(p, d, want)
