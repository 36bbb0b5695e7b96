"""`hwkv bench admission` (both admission settings on one engine) runs end to end on the CPU."""

from __future__ import annotations

import argparse
import json

from hwkv.bench import admission


def test_bench_admission_smoke(tmp_path, capsys):
    p = argparse.ArgumentParser()
    admission.add_arguments(p)
    out = tmp_path / "adm.json"
    args = p.parse_args(["--num-requests", "6", "--min-prompt", "20", "--max-prompt", "40", "--min-output", "2",
                         "--max-output", "6", "--max-num-batched-tokens", "16", "--repeats", "1",
                         "--workdir", str(tmp_path / "models"), "--out", str(out)])
    assert admission.run(args) == 0
    doc = json.loads(out.read_text())
    assert [r["reserve_full_prompt"] for r in doc["runs"]] == [False, True]
    assert all(r["requests"] == 6 and r["preemptions"] >= 0 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
               for r in doc["runs"])
    assert set(doc["summary"]) == {"False", "True"} and "TTFT p99" in capsys.readouterr().out
