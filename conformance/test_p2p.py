"""Prefill/decode disaggregation on the backend: two engines in one process, the ``p2p`` connector
moving the prompt's KV with the backend's first declared transfer protocol (tcp from device memory
goes through the connector's pinned host staging). The decode engine's greedy tokens agree with
the reference, in pull and push mode, and every external token came over the transfer.
"""

from __future__ import annotations

import pytest

from conformance.report import not_supported
from conformance.test_engine import setup, tiny  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.capability("engine"), pytest.mark.timeout_s(600)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_p2p_decode_continues_remote_prefill(engine_backend, backend, check, setup, mode):  # noqa: F811
    from hwkv import Engine, SamplingParams

    caps = backend.capabilities
    if not caps.transfer_protocols:
        not_supported([f"no transfer protocol: {caps.transfer_reason}"])
    bs = setup.block_size
    prompts = setup.prompts([5, bs + 1, 3 * bs + 7], seed=11)
    kw = dict(backend=engine_backend, dtype=setup.dtype, seed=0, num_kv_blocks=16, max_model_len=8 * bs,
              max_num_seqs=4, kv_connector="p2p")
    p = Engine(setup.path, **kw, kv_connector_config={"role": "producer", "mode": mode, "transfer_timeout_s": 30.0})
    d = Engine(setup.path, **kw, kv_connector_config={"role": "consumer", "mode": mode, "transfer_timeout_s": 30.0})
    try:
        got = []
        for prompt in prompts:
            pre = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                 kv_transfer_params={"do_remote_decode": True})
            params = p.generate([prompt], pre, use_tqdm=False)[0].kv_transfer_params
            assert params and params["do_remote_prefill"], f"the producer returned no kv_transfer_params: {params}"
            dec = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, kv_transfer_params=params)
            got.append(list(d.generate([prompt], dec, use_tqdm=False)[0].token_ids))
        st = d.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["failed_transfers"] == 0, st
        assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts), st
        setup.agree(check, got, prompts, 6, f"p2p {mode} ({st.get('role')}) decode after remote prefill vs reference")
    finally:
        p.close()
        d.close()
