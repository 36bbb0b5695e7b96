"""`hwkv bench pd`: prefill/decode disaggregation against one colocated engine, same workload.

Colocated: one ``hwkv serve``. Disaggregated: a producer and a consumer ``hwkv serve`` with the
p2p connector (``--mode pull|push``, ``--layerwise``) behind ``hwkv proxy``. ``--prefill-devices`` and
``--decode-devices`` place them (device indices; several for tensor parallelism, with
``--prefill-args "--tensor-parallel-size 2"``): each server sees every device, its own listed first
(``CUDA_VISIBLE_DEVICES`` reordered), so CUDA IPC can map the other's memory; the colocated engine
runs on the prefill devices. The p2p handshake picks the transport (``--protocol``, default the
backend's order: ``cuda_ipc`` device-direct first, tcp through pinned host buffers as the fallback);
the result says which one moved the bytes. Sharing one GPU, give each server a ``--memory-fraction``
/ ``--num-kv-blocks`` through ``--server-args``.
The workload mixes long prompts (``--input-len`` ± ``--range-ratio``) with ``--output-len``
outputs, streamed, at each ``--request-rate`` (as :mod:`hwkv.bench.serve`). Reported per setup:
TTFT / ITL / TPOT / E2E and throughput; for disaggregation also the KV moved and its rate (bytes
over the seconds the blocking transfers took, from the connectors' counters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir
from hwkv.bench import serve as sb
from hwkv.bench.common import stop_process, wait_http


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model dir or shape (llama-1b, qwen-0.5b)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--server-args", default="", help="`hwkv serve` flags of every engine (e.g. '--memory-fraction "
                                                     "0.4' so two fit on one GPU)")
    p.add_argument("--prefill-args", default="", help="extra `hwkv serve` flags of the producer only")
    p.add_argument("--decode-args", default="", help="extra `hwkv serve` flags of the consumer only")
    p.add_argument("--prefill-devices", default=None, help="device indices of the producer (and the colocated "
                   "engine), e.g. '0' or '0,1'; default: as the environment gives")
    p.add_argument("--decode-devices", default=None, help="device indices of the consumer, e.g. '1'")
    p.add_argument("--protocol", default="auto", help="p2p protocol(s) both servers offer: auto (the backend's "
                   "order), or e.g. 'cuda_ipc', 'tcp', 'cuda_ipc,tcp'")
    p.add_argument("--baseline-protocol", default=None, help="also measure a second producer/consumer pair that "
                   "offers only this protocol (e.g. 'tcp': the staged baseline of a device-direct run), same "
                   "placement and workload")
    p.add_argument("--mode", default="pull", choices=["pull", "push"])
    p.add_argument("--layerwise", action="store_true", help="push mode, consumer first, per-layer writes")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--check-tokens", type=int, default=0, help="greedy tokens of --check-prompts prompts, from "
                   "each setup, compared (and with --reference hf scored by float32 HF logits under the conformance "
                   "margin rule); 0 skips the check")
    p.add_argument("--check-prompts", type=int, default=4)
    p.add_argument("--reference", choices=["hf", "none"], default="none")
    p.add_argument("--skip-colocated", action="store_true", help="measure the disaggregated setup only")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VISIBLE = "CUDA_VISIBLE_DEVICES"


def _visible(devices: str | None) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` that puts ``devices`` first and keeps every other device visible (CUDA
    IPC maps another process's memory only on a device this process sees)."""
    if not devices:
        return None
    import torch

    want = [d.strip() for d in devices.split(",") if d.strip()]
    listed = os.environ.get(VISIBLE)
    every = [d.strip() for d in listed.split(",")] if listed else [str(i) for i in range(torch.cuda.device_count())]
    bad = [d for d in want if d not in every]
    if bad:
        raise ValueError(f"devices {','.join(bad)} are not among the visible ones ({','.join(every) or 'none'})")
    return ",".join(want + [d for d in every if d not in want])


def _server(model: str, args: argparse.Namespace, extra: list[str], devices: str | None = None) -> Any:
    ns = argparse.Namespace(backend=args.backend, api_key=None, startup_timeout=args.startup_timeout,
                            server_args=args.server_args + " " + shlex.join(extra))
    visible = _visible(devices)
    # its own environment (not os.environ edited): the producer and the consumer start in parallel threads
    return sb._Server(model, ns, env=None if visible is None else {**os.environ, VISIBLE: visible})


def _servers(model: str, args: argparse.Namespace, specs: list[tuple[list[str], str | None]]) -> list[Any]:
    """Start several servers at once (an 8B engine takes ~40 s to come up; the producer and the consumer
    need not wait for each other). All of them or none: a failed start stops the others."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futs = [pool.submit(_server, model, args, extra, devices) for extra, devices in specs]
        done, errors = [], []
        for f in futs:
            try:
                done.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below after the others are stopped
                errors.append(e)
    if errors:
        for s in done:
            s.stop()
        raise errors[0]
    return done


class _Proxy:
    def __init__(self, prefill: str, decode: str, extra: list[str]):

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hwkv", "proxy", "--prefill", prefill, "--decode", decode,
               "--port", str(self.port), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd)
        if not wait_http(self.proc, self.url + "/v1/models", 60, poll_s=0.2):
            self.stop()
            raise RuntimeError("`hwkv proxy` did not start")

    def stop(self) -> None:
        stop_process(self.proc)


def _counters(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        m = re.match(r"hwkv_connector_(\w+)_total\{.*\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def _transfer_errors(server: Any) -> dict[str, int]:
    """The p2p connector's warnings in a server's log (why a transfer failed), counted by message with
    request ids and addresses masked."""
    out: dict[str, int] = {}
    for line in Path(server.log.name).read_text(errors="replace").splitlines():
        if "p2p:" in line:
            msg = re.sub(r"(req|cmpl|chatcmpl)-[\w-]+|\d+\.\d+\.\d+\.\d+:\d+|\b\d+\b", "*",
                         line.split("p2p:", 1)[1].strip())
            out[msg[:300]] = out.get(msg[:300], 0) + 1
    return out


def _measure(url: str, info: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)  # the same prompts for every setup
    out = []
    for i, rate in enumerate(sb._rates(args.request_rate)):
        work = sb._workload(args.num_prompts + args.warmup, args, info["vocab_size"], rng)
        r = asyncio.run(sb._run_rate(url, info["model"], rate, work[:args.warmup], work[args.warmup:], args, {},
                                     args.seed + i))
        # the whole row as it ends (a run cut short by its time limit keeps what it measured in the log)
        print(f"rate {rate}: {r['completed']} done, {r['failed']} failed, TTFT p50/p99 {r['ttft']['p50_ms']:.1f}/"
              f"{r['ttft']['p99_ms']:.1f} ms, ITL p50/p99 {r['itl']['p50_ms']:.2f}/{r['itl']['p99_ms']:.2f} ms, "
              f"{r['output_throughput']:.1f} out tok/s", file=sys.stderr, flush=True)
        out.append(r)
    return out


def _check_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed + 1000)
    return [p for p, _ in sb._workload(args.check_prompts, args, vocab, rng)]


def _tokens(url: str, info: dict[str, Any], args: argparse.Namespace) -> list[list[int]]:
    """Greedy token ids of the check prompts, one request at a time (the setups' outputs compared)."""
    import httpx

    out = []
    for prompt in _check_prompts(args, info["vocab_size"]):
        body = {"model": info["model"], "prompt": prompt, "max_tokens": args.check_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        out.append(list(r.json()["choices"][0]["token_ids"]))
    return out


def _token_check(model: str, args: argparse.Namespace, vocab: int, runs: dict[str, list[list[int]]]) -> dict:
    """Each setup's tokens against the first's; with --reference hf every token scored by float32 HF
    logits on its own prefix under the conformance margin rule (:func:`hwkv.bench.tp.margin_check`)."""
    names = list(runs)
    doc: dict[str, Any] = {"tokens": runs, "agreement": {
        n: {"identical_sequences": sum(x == y for x, y in zip(runs[names[0]], runs[n])), "of": len(runs[n]),
            "first_divergence": [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
                                 for x, y in zip(runs[names[0]], runs[n])]} for n in names[1:]}}
    if args.reference == "hf":
        from hwkv.bench.tp import margin_check

        prompts = _check_prompts(args, vocab)
        scored = margin_check(Path(model), prompts, [{"tp": n, "tokens": t} for n, t in runs.items()])
        doc["margin_rule"] = {k.removeprefix("tp"): v for k, v in scored.items()}
    return doc


def _pair(args: argparse.Namespace, protocol: str) -> tuple[list[tuple[list[str], str | None]], list[str], str]:
    """A producer/consumer pair offering ``protocol``: the two servers' specs, the proxy's flags, the mode."""
    cfg = {"mode": args.mode, "transfer_timeout_s": args.transfer_timeout, "hold_timeout_s": 300.0,
           "protocol": protocol}
    pcfg, proxy_args = dict(cfg, role="producer"), []
    if args.layerwise:
        port = _free_port()
        pcfg.update(mode="push", layerwise=True, side_channel_port=port)
        cfg["mode"] = "push"
        proxy_args = ["--layerwise", "--prefill-side-channel", f"127.0.0.1:{port}"]
    specs = [(["--kv-connector", "p2p", "--kv-connector-config", json.dumps(pcfg), *shlex.split(args.prefill_args)],
              args.prefill_devices),
             (["--kv-connector", "p2p", "--kv-connector-config", json.dumps(dict(cfg, role="consumer")),
               *shlex.split(args.decode_args)], args.decode_devices)]
    return specs, proxy_args, cfg["mode"]


def _disaggregated(p: Any, d: Any, proxy_args: list[str], mode: str, args: argparse.Namespace
                   ) -> tuple[dict[str, Any], list[dict[str, Any]], dict]:
    """Measure one started producer/consumer pair behind a proxy: its rows and the KV it moved."""
    import httpx

    px = _Proxy(p.url, d.url, proxy_args)
    try:
        info = httpx.get(d.url + "/server_info", timeout=30).json()
        info["producer"] = httpx.get(p.url + "/server_info", timeout=30).json()
        # one request first, outside the counters: the pair's first load opens the peer's IPC handles
        # (one per KV tensor), which later loads do not pay
        prompt = [random.Random(args.seed + 7).randrange(info["vocab_size"]) for _ in range(args.input_len)]
        httpx.post(px.url + "/v1/completions", json={"model": info["model"], "prompt": prompt, "max_tokens": 2,
                                                     "ignore_eos": True}, timeout=300).raise_for_status()
        before = {"producer": _counters(p.url), "consumer": _counters(d.url)}
        results = _measure(px.url, info, args)
        after = {"producer": _counters(p.url), "consumer": _counters(d.url)}
        errors = {side: _transfer_errors(s) for side, s in (("producer", p), ("consumer", d))}
        if args.check_tokens:  # after the counters: the workload's KV figures stay its own
            info["tokens"] = _tokens(px.url, info, args)
    finally:
        px.stop()
    delta = {side: {k: after[side].get(k, 0.0) - before[side].get(k, 0.0) for k in after[side]} for side in after}
    mover = "consumer" if mode == "pull" else "producer"
    nbytes = delta[mover]["loaded_bytes" if mover == "consumer" else "stored_bytes"]
    secs = delta[mover].get("transfer_s", 0.0)
    via = {k.removeprefix("bytes_via_"): v for k, v in delta["consumer"].items() if k.startswith("bytes_via_") and v}
    copy_s = delta[mover].get("copy_s")  # pull: the read calls alone, without the segment plan
    transfer = {"bytes": nbytes, "seconds": secs, "GBps": nbytes / secs / 1e9 if secs > 0 else None,
                "copy_seconds": copy_s, "copy_GBps": nbytes / copy_s / 1e9 if copy_s else None,
                "bytes_by_protocol": via,
                "transfers": delta["consumer"].get("transfers", 0.0),
                "failed_transfers": delta["consumer"].get("failed_transfers", 0.0), "counters": delta,
                "errors": errors,
                "note": "seconds: blocking transfer calls of the side that moves the KV (layerwise writes overlap "
                        "the forward and are not timed)"}
    print(f"moved {nbytes / 1e6:.1f} MB in {transfer['transfers']:.0f} loads "
          f"({transfer['failed_transfers']:.0f} failed) over {via or 'nothing'}: {secs:.3f} s of transfers, "
          f"{copy_s or 0.0:.3f} s of copies", file=sys.stderr, flush=True)  # as it ends (kept if cut short)
    return info, results, transfer


def run(args: argparse.Namespace) -> int:
    import signal

    import httpx

    # a time limit's SIGTERM unwinds through the finally blocks: no server is left holding a GPU
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    try:
        sb._rates(args.request_rate)
    except ValueError as e:
        print(f"hwkv bench pd: error: {e}", file=sys.stderr)
        return 2
    model = sb._model_dir(args)
    colocated, tokens, baseline, producer = None, {}, None, None
    specs, proxy_args, mode = _pair(args, args.protocol)
    pairs = [(specs, proxy_args, mode)]
    if args.baseline_protocol:
        pairs.append(_pair(args, args.baseline_protocol))
    if not args.skip_colocated:
        specs = [(shlex.split(args.prefill_args), args.prefill_devices)]
    else:
        specs = []
    # every server starts at once (an 8B engine takes ~40 s); they are measured one setup at a time
    started = _servers(model, args, specs + [s for pair in pairs for s in pair[0]])
    servers = started[len(specs):]  # the pairs' servers, in order
    try:
        if not args.skip_colocated:
            s = started[0]
            info = httpx.get(s.url + "/server_info", timeout=30).json()
            colocated = _measure(s.url, info, args)
            if args.check_tokens:
                tokens["colocated"] = _tokens(s.url, info, args)
            s.stop()  # the GPU it shares with the producer is the producer's alone from here
        info, disagg, transfer = _disaggregated(servers[0], servers[1], proxy_args, mode, args)
        producer = info.pop("producer", None)
        if args.check_tokens:
            tokens["disaggregated"] = info.pop("tokens")
        if args.baseline_protocol:
            # written now: a time limit during the baseline keeps the main comparison and its bars
            _save(_result(args, model, mode, info, producer, colocated, disagg, transfer, None, {}, partial=True),
                  args, mode, info, show=True)
            for s in servers[:2]:
                s.stop()
            binfo, bres, btransfer = _disaggregated(servers[2], servers[3], pairs[1][1], pairs[1][2], args)
            if args.check_tokens:
                tokens[f"disaggregated-{args.baseline_protocol}"] = binfo.pop("tokens")
            baseline = {"protocol": args.baseline_protocol, "transport": _transport(btransfer, binfo),
                        "disaggregated": bres, "transfer": btransfer}
    finally:
        for s in started:  # all at once (an 8B server takes seconds to exit; a time limit may end the bench here)
            if s.proc.poll() is None:
                s.proc.terminate()
        for s in reversed(started):
            s.stop()
    res = _result(args, model, mode, info, producer, colocated, disagg, transfer, baseline, tokens)
    _save(res, args, mode, info, show=True)
    ok = all(r["failed"] == 0 for r in disagg + (colocated or []) + (baseline or {}).get("disaggregated", []))
    ok = ok and not transfer["failed_transfers"] and not (baseline or {}).get("transfer", {}).get("failed_transfers")
    ok = ok and all(v["passes"] for v in res.get("token_check", {}).get("margin_rule", {}).values())
    return 0 if ok else 1


def _result(args: argparse.Namespace, model: str, mode: str, info: dict[str, Any], producer: Any,
            colocated: list[dict[str, Any]] | None, disagg: list[dict[str, Any]], transfer: dict[str, Any],
            baseline: dict[str, Any] | None, tokens: dict[str, Any], partial: bool = False) -> dict[str, Any]:
    res = {
        "bench": "pd", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "hwkv bench pd " + shlex.join(sys.argv[3:]), "commit": os.environ.get("HWKV_COMMIT") or sb._commit(),
        "server": info,
        "mode": mode, "layerwise": args.layerwise, "transport": _transport(transfer, info),
        "prefill_devices": args.prefill_devices, "decode_devices": args.decode_devices, "protocol": args.protocol,
        "producer_server": producer,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "range_ratio": args.range_ratio, "colocated": colocated, "disaggregated": disagg, "transfer": transfer,
        "baseline": baseline,
    }
    if partial:
        res["partial"] = "written before the baseline pair ran; the final file replaces it"
    if tokens:
        res["token_check"] = _token_check(model, args, info["vocab_size"], tokens)
    res["bars"] = _bars(colocated, disagg, transfer)
    return res


def _save(res: dict[str, Any], args: argparse.Namespace, mode: str, info: dict[str, Any], show: bool) -> None:
    if show:
        _print(res)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    device = re.sub(r"[^A-Za-z0-9._-]+", "_", str(info.get("device", "unknown"))).strip("_")
    stem = f"pd-{Path(str(info.get('model', 'model'))).name}-{device}-{time.strftime('%Y-%m-%d', time.gmtime())}"
    stem += f"-{mode}{'-layerwise' if args.layerwise else ''}{'-' + args.tag if args.tag else ''}"
    if args.prefill_devices or args.decode_devices:
        stem += f"-gpu{args.prefill_devices or 'x'}to{args.decode_devices or 'x'}".replace(",", "+")
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out_dir / stem}.json", flush=True)


def _bars(colocated: list[dict[str, Any]] | None, disagg: list[dict[str, Any]], transfer: dict[str, Any]
          ) -> dict[str, Any]:
    """The issue's two P/D figures, per rate: the consumer's ITL p99 over the colocated engine's (bar:
    <= 0.5 under mixed load), and the transfer's share of the prefill — the mean blocking time per
    load (after the pair's first load, which attaches the peer's memory) over the colocated TTFT p50
    at the lowest rate (a prefill with the least queueing; bar: <= 0.10). Also the TTFT the
    disaggregated path adds over colocated (proxy, transfer, the consumer's first step, minus the
    queueing it saves)."""
    if not colocated:
        return {}
    per_load = transfer["seconds"] / transfer["transfers"] if transfer.get("transfers") else None
    prefill_ms = min(colocated, key=lambda r: float(r["request_rate"]))["ttft"]["p50_ms"]
    out: dict[str, Any] = {"transfer_ms_per_load": per_load * 1e3 if per_load is not None else None,
                           "prefill_ms": prefill_ms,
                           "transfer_over_prefill": per_load * 1e3 / prefill_ms if per_load and prefill_ms else None,
                           "rates": []}
    for c, d in zip(colocated, disagg):
        out["rates"].append({"request_rate": c["request_rate"],
                             "itl_p99_ratio": d["itl"]["p99_ms"] / c["itl"]["p99_ms"] if c["itl"]["p99_ms"] else None,
                             "ttft_p50_added_ms": d["ttft"]["p50_ms"] - c["ttft"]["p50_ms"]})
    return out


def _transport(transfer: dict[str, Any], info: dict[str, Any]) -> str:
    """Which protocol moved the KV (the consumer's bytes_via_<protocol> counters)."""
    names = {"cuda_ipc": "cuda_ipc (device-direct: CUDA IPC handles, copy engines / SM copies over NVLink)",
             "cma": "cma (same-host cross-memory attach)", "rdma": "Mooncake TransferEngine rdma",
             "tcp": "Mooncake TransferEngine tcp on 127.0.0.1" + (" through pinned host buffers (staging)"
                                                                 if info.get("backend", "cpu") != "cpu" else "")}
    via = transfer.get("bytes_by_protocol") or {}
    if not via:
        return "none (no KV moved)"
    return "; ".join(f"{names.get(p, p)}: {b / 1e6:.1f} MB" for p, b in sorted(via.items(), key=lambda x: -x[1]))


def _print(res: dict[str, Any]) -> None:
    print(f"\n{res['server'].get('model')} on {res['server'].get('device')}; {res['num_prompts']} requests, input "
          f"{res['input_len']}±{res['range_ratio']:.0%}, output {res['output_len']}; p2p {res['mode']}"
          f"{' layerwise' if res['layerwise'] else ''} over {res['transport']}")
    print("setup | rate | done | fail | out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50")
    base = res.get("baseline") or {}
    rows = [("colocated", res["colocated"]), ("disaggregated", res["disaggregated"])]
    rows += [(f"disaggregated ({base['protocol']})", base["disaggregated"])] if base else []
    for name, setup in rows:
        for r in setup or []:
            print(" | ".join([name, str(r["request_rate"]), str(r["completed"]), str(r["failed"]),
                              f"{r['output_throughput']:.1f}", f"{r['ttft']['p50_ms']:.1f}",
                              f"{r['ttft']['p99_ms']:.1f}", f"{r['itl']['p50_ms']:.2f}", f"{r['itl']['p99_ms']:.2f}",
                              f"{r['tpot']['p50_ms']:.2f}"]))
    _print_transfer("KV moved", res["transfer"])
    if base:
        _print_transfer(f"KV moved over {base['protocol']}", base["transfer"])
    b = res.get("bars") or {}
    for r in b.get("rates", []):
        ratio = f"{r['itl_p99_ratio']:.2f}" if r["itl_p99_ratio"] is not None else "n/a"
        print(f"rate {r['request_rate']}: consumer ITL p99 / colocated ITL p99 = {ratio} (bar <= 0.5); "
              f"TTFT p50 {r['ttft_p50_added_ms']:+.1f} ms against colocated")
    if b.get("transfer_over_prefill") is not None:
        print(f"transfer {b['transfer_ms_per_load']:.2f} ms per load = {b['transfer_over_prefill']:.1%} of the prefill "
              f"(colocated TTFT p50 {b['prefill_ms']:.1f} ms at the lowest rate; bar <= 10%)")
    tc = res.get("token_check")
    if tc:
        for n, a in tc["agreement"].items():
            print(f"tokens: {n} vs {next(iter(tc['tokens']))}: {a['identical_sequences']}/{a['of']} identical, "
                  f"first divergence {a['first_divergence']}")
        for n, m in tc.get("margin_rule", {}).items():
            print(f"margin rule (float32 HF): {n}: {'passes' if m['passes'] else 'FAILS'}, worst gap "
                  f"{m['worst_gap']}, violations {m['violations']}")


def _print_transfer(what: str, t: dict[str, Any]) -> None:
    rate = f"{t['GBps']:.2f} GB/s" if t["GBps"] else "n/a"
    per = f", {t['seconds'] / t['transfers'] * 1e3:.2f} ms per load" if t["transfers"] else ""
    print(f"{what}: {t['bytes'] / 1e6:.1f} MB in {t['seconds']:.3f} s of transfers ({rate}{per}); "
          f"{t['transfers']:.0f} loads, {t['failed_transfers']:.0f} failed (latencies in ms)")
    if t.get("copy_seconds"):
        print(f"  of which the copies: {t['copy_seconds']:.3f} s ({t['copy_GBps']:.2f} GB/s)")
    for side, errs in t.get("errors", {}).items():
        for msg, n in errs.items():
            print(f"  {side} x{n}: {msg}")
