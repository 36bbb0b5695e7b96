"""P/D (the p2p connector) with KV-cache groups on the device: a hybrid model's prompt KV moves from
a prefill engine to a decode engine in one process (one device), over each protocol asked for.

    python -m hwkv_cuda.bench.hybrid_pd --shape gemma3-1b --out pd.json
    python -m hwkv_cuda.bench.hybrid_pd --shape gemma3-tiny --backend cpu --dtype float32 --setups pull:tcp

A random-weight checkpoint of a :mod:`hwkv_cuda.bench.hybrid_parity` shape (saved in bf16) is served by
a plain engine (no connector) and by producer/consumer pairs (``--setups``: ``mode:protocol`` each; the
producer offers every protocol its backend declares, the consumer only the protocol named, ``tcp`` from a
device staging through a host mirror of each group). Every pair runs with KV-cache groups (checked),
prefills each prompt (longer than the window) on the producer and decodes it on the consumer. Recorded
per setup: the groups; the consumer's loaded bytes against what one group of every layer would move
(the window group moves its live window only); greedy tokens against the plain engine's and scored by
HF's float32 forward of the same weights under the conformance margin rule; load failures; every pool
whole at the end on both sides; with ``--fail-part K``, a pull whose K-th part fails (what is kept, what
is hit on re-admission, the tokens).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from hwkv_cuda.bench.hybrid_pair import add_args, device_of, engine, pools_whole, run


def _settle(*engines: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(e.scheduler.connector.has_pending_transfers() or e.has_unfinished() for e in engines):
        if time.monotonic() > deadline:
            raise RuntimeError("p2p transfers never settled")
        for e in engines:
            e.step()


def expected_bytes(e: Any, lens: list[int]) -> tuple[int, int]:
    """(bytes the grouped loads move, bytes one group of every layer would move) for prompts of ``lens``
    (each load is ``[0, len - 1)``)."""
    from hwkv.connectors.p2p.protocol import window_start

    spec, bs = e.kv_cache.spec, e.block_size
    per = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize  # one token of one layer
    grouped = sum(len(g.layers) * (n - 1 - (0 if g.window is None else window_start(n - 1, g.window, bs))) * per
                  for n in lens for g in e.config.kv_groups)
    return grouped, sum((n - 1) * spec.num_layers * per for n in lens)


def run_setup(path: str, setup: str, ps: list[list[int]], plain: list[list[int]], hf: Any, a: argparse.Namespace,
              max_len: int) -> dict[str, Any]:
    from hwkv.sampling_params import SamplingParams
    from hwkv_cuda.bench.hybrid_parity import groups_of, score

    mode, protocol = setup.split(":")
    offer = "auto"  # every protocol the backend declares (cuda: cuda_ipc, then tcp where Mooncake is installed)
    cfg = {"mode": mode, "transfer_timeout_s": 20.0, "part_tokens": a.part_tokens}
    t0 = time.perf_counter()
    p = engine(path, a, max_len, kv_connector="p2p",
                kv_connector_config={**cfg, "role": "producer", "protocol": offer})
    d = engine(path, a, max_len, kv_connector="p2p",
                kv_connector_config={**cfg, "role": "consumer", "protocol": protocol})
    res: dict[str, Any] = {"setup": setup, "engines_start_s": round(time.perf_counter() - t0, 1),
                           "kv_groups": groups_of(d), "producer_offers": offer}
    try:
        assert [g.window for g in d.config.kv_groups] == [g.window for g in p.config.kv_groups]
        assert len(d.config.kv_groups) > 1 or d.config.kv_groups[0].window is not None, "no KV-cache groups"
        toks, t1 = [], time.perf_counter()
        for q in ps:
            pre = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                 kv_transfer_params={"do_remote_decode": True})
            params = p.generate([q], pre, use_tqdm=False)[0].kv_transfer_params
            sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True, kv_transfer_params=params)
            toks.append(list(d.generate([q], sp, use_tqdm=False)[0].token_ids))
        res["serve_s"] = round(time.perf_counter() - t1, 2)
        _settle(p, d)
        st = d.stats()["kv_connector"]
        grouped, one = expected_bytes(d, [len(q) for q in ps])
        res.update({
            "load_failures": st["load_failures"], "external_hit_tokens": st["external_hit_tokens"],
            "loaded_bytes": st["loaded_bytes"], "expected_grouped_bytes": grouped, "one_group_bytes": one,
            "bytes_ratio_one_group_over_grouped": round(one / max(grouped, 1), 2),
            "bytes_via": {k: v for k, v in st.items() if k.startswith("bytes_via_")},
            "identical_to_plain": f"{sum(t == x for t, x in zip(toks, plain))}/{len(ps)}",
            "first_divergence": [next((j for j, (x, y) in enumerate(zip(t, w)) if x != y), None)
                                 for t, w in zip(toks, plain)],
            "margin_rule": score(hf, ps, toks, device_of(a)),
            "pools_whole": pools_whole(p, d),
        })
        res["ok"] = (res["load_failures"] == 0 and res["loaded_bytes"] == grouped and res["pools_whole"]
                     and res["margin_rule"]["passes"] and st["external_hit_tokens"] == sum(len(q) - 1 for q in ps))
        if a.fail_part and mode == "pull":
            lossy = engine(path, a, max_len, kv_connector="p2p",
                           kv_connector_config={**cfg, "role": "consumer", "protocol": protocol})
            try:
                res["failed_part"] = failed_part(p, lossy, ps[0], plain[0], hf, a)
            finally:
                lossy.close()
            res["ok"] = res["ok"] and res["failed_part"]["ok"]
    finally:
        p.close()
        d.close()
    return res


def failed_part(p: Any, d: Any, q: list[int], want: list[int], hf: Any, a: argparse.Namespace) -> dict[str, Any]:
    """``q`` prefilled on ``p`` and pulled by a fresh consumer ``d`` whose ``a.fail_part``-th read fails (a
    pull reads in parts in token order): the parts before it are kept (``load_kept_tokens``), the request
    re-admits on the hit every group serves from them and recomputes the rest; tokens against ``want``."""
    from hwkv.connectors.p2p.protocol import read_pieces
    from hwkv.interfaces.transfer import TransferError
    from hwkv.sampling_params import SamplingParams
    from hwkv_cuda.bench.hybrid_parity import score

    calls = [0]

    def failing(read: Any) -> Any:
        def f(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] == a.fail_part:
                raise TransferError(f"injected: read {a.fail_part} failed")
            return read(*args)
        return f

    for t, _ in d.scheduler.connector.worker.transports.values():
        t.read = failing(t.read)
    pre = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, kv_transfer_params={"do_remote_decode": True})
    params = p.generate([q], pre, use_tqdm=False)[0].kv_transfer_params
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True, kv_transfer_params=params)
    out = d.generate([q], sp, use_tqdm=False)[0]
    _settle(p, d)
    st, toks = d.stats()["kv_connector"], list(out.token_ids)
    parts = read_pieces(0, len(q) - 1, d.block_size, min_tokens=a.part_tokens)
    r = {"fail_part": a.fail_part, "parts": parts, "reads": calls[0], "load_failures": st["load_failures"],
         "load_kept_tokens": st["load_kept_tokens"], "cached_tokens_after_failure": out.metrics.num_cached_tokens,
         "identical_to_plain": toks == want, "margin_rule": score(hf, [q], [toks], device_of(a)),
         "pools_whole": pools_whole(p, d)}
    r["ok"] = (r["load_failures"] == 1 and r["load_kept_tokens"] == parts[a.fail_part - 1][0] and r["pools_whole"]
               and r["margin_rule"]["passes"])
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "/dev/shm/hwkv-hybrid-pd")
    ap.add_argument("--setups", default="pull:cuda_ipc,push:cuda_ipc,pull:tcp")
    ap.add_argument("--fail-part", type=int, default=0,
                    help="pull setups: then a fresh consumer whose read of this part (1..4) fails (0: none)")
    ap.add_argument("--part-tokens", type=int, default=1024, help="p2p part_tokens: the fewest tokens of a part")
    a = ap.parse_args(argv)
    return run(a, "hybrid_pd", "setups", a.setups.split(","), run_setup)


if __name__ == "__main__":
    raise SystemExit(main())
