"""p2p protocol choice: each engine offers its backend's protocols (the CPU backend: ``cma``, the
same-host direct path standing in for ``cuda_ipc``, then ``tcp``); the handshake takes the first of
the consumer's that the producer offers and that works between them (same host, a probe of the
peer's memory), logs why it skipped the others, and refuses (recompute) when none works."""

from __future__ import annotations

import pytest

from hwkv.interfaces.transfer import TransferError
from hwkv.testing.mooncake import skip_unless_mooncake

from .conftest import engine
from .test_p2p_engine import assert_clean, cfg, decode, prefill, prompts

skip_unless_mooncake(allow_module_level=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    e = engine(model_dir, num_kv_blocks=16)
    return [o.token_ids for o in e.generate(prompts()[3:5], __import__("hwkv").SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)]


def _pair(model_dir, mode, producer=None, consumer=None):
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", mode,
                                                                                         **(producer or {})))
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("consumer", mode,
                                                                                        **(consumer or {})))
    return p, d


def _run(p, d, reference):
    got = [decode(d, q, prefill(p, q)) for q in prompts()[3:5]]
    assert got == reference
    assert_clean(p, d)
    return d.stats()["kv_connector"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_auto_picks_the_direct_protocol_first(model_dir, reference, mode, caplog):
    p, d = _pair(model_dir, mode)
    try:
        assert p.stats()["kv_connector"]["protocols"] == ["cma", "tcp"]
        with caplog.at_level("INFO"):
            st = _run(p, d, reference)
        assert st["bytes_via_cma"] == st["loaded_bytes"] > 0 and "bytes_via_tcp" not in st
        assert "using cma" in caplog.text
    finally:
        p.close()
        d.close()


def test_a_consumer_offering_tcp_only_gets_tcp(model_dir, reference):
    p, d = _pair(model_dir, "pull", consumer={"protocol": "tcp"})
    try:
        st = _run(p, d, reference)
        assert st["bytes_via_tcp"] == st["loaded_bytes"] > 0 and st["load_failures"] == 0
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_failing_probe_falls_back_to_tcp_with_the_reason(model_dir, reference, mode, caplog):
    p, d = _pair(model_dir, mode)
    copier = d if mode == "pull" else p  # the side that copies probes the other's memory

    def refuse(peer):
        raise TransferError("cma: cannot read peer's memory: PermissionError: [Errno 1] Operation not permitted")

    copier.scheduler.connector.worker.transports["cma"][0].probe = refuse
    try:
        with caplog.at_level("WARNING"):
            st = _run(p, d, reference)
        assert st["bytes_via_tcp"] == st["loaded_bytes"] > 0 and st["load_failures"] == 0
        assert "using tcp, not cma: cma probe of engine" in caplog.text and "Operation not permitted" in caplog.text
    finally:
        p.close()
        d.close()


def test_peers_on_different_hosts_do_not_use_the_same_host_path(model_dir, reference, caplog, monkeypatch):
    import hwkv.connectors.p2p.transport as transport

    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", "pull"))
    monkeypatch.setattr(transport, "host_identity", lambda: "another-boot/1")
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("consumer", "pull"))
    try:
        with caplog.at_level("WARNING"):
            st = _run(p, d, reference)
        assert st["bytes_via_tcp"] > 0 and "cma needs both engines on one host" in caplog.text
    finally:
        p.close()
        d.close()


def test_no_working_protocol_refuses_and_recomputes(model_dir, reference, caplog):
    p, d = _pair(model_dir, "pull", producer={"protocol": "cma"}, consumer={"protocol": "cma"})

    def refuse(peer):
        raise TransferError("injected probe failure")

    d.scheduler.connector.worker.transports["cma"][0].probe = refuse
    try:
        with caplog.at_level("WARNING"):
            got = [decode(d, q, prefill(p, q)) for q in prompts()[3:5]]
        assert got == reference
        assert d.stats()["kv_connector"]["load_failures"] == 2
        assert "no protocol works between them (cma: cma probe of engine" in caplog.text
        for e in (p, d):  # the producer's holds are released by the refusing consumer
            assert_clean(e)
    finally:
        p.close()
        d.close()


def test_protocol_lists_are_checked_against_the_backend(model_dir):
    with pytest.raises(ValueError, match="protocol 'rdma' is not offered by the backend"):
        engine(model_dir, kv_connector="p2p", kv_connector_config={"role": "producer", "protocol": "cma,rdma"})
