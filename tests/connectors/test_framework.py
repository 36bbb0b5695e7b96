"""The connector framework: registry by name, config checks, stats, layerwise hooks in every
forward path, kv_transfer_params in and out."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import hwkv
from hwkv import plugins
from hwkv.connectors import make_connector
from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

from .conftest import assert_no_leak, engine, greedy, run_one_by_one, workload


def test_builtins_are_registered_through_the_hook():
    names = {spec.name: plugin for spec, plugin in plugins.list_connectors()}
    assert {"noop", "offload"} <= set(names)
    assert make_connector("noop") is None and make_connector(NoOpConnector()) is None  # nothing to call
    conn = make_connector("offload", {"cpu_bytes": 1 << 20, "async_load": True})
    assert type(conn).__name__ == "OffloadConnector" and conn.async_load and conn.scheduler.async_load


def test_listing_the_builtins_imports_no_connector():
    """The registry names factories; a connector's module (and what it needs: zmq, msgspec, Mooncake)
    is imported only when an engine builds it."""
    code = ("import sys; from hwkv import plugins; names = [s.name for s, _ in plugins.list_connectors()]; "
            "print(names, sorted({m.split('.')[2] for m in sys.modules if m.startswith('hwkv.connectors.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "['noop', 'offload', 'p2p', 'pool'] ['base', 'plugin']"  # no offload, pool, p2p


@pytest.mark.parametrize("args, match", [
    (("nope", None), "kv_connector 'nope' is unknown \\(allowed: .*noop.*offload"),
    (("offload", {"cpu_bytes": 1, "bogus": 2}), "unknown config key\\(s\\) bogus \\(allowed: async_load"),
    (("offload", {}), "bad config"),
    (("offload", [1]), "kv_connector_config must be a dict"),
    ((None, {"a": 1}), "kv_connector_config is given but kv_connector is not"),
    ((KVConnectorBase(), {"a": 1}), "applies to a connector given by name"),
    ((42, None), "kv_connector must be a name"),
    (("os:getcwd", None), "is not a hwkv KVConnectorBase subclass"),
    (("no_such_mod_xyz:C", None), "cannot import"),
])
def test_bad_connector_choices_are_refused_naming_what_is_allowed(args, match):
    with pytest.raises(ValueError, match=match):
        make_connector(*args)


def test_third_party_connector_registers_through_a_plugin(tmp_path, monkeypatch, model_dir):
    (tmp_path / "hwkv_tp_conn.py").write_text(textwrap.dedent('''
        from hwkv.interfaces.connector import KVConnectorBase
        from hwkv.plugins import ConnectorSpec, hookimpl

        class Echo(KVConnectorBase):
            name = "echo"

            def __init__(self, tag="t"):
                self.tag = tag

            def request_finished(self, request, block_ids):
                return False, {"tag": self.tag, "got": request.kv_transfer_params}

            def stats(self):
                return {"echoes": 1}

        @hookimpl
        def hwkv_connectors():
            return [ConnectorSpec("echo", "1.0", "hwkv_tp_conn:Echo", "echoes params", {"tag": "str"})]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HWKV_PLUGIN_MODULES", "hwkv_tp_conn")
    plugins.reset()
    try:
        from hwkv import cli

        assert cli.main(["connectors", "--json"]) == 0
        e = engine(model_dir, kv_connector="echo", kv_connector_config={"tag": "x"})
        e.add_request("a", [5, 6, 7], greedy(2), kv_transfer_params={"remote": 1})
        sp = greedy(2)
        sp.kv_transfer_params = {"remote": 2}
        e.add_request("b", [5, 6, 8], sp)
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                assert o.kv_transfer_params is None or o.finished
                outs[o.request_id] = o
        assert outs["a"].kv_transfer_params == {"tag": "x", "got": {"remote": 1}}
        assert outs["b"].kv_transfer_params == {"tag": "x", "got": {"remote": 2}}
        st = e.stats()["kv_connector"]
        assert st["name"] == "echo" and st["echoes"] == 1 and st["external_hit_tokens"] == 0
        assert e.async_scheduling is False and e.runner.connector is not None
    finally:
        monkeypatch.delenv("HWKV_PLUGIN_MODULES")
        plugins.reset()
        sys.modules.pop("hwkv_tp_conn", None)


def test_connectors_command_lists_config(capsys):
    from hwkv import cli

    assert cli.main(["connectors", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert "cpu_bytes" in rows["offload"]["config"] and rows["noop"]["config"] == {}


def test_kv_transfer_params_must_be_a_dict(model_dir):
    e = engine(model_dir)
    with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
        e.add_request("a", [1, 2], greedy(), kv_transfer_params=[1])
    with pytest.raises(ValueError, match="SamplingParams.kv_transfer_params must be a dict or None"):
        hwkv.SamplingParams(kv_transfer_params="x")


class LayerRecorder(KVConnectorBase):
    layerwise = True

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def wait_for_layer_load(self, layer):
        self.calls.append(("wait", layer))

    def save_kv_layer(self, layer, layer_kv, attn_metadata):
        assert layer_kv is not None and attn_metadata is not None
        self.calls.append(("save", layer))


def _per_forward(calls, num_layers):
    one = [(k, i) for i in range(num_layers) for k in ("wait", "save")]
    n = len(one)
    assert len(calls) % n == 0 and all(calls[j:j + n] == one for j in range(0, len(calls), n))
    return len(calls) // n


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "decode-ops"])
def test_layer_hooks_run_in_order_in_every_forward(model_dir, fused):
    from hwkv.model.decode_ops import TorchDecodeOps

    prompts = workload()[:2]
    want = run_one_by_one(engine(model_dir), prompts)
    conn = LayerRecorder()
    e = engine(model_dir, kv_connector=conn)
    if fused:
        e.model.set_decode_ops(TorchDecodeOps())
    assert run_one_by_one(e, prompts) == want
    assert _per_forward(conn.calls, e.model.config.num_layers) == e.stats()["num_steps"]
    assert_no_leak(e)


def test_layer_hooks_and_graphs(model_dir):
    """Capturable hooks are recorded into the graphs (graphs stay on); host-side ones turn graphs off
    but keep async scheduling possible."""
    from hwkv.reference.graphs import GraphCpuBackend

    class Capturable(LayerRecorder):
        capturable_layer_hooks = True

    prompts = workload()[:2]
    want = run_one_by_one(engine(model_dir), prompts)
    conn = Capturable()
    e = engine(model_dir, backend=GraphCpuBackend(), kv_connector=conn, fuse_elementwise=False)
    assert e.runner.graphs is not None and e.async_scheduling
    assert _per_forward(conn.calls, e.model.config.num_layers) > 0  # captured
    assert run_one_by_one(e, prompts) == want and e.runner.num_graph_steps > 0
    conn = LayerRecorder()
    e = engine(model_dir, backend=GraphCpuBackend(), kv_connector=conn, fuse_elementwise=False,
               async_scheduling=True)
    assert e.runner.graphs is None and e.async_scheduling
    assert run_one_by_one(e, prompts) == want
    assert _per_forward(conn.calls, e.model.config.num_layers) == e.stats()["num_steps"]


def test_offload_keeps_graphs_async_scheduling_and_its_results(model_dir):
    """The offload connector acts between forwards only: graphs and async scheduling stay on, and a
    host-tier hit replays into the same tokens through the graph path."""
    from hwkv.reference.graphs import GraphCpuBackend

    want = run_one_by_one(engine(model_dir), workload())
    e = engine(model_dir, backend=GraphCpuBackend(), kv_connector="offload",
               kv_connector_config={"cpu_bytes": 1 << 20}, fuse_elementwise=False)
    assert e.runner.graphs is not None and e.async_scheduling
    assert run_one_by_one(e, workload()) == want
    assert e.runner.num_graph_steps > 0 and e.stats()["kv_connector"]["external_hit_tokens"] == 2 * 4 * 16
    assert_no_leak(e)


@pytest.mark.parametrize("kw", [{}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}],
                         ids=["plain", "spec-decode"])
def test_a_step_failing_before_its_loads_are_issued_leaks_no_pin(model_dir, kw):
    """update_states raising on the step that carries a load: the load was never issued, so the
    next step retires it (pins released) and the request recomputes to the same tokens."""
    cfg = {"cpu_bytes": 1 << 20}
    prompts = workload()
    want = run_one_by_one(engine(model_dir), prompts[:2])
    e = engine(model_dir, kv_connector="offload", kv_connector_config=cfg, **kw)
    run_one_by_one(e, prompts[:2])  # the prefix reaches the host tier, then the filler evicts it
    e.generate([prompts[0]], greedy(), use_tqdm=False)
    orig, failed = e.runner.update_states, []

    def failing(so):
        meta = so.kv_connector_metadata
        if meta is not None and meta.loads and not failed:
            failed.append(so)
            raise RuntimeError("injected update_states failure")
        return orig(so)

    e.runner.update_states = failing
    e.add_request("again", prompts[1], greedy())
    outs = []
    for _ in range(200):
        if not e.has_unfinished():
            break
        try:
            outs += e.step()
        except RuntimeError as ex:
            assert "injected" in str(ex)
    assert failed, "no step carried a load"
    assert [o.token_ids for o in outs if o.finished] == [want[1]]
    assert_no_leak(e)


def test_idle_steps_sleep_only_while_kv_is_in_flight(model_dir, monkeypatch):
    """A step that schedules nothing while a request waits for its KV sleeps (no spinning loop
    holding the GIL from the transfer threads); steps with work, or with nothing at all, never."""
    import time
    from types import SimpleNamespace

    import hwkv.engine.engine as eng

    slept = []
    monkeypatch.setattr(eng, "time", SimpleNamespace(perf_counter=time.perf_counter, sleep=slept.append))
    prompts = workload()
    plain = engine(model_dir)
    run_one_by_one(plain, prompts[:4])
    plain.step()  # nothing at all to do
    assert slept == []
    e = engine(model_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": 1 << 20, "async_load": True})
    run_one_by_one(e, prompts[:3])
    assert slept == []
    conn = e.scheduler.connector
    orig = conn.get_finished
    held = []

    def slow(finished):  # the load's completion is reported only after a few idle steps
        if len(held) < 3:
            held.append(finished)
            return None
        return orig(finished)

    monkeypatch.setattr(conn, "get_finished", slow)
    out = e.generate([prompts[3]], greedy(), use_tqdm=False)[0]
    assert out.token_ids == run_one_by_one(engine(model_dir), prompts[3:4])[0]
    assert e.stats()["kv_connector"]["external_hit_tokens"] > 0
    assert slept and set(slept) == {eng.IDLE_WAIT_S}
    assert_no_leak(e)
