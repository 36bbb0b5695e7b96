"""`hwkv bench host`: the real engine host path over a stub forward, phases adding up to the step."""

from __future__ import annotations

import argparse
import json

from hwkv.bench import host


def test_bench_host_phases_add_up(tmp_path):
    p = argparse.ArgumentParser()
    host.add_arguments(p)
    out = tmp_path / "host.json"
    assert host.run(p.parse_args(["--batches", "2,16", "--steps", "4", "--repeat", "1", "--out", str(out)])) == 0
    res = json.loads(out.read_text())
    for b in ("batch 2", "batch 16"):
        prof = res["profile"][b]
        for phase in ("schedule", "prep_inputs", "graph_copy_replay", "read_tokens", "update", "outputs"):
            assert prof[phase] > 0, (b, phase)
        # up to graph_runner.SAMPLE_MAX_BATCH requests the decode graph takes the greedy argmax itself
        assert (prof.get("sample", 0) > 0) is (b == "batch 16"), (b, prof)
        assert "eager_forward" not in prof  # every timed step is a pure decode: the graph path
        parts = sum(v for k, v in prof.items() if k != "step_wall")
        assert abs(parts - prof["step_wall"]) < 1e-3  # exclusive phases + other = the step


def test_stub_engine_matches_the_stub_rule(tmp_path):
    from hwkv.sampling_params import SamplingParams

    e = host.make_engine(4, 64, True, tmp_path)
    assert e.runner.graphs is not None and e.async_scheduling
    out = e.generate([[5, 9]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    want, t = [], 9
    for _ in range(3):
        t = (7 * t + 1) % host.VOCAB
        want.append(t)
    assert out.token_ids == want and e.runner.num_graph_steps >= 1
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks and not e.runner.reqs
