"""The pool connector with KV-cache groups on the device: one engine puts a hybrid model's prompt
chunks into an embedded pool, a second engine (same process, same device) loads them, and a third
loads them while one chunk of the full group is lost (the load fails part-way).

    python -m hwkv_cuda.bench.hybrid_pool --shape gemma3-1b --out pool.json
    python -m hwkv_cuda.bench.hybrid_pool --shape gemma3-tiny --backend cpu --dtype float32 --modes direct

A random-weight checkpoint of a :mod:`hwkv_cuda.bench.hybrid_parity` shape (saved in bf16) is served by
a plain engine (no connector) and, per ``--modes`` entry (``staged``: through host staging, the device
path; ``packed``: one segment per value; ``direct``: the store reads and writes the KV cache itself,
host caches only), by pool engines with KV-cache groups (checked). Recorded per mode: the groups; the
loading engine's loaded bytes against the grouped expectation (the full group's chunks, the window
group's window only) and against what one group of every layer would move; greedy tokens scored by HF's
float32 forward of the same weights under the conformance margin rule, and against the plain engine's;
the lost-chunk run's tokens, load failures and cached tokens (the chunks before the lost one are kept:
with a window group the hit every group serves decides what is reused); every pool whole at the end.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hwkv_cuda.bench.hybrid_pair import add_args, device_of, engine, pools_whole, run


def _settle(e: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while e.scheduler.connector.has_pending_transfers() or e.has_unfinished():
        if time.monotonic() > deadline:
            raise RuntimeError("pool transfers never settled")
        e.step()
        time.sleep(0.002)
    return e.stats()["kv_connector"]


def expected_bytes(e: Any, lens: list[int]) -> tuple[int, int]:
    """(bytes the grouped loads move, bytes one group of every layer would move) for prompts of
    ``lens`` loaded from nothing (whole blocks up to the last prompt token; one-block chunks)."""
    spec, bs = e.kv_cache.spec, e.block_size
    per = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize * bs  # one block of one layer
    grouped = one = 0
    for n in lens:
        last = (n - 1) // bs
        for g in e.config.kv_groups:
            lo = 0 if g.window is None else max(0, last * bs - g.window + 1) // bs
            grouped += len(g.layers) * (last - lo) * per
        one += spec.num_layers * last * per
    return grouped, one


def _lose_one(inner: Any, nth: int) -> Any:
    """The pool's store (a :class:`~hwkv.interfaces.store.Store` over ``inner``), losing the ``nth`` key
    of the full group (``g0-full``) asked once ``armed`` is set: that get fails part-way."""
    from hwkv.interfaces.store import ItemResult, KeyNotFound, Store

    class LoseOne(Store):
        def __init__(self) -> None:
            self.armed, self.asked = False, 0

        def put(self, keys: list[str], buffers: list[Any]) -> list[Any]:
            return inner.put(keys, buffers)

        def exists(self, keys: list[str]) -> list[bool]:
            return inner.exists(keys)

        def remove(self, keys: list[str]) -> list[Any]:
            return inner.remove(keys)

        def register_buffer(self, ptr: int, nbytes: int) -> None:
            inner.register_buffer(ptr, nbytes)

        def close(self) -> None:
            pass

        def get(self, keys: list[str], buffers: list[Any]) -> list[Any]:
            full = [i for i, k in enumerate(keys) if "@g0-full@" in k] if self.armed else []
            drop = full[nth - self.asked] if 0 <= nth - self.asked < len(full) else None
            self.asked += len(full)  # a staged load asks in pieces: count over every call
            if drop is None:
                return inner.get(keys, buffers)
            self.armed = False
            keep = [i for i in range(len(keys)) if i != drop]
            res = iter(inner.get([keys[i] for i in keep], [buffers[i] for i in keep]))
            return [ItemResult(k, 0, KeyNotFound(f"{k!r} lost")) if i == drop else next(res)
                    for i, k in enumerate(keys)]

    return LoseOne()


def run_mode(path: str, mode: str, ps: list[list[int]], plain: list[list[int]], hf: Any, a: argparse.Namespace,
             max_len: int) -> dict[str, Any]:
    from hwkv.connectors.pool.store import drop_embedded, embedded_store
    from hwkv.sampling_params import SamplingParams
    from hwkv_cuda.bench.hybrid_parity import groups_of, score

    name = f"hybrid-pool-{mode}"
    nth = a.lose_nth if a.lose_nth >= 0 else (len(ps[0]) - 1) // a.block_size // 2
    store = _lose_one(embedded_store(name, capacity_bytes=4 << 30), nth)
    cfg: dict[str, Any] = {"store": store}
    if mode == "packed":
        cfg["pack"] = True
    if mode == "direct" and a.backend == "cuda":
        raise ValueError("direct mode needs host KV caches (--backend cpu)")
    sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    t0 = time.perf_counter()
    engines = [engine(path, a, max_len, block_size=a.block_size, kv_connector="pool", kv_connector_config=dict(cfg))
               for _ in range(3)]
    fill, load, lossy = engines
    res: dict[str, Any] = {"mode": mode, "engines_start_s": round(time.perf_counter() - t0, 1),
                           "kv_groups": groups_of(load)}
    try:
        assert len(load.config.kv_groups) > 1, "no KV-cache groups"
        w = load.scheduler.connector.worker.transfer
        res["transfer"] = "direct" if w.direct else ("packed" if w.packed else "staged")
        t1 = time.perf_counter()
        filled = [list(o.token_ids) for o in fill.generate(ps, sp, use_tqdm=False)]
        res["fill_s"] = round(time.perf_counter() - t1, 2)
        sf = _settle(fill)
        t1 = time.perf_counter()
        outs = load.generate(ps, sp, use_tqdm=False)
        res["load_serve_s"] = round(time.perf_counter() - t1, 2)
        toks = [list(o.token_ids) for o in outs]
        st = _settle(load)
        grouped, one = expected_bytes(load, [len(q) for q in ps])
        res.update({
            "stored_bytes": sf["stored_bytes"], "stored_chunks": sf["stored_chunks"],
            "loaded_bytes": st["loaded_bytes"], "expected_grouped_bytes": grouped, "one_group_bytes": one,
            "bytes_ratio_one_group_over_grouped": round(one / max(grouped, 1), 2),
            "external_hit_tokens": st["external_hit_tokens"], "load_failures": st["load_failures"],
            "identical_to_plain": f"{sum(t == x for t, x in zip(toks, plain))}/{len(ps)}",
            "identical_to_filler": f"{sum(t == x for t, x in zip(toks, filled))}/{len(ps)}",
            "margin_rule": score(hf, ps, toks, device_of(a)),
        })
        print(json.dumps({k: res[k] for k in ("mode", "transfer", "loaded_bytes", "expected_grouped_bytes",
                                              "one_group_bytes", "identical_to_plain")}), flush=True)
        store.armed = True  # the third engine: one full-group chunk of the first prompt lost
        lost_out = lossy.generate([ps[0]], sp, use_tqdm=False)[0]
        sl = _settle(lossy)
        lost_toks = list(lost_out.token_ids)
        res["lost_chunk"] = {
            "lost_full_group_chunk": nth, "load_failures": sl["load_failures"],
            "cached_tokens_after_failure": lost_out.metrics.num_cached_tokens,
            "identical_to_plain": lost_toks == plain[0],
            "margin_rule": score(hf, ps[:1], [lost_toks], device_of(a)),
        }
        res["pools_whole"] = pools_whole(*engines)
        res["ok"] = (res["load_failures"] == 0 and res["loaded_bytes"] == grouped and res["pools_whole"]
                     and res["margin_rule"]["passes"] and res["lost_chunk"]["load_failures"] == 1
                     and res["lost_chunk"]["margin_rule"]["passes"])
    finally:
        for e in engines:
            e.close()
            e.scheduler.connector.shutdown()
        drop_embedded(name)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "/dev/shm/hwkv-hybrid-pool")
    ap.add_argument("--modes", default="staged,packed")
    ap.add_argument("--lose-nth", type=int, default=-1,
                    help="the full-group chunk of the first prompt lost in the failure run (-1: the middle one)")
    ap.add_argument("--block-size", type=int, default=16)
    a = ap.parse_args(argv)
    return run(a, "hybrid_pool", "modes", a.modes.split(","), run_mode)


if __name__ == "__main__":
    raise SystemExit(main())
