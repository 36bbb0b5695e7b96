"""AsyncEngine over an engine-core process: same outputs as the in-process Engine, abort and stop
strings free the core's blocks, bad input is refused before anything is queued, a dead core fails
requests with a clear error."""

import asyncio
import os
import shutil
import signal

import pytest

import hwkv
from hwkv.model.fields import ModelLoadError
from hwkv.serving import AsyncEngine, EngineDeadError

pytestmark = pytest.mark.timeout(120)

KW = dict(backend="cpu", num_kv_blocks=64, max_num_seqs=16, seed=0)
PROMPTS = ["Hello, world! How are you", "The quick brown fox", "Once upon a time", [5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def engine(tiny_model, arun):
    eng = AsyncEngine(tiny_model, **KW)
    arun(eng.start())
    yield eng
    arun(eng.shutdown())
    assert eng.client.proc.poll() is not None  # no process left behind


@pytest.fixture(scope="module")
def local(tiny_model):
    return hwkv.Engine(tiny_model, **KW)


async def final(eng: AsyncEngine, prompt, params, rid=None) -> tuple[hwkv.RequestOutput, list]:
    outs = [o async for o in eng.generate(prompt, params, rid)]
    return outs[-1], outs


async def idle(eng: AsyncEngine) -> dict:
    """The core's stats once it has no request left (a stop-string abort reaches it shortly after)."""
    for _ in range(200):
        st = await eng.stats()
        if st["num_running"] == 0 and st["num_waiting"] == 0:
            return st
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine core still has requests: {st}")


def assert_freed(st: dict) -> None:
    assert st["num_free_blocks"] == st["num_kv_blocks"] and st["kv_usage"] == 0.0, st


def test_matches_engine_greedy(engine, local, arun):
    params = hwkv.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = local.generate(PROMPTS, params, use_tqdm=False)

    async def go():
        return await asyncio.gather(*(final(engine, p, params) for p in PROMPTS))

    got = arun(go())
    for w, (out, stream) in zip(want, got):
        assert out.token_ids == w.token_ids and out.text == w.text and out.finish_reason == "length"
        assert out.prompt_token_ids == w.prompt_token_ids
        lens = [len(o.token_ids) for o in stream]
        assert lens == sorted(lens) and all(o.text.startswith(p.text) for p, o in zip(stream, stream[1:]))
    assert_freed(arun(idle(engine)))


def test_stop_string_ends_request_and_frees_core(engine, local, arun):
    base = hwkv.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = local.generate([PROMPTS[0]], base, use_tqdm=False)[0]
    stop = full.text[6:9]  # a piece of text the request will produce
    params = hwkv.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = local.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    out, stream = arun(final(engine, PROMPTS[0], params))
    assert (out.text, out.finish_reason, out.stop_reason) == (want.text, "stop", stop)
    assert out.token_ids == want.token_ids and len(out.token_ids) < 24
    assert all(stop not in o.text for o in stream)
    assert_freed(arun(idle(engine)))


def test_stop_token_and_logprobs(engine, local, arun):
    params = hwkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    want = local.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    out, _ = arun(final(engine, PROMPTS[1], params))
    assert out.token_ids == want.token_ids and len(out.logprobs) == 8
    assert [sorted(a) for a in out.logprobs] == [sorted(b) for b in want.logprobs]
    stop_id = want.token_ids[3]
    p2 = hwkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id])
    out, _ = arun(final(engine, PROMPTS[1], p2))
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids[-1] == stop_id


def test_leaving_early_aborts_and_frees(engine, arun):
    params = hwkv.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def go():
        before = (await engine.stats())["generation_tokens"]
        seen = []
        async for out in engine.generate(PROMPTS[2], params, "leaver"):
            seen.append(out)
            if len(seen) == 3:
                break  # the iterator is closed: generate's cleanup aborts in the core
        assert not seen[-1].finished
        st = await idle(engine)
        assert st["generation_tokens"] - before < 1000  # stopped early, not run to max_tokens
        return st

    assert_freed(arun(go()))
    assert engine.num_unfinished == 0


def test_abort_by_id(engine, arun):
    params = hwkv.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)

    async def go():
        outs = []
        async for out in engine.generate(PROMPTS[2], params, "victim"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("victim")
        return outs[-1], await idle(engine)

    last, st = arun(go())
    assert last.finished and last.finish_reason == "abort" and len(last.token_ids) < 1000
    assert_freed(st)


@pytest.mark.parametrize("prompt, params, match", [
    ("", None, "prompt must not be empty"),
    ([1, 2, 100000], None, "outside the vocabulary"),
    ("hi", hwkv.SamplingParams(max_tokens=2000), "exceeds max_model_len"),
    ("hi", {"max_tokens": 2}, "must be a SamplingParams"),
    ("a\ud800b", None, "cannot be tokenized"),  # a lone surrogate (valid JSON "\\ud800")
])
def test_bad_input_is_refused_before_queueing(engine, arun, prompt, params, match):
    async def go():
        async for _ in engine.generate(prompt, params):
            pass

    with pytest.raises(ValueError, match=match):
        arun(go())
    assert engine.num_unfinished == 0


@pytest.mark.parametrize("kw, match", [
    (dict(backend="no-such-backend"), "failed to start.*no-such-backend"),
    (dict(backend="cpu", kv_connector="no-such-connector"), "kv_connector 'no-such-connector' is unknown"),
])
def test_start_failure_names_the_reason(tiny_model, arun, kw, match):
    eng = AsyncEngine(tiny_model, num_kv_blocks=16, **kw)
    with pytest.raises(EngineDeadError, match=match):
        arun(eng.start())
    assert eng.client.proc.poll() is not None
    assert not os.path.exists(eng.client._dir) and eng.client.input.closed and eng.client.output.closed


MARKER_CONNECTOR = """
from pathlib import Path
from hwkv.interfaces.connector import NoOpConnector

class Marker(NoOpConnector):
    name = "marker"

    def __init__(self, path: str):
        self.path = path

    def shutdown(self) -> None:
        Path(self.path).write_text("shut down")
"""


def test_core_closes_its_engine_on_shutdown(tiny_model, tmp_path, monkeypatch, arun):
    """The core's Engine.close() runs when the core stops: a connector's threads and sockets (and
    tensor-parallel workers) are released, not left to process exit."""
    (tmp_path / "marker_connector.py").write_text(MARKER_CONNECTOR)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    marker = tmp_path / "closed"
    eng = AsyncEngine(tiny_model, num_kv_blocks=16, backend="cpu", kv_connector="marker_connector:Marker",
                      kv_connector_config={"path": str(marker)})
    arun(eng.start())
    assert not marker.exists()
    arun(eng.shutdown())
    assert eng.client.proc.returncode == 0 and marker.read_text() == "shut down"


def test_unreadable_tokenizer_leaves_no_socket_behind(tiny_model, tmp_path, arun):
    d = tmp_path / "broken-tok"
    shutil.copytree(tiny_model, d)
    (d / "tokenizer.json").write_text("{")
    eng = AsyncEngine(d, num_kv_blocks=16, backend="cpu")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        arun(eng.start())
    assert eng.client.proc is None  # refused before a core was started
    assert not os.path.exists(eng.client._dir) and eng.client.input.closed and eng.client.output.closed


def test_cli_engine_flags_map_to_engine_kwargs():
    import argparse
    import dataclasses

    from hwkv.commands import serve
    from hwkv.engine import EngineArgs

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args(["--model", "m", "--max-num-seqs", "8", "--no-enable-prefix-caching", "--decode-ops",
                         "--kv-connector", "noop", "--kv-connector-config", '{"a": 1}'])
    kw = serve.engine_kwargs(args)
    assert set(kw) == {f.name for f in dataclasses.fields(EngineArgs)} - {"model"}  # every option, nothing else
    assert (kw["max_num_seqs"], kw["enable_prefix_caching"], kw["decode_ops"], kw["async_scheduling"]) == (
        8, False, True, None)
    assert (kw["kv_connector"], kw["kv_connector_config"]) == ("noop", {"a": 1})
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--kv-connector-config", "[1]"])


def test_core_crash_fails_pending_requests(tiny_model, arun):
    params = hwkv.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)

    async def go():
        async with AsyncEngine(tiny_model, **KW) as eng:
            got = []

            async def consume():
                async for out in eng.generate("Hello", params):
                    got.append(out)

            task = asyncio.create_task(consume())
            while not got:
                await asyncio.sleep(0.01)
            os.kill(eng.info.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match=r"exited unexpectedly \(exit code -9\)"):
                await task
            assert not eng.is_running
            with pytest.raises(EngineDeadError):
                async for _ in eng.generate("Hello", params):
                    pass
            with pytest.raises(EngineDeadError):
                await eng.stats()

    arun(go(), timeout=60)


def test_async_scheduling_core_matches_engine(tiny_model, local, arun):
    """The GPU default (outputs one step late in the core) streams the same tokens and frees all."""
    params = hwkv.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    stop_params = hwkv.SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[0, 3, 7, 9, 11])
    want = local.generate(PROMPTS, params, use_tqdm=False) + local.generate(PROMPTS, stop_params, use_tqdm=False)

    async def go():
        async with AsyncEngine(tiny_model, **KW, async_scheduling=True) as eng:
            outs = await asyncio.gather(*(final(eng, p, params) for p in PROMPTS),
                                        *(final(eng, p, stop_params) for p in PROMPTS))
            return outs, await idle(eng)

    got, st = arun(go())
    assert [(o.token_ids, o.finish_reason) for o, _ in got] == [(w.token_ids, w.finish_reason) for w in want]
    assert_freed(st)


def test_core_exits_when_the_front_end_is_killed(tiny_model, tmp_path):
    """SIGKILL of the front end (no shutdown message) must not leave the engine core running."""
    import subprocess
    import sys
    import time

    script = f"""
import asyncio, sys
from hwkv.serving import AsyncEngine
async def main():
    eng = AsyncEngine({str(tiny_model)!r}, backend="cpu", num_kv_blocks=16)
    await eng.start()
    print(eng.info.pid, flush=True)
    await asyncio.sleep(120)
asyncio.run(main())
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(proc.stdout.readline())
        with open(f"/proc/{core_pid}/cmdline") as f:  # the config JSON names the IPC addresses
            addr = next(a for a in f.read().split('"') if a.startswith("ipc://"))
        sock_dir = os.path.dirname(addr.removeprefix("ipc://"))
        assert os.path.isdir(sock_dir)
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{core_pid}/stat") as f:  # reparented: a zombie until init reaps it
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(core_pid, signal.SIGKILL)
        raise AssertionError("engine core outlived its killed front end")
    assert not os.path.exists(sock_dir)  # the orphaned core removed the sockets' directory


def test_priority_needs_a_priority_core(engine):
    with pytest.raises(ValueError, match="needs the engine's scheduling_policy 'priority'"):
        engine.generate("hi", None, priority=1)
    with pytest.raises(ValueError, match="priority must be an int"):
        engine.generate("hi", None, priority="high")


def test_core_fails_live_requests_after_repeated_step_failures(tiny_model, monkeypatch, capsys):
    """In-process EngineCore: a step that keeps raising ends every live request with "error" and
    the reason (blocks freed); a step that raises fewer times in a row is retried; the front end
    turns the error into a finished output carrying it."""
    from hwkv.serving import core as core_mod
    from hwkv.serving import messages as m

    cfg = m.CoreConfig(model=str(tiny_model), engine_kwargs=dict(KW), input_addr="", output_addr="", parent_pid=0)
    core = core_mod.EngineCore(cfg)
    params = hwkv.SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for rid in ("a", "b"):
        core.handle(m.AddRequest(rid, [5, 6, 7, 8], params), [], [])
    assert [o.new_token_ids != [] for o in core.step()] == [True, True]
    real = core.engine.step

    def broken():
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.engine, "step", broken)
    assert core.step() == [] and core.step() == []  # retried: the engine rolled the steps back
    outs = core.step()
    assert {(o.request_id, o.finish_reason) for o in outs} == {("a", "error"), ("b", "error")}
    assert all("failed 3 steps in a row: RuntimeError: device lost" in o.error for o in outs)
    assert "device lost" in capsys.readouterr().err
    monkeypatch.setattr(core.engine, "step", real)
    while core.engine.has_unfinished():
        assert core.step() == []  # the aborts' own outputs are not sent again
    st = core.stats()
    assert st["num_free_blocks"] == st["num_kv_blocks"] and core.num_sent == {}

    eng = AsyncEngine(tiny_model)  # the front end's side, without a core
    try:
        eng.info = core.ready()
        req = eng._make([5, 6, 7, 8], params, "r")
        eng._reqs["r#0"] = req
        assert eng._apply(outs[0], "r#0") is False
        out = eng._output(req)
        assert out.finished and out.finish_reason == "error" and "device lost" in out.error
    finally:
        asyncio.run(eng.client.close())


def test_multiprocess_engine_has_the_engine_api(tiny_model, local):
    import time

    from hwkv.serving import MultiprocessEngine

    params = hwkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = local.generate(PROMPTS, params, use_tqdm=False)
    with MultiprocessEngine(tiny_model, **KW) as eng:
        assert [(o.text, o.token_ids) for o in eng.generate(PROMPTS, params)] == [(w.text, w.token_ids) for w in want]
        with pytest.raises(ValueError, match="prompt must not be empty"):
            eng.generate(["ok", ""], params)
        eng.add_request("a", PROMPTS[0], params)
        eng.add_request("b", PROMPTS[1], hwkv.SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            eng.add_request("a", PROMPTS[0], params)
        final = {}
        while eng.has_unfinished():
            for out in eng.step(timeout=30):
                if out.request_id == "a" and out.finished:
                    eng.abort("b")
                if out.finished:
                    final[out.request_id] = out
        assert final["a"].token_ids == want[0].token_ids and final["b"].finish_reason == "abort"
        for _ in range(200):  # the abort reaches the core right after "b"'s final output
            if (st := eng.stats())["num_running"] == 0:
                break
            time.sleep(0.02)
        assert_freed(st)
        proc = eng.engine.client.proc
    assert proc.poll() is not None and not eng._thread.is_alive()


def test_sigterm_while_unwinding_does_not_cut_the_clean_up(monkeypatch):
    """The parent-death SIGTERM races the loop's own orphan check: once unwinding, it only marks."""
    from hwkv.serving import core as core_mod

    monkeypatch.setattr(core_mod, "_terminated", False)
    monkeypatch.setattr(core_mod, "_unwinding", False)
    with pytest.raises(SystemExit):  # mid-loop: unwind now
        core_mod._on_sigterm()
    assert core_mod._terminated
    monkeypatch.setattr(core_mod, "_terminated", False)
    core_mod._begin_unwinding()
    core_mod._on_sigterm()  # already unwinding: no second SystemExit into the finally blocks
    assert core_mod._terminated  # ... but the socket directory is still removed (see run's finally)
