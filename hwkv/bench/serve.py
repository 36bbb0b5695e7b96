"""`hwkv bench serve`: online serving benchmark against an OpenAI-compatible server (as `vllm bench serve`).

Requests arrive as a Poisson process at each ``--request-rate`` (``inf``: all at once), optionally
capped by ``--max-concurrency``; prompts are random token ids of ``--input-len`` (± ``--range-ratio``),
each asks for exactly ``--output-len`` tokens (``ignore_eos``), streamed. Per rate it reports request
and token throughput and TTFT / TPOT / ITL / end-to-end latency (mean, p50, p99). TTFT: send → first
streamed token; ITL: between a request's successive chunks (a chunk may carry several tokens when the
server coalesces); TPOT: (e2e − TTFT) / (output tokens − 1).

Against ``--base-url`` it benchmarks a running server; without one it starts ``hwkv serve`` on a free
127.0.0.1 port with ``--model`` (a directory, or a shape of :mod:`hwkv.bench.e2e` written with random
weights) and stops it afterwards. JSON lands in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from hwkv.bench import results_dir

READ_TIMEOUT_S = 600.0  # longest silence between two chunks of one stream


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running server (http://host:port); default: start one")
    p.add_argument("--model", default=None, help="model dir or shape (llama-1b, qwen-0.5b) for the server it starts "
                                                 "(and for the vocabulary of the random prompts)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None, help="for a shape: the weights' dtype (default bfloat16 off the CPU)")
    p.add_argument("--server-args", default="", help="extra `hwkv serve` flags, one string (e.g. '--max-num-seqs 256')")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models", help="where a shape's model is written")
    p.add_argument("--api-key", default=os.environ.get("HWKV_API_KEY"))
    p.add_argument("--vocab-size", type=int, default=None, help="prompt token ids are drawn from [0, this) "
                                                                 "(default: the server's vocabulary)")
    p.add_argument("--request-rate", default="inf", help="comma list of requests/s, 'inf' = all at once")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per rate")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--warmup", type=int, default=2, help="requests sent (and not measured) before each rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--out-dir", default=None,
                   help="where serve-<model>-<device>-<date>.json goes (default: hwkv.bench.results_dir())")
    p.add_argument("--tag", default="", help="appended to the result file name")


def _rates(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        r = float(part)
        if not r > 0:
            raise ValueError(f"--request-rate values must be > 0 or 'inf', got {part!r}")
        out.append(r)
    return out


def _workload(n: int, args: argparse.Namespace, vocab: int, rng: random.Random) -> list[tuple[list[int], int]]:
    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    return [([rng.randrange(vocab) for _ in range(length(args.input_len))], length(args.output_len))
            for _ in range(n)]


async def _one(http: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft, last, itl, ntok, err = None, t0, [], 0, None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    err = data["error"].get("message")
                    break
                now = time.perf_counter()
                if data.get("usage"):
                    ntok = data["usage"]["completion_tokens"]
                choices = data.get("choices") or []
                if choices and choices[0].get("token_ids"):
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except Exception as e:  # a dropped connection counts as a failed request, not a crashed bench
        err = f"{type(e).__name__}: {e}"
    e2e = time.perf_counter() - t0
    if err is not None or ttft is None:
        return {"ok": False, "error": err or "no tokens"}
    return {"ok": True, "ttft": ttft, "itl": itl, "e2e": e2e, "prompt_len": len(prompt), "output_len": ntok}


async def _run_rate(url: str, model: str, rate: float, warm: list[tuple[list[int], int]],
                    work: list[tuple[list[int], int]], args: argparse.Namespace, headers: dict[str, str],
                    seed: int) -> dict[str, Any]:
    import httpx

    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # Bounded waits: a hung server fails its requests instead of hanging the bench (a stream may be
    # silent for long while queued at high rates, hence the generous read bound between chunks).
    timeout = httpx.Timeout(connect=30.0, read=READ_TIMEOUT_S, write=60.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as http:
        for prompt, n in warm:
            await _one(http, url, model, prompt, min(n, 8))

        async def limited(prompt: list[int], n: int) -> dict[str, Any]:
            if sem is None:
                return await _one(http, url, model, prompt, n)
            async with sem:
                return await _one(http, url, model, prompt, n)

        tasks = []
        t0 = time.perf_counter()
        for prompt, n in work:
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return _summary(rate, results, duration, args.max_concurrency)


def _stats(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    a = np.asarray(xs) * 1e3
    return {"mean_ms": float(a.mean()), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}


def _summary(rate: float, results: list[dict[str, Any]], duration: float, conc: int | None) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    out_tok = sum(r["output_len"] for r in ok)
    in_tok = sum(r["prompt_len"] for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_len"] - 1) for r in ok if r["output_len"] > 1]
    return {
        "request_rate": "inf" if rate == float("inf") else rate, "max_concurrency": conc,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tok / duration, "total_token_throughput": (in_tok + out_tok) / duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "ttft": _stats([r["ttft"] for r in ok]), "tpot": _stats(tpot),
        "itl": _stats([x for r in ok for x in r["itl"]]), "e2e": _stats([r["e2e"] for r in ok]),
    }


class _Server:
    """``hwkv serve`` started for the bench on a free port; ``stop()`` always ends it."""

    def __init__(self, model: str, args: argparse.Namespace, env: dict[str, str] | None = None):
        import socket

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hwkv", "serve", "--model", model, "--backend", args.backend,
               "--port", str(self.port), "--log-level", "warning", *shlex.split(args.server_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        print("starting:", shlex.join(cmd), file=sys.stderr, flush=True)
        # its stderr goes to a file (a pipe nobody reads would block it): quoted when it dies
        # HWKV_BENCH_SERVER_LOGS=DIR keeps it there (read after a run, even one cut short by a time limit)
        self.keep = os.environ.get("HWKV_BENCH_SERVER_LOGS")
        if self.keep:
            Path(self.keep).mkdir(parents=True, exist_ok=True)
        self.log = tempfile.NamedTemporaryFile(prefix="hwkv-bench-serve-", suffix=".log", delete=False,  # noqa: SIM115 (closed in stop)
                                               dir=self.keep or None)
        self.log.write((shlex.join(cmd) + "\n").encode())  # which server this log is
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stderr=self.log, env=env)
        self.healthy = False
        try:
            self._await_health(httpx, args.startup_timeout)
            self.healthy = True
        except BaseException:  # not healthy in time, or Ctrl-C during a long start-up: no server left behind
            self.stop()
            raise

    def _await_health(self, httpx: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`hwkv serve` exited with {self.proc.returncode} during start-up; "
                                   f"its stderr ends:\n{self.stderr_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"`hwkv serve` not healthy within {timeout_s:g} s")
            time.sleep(0.2)

    def stderr_tail(self, max_chars: int = 4000) -> str:
        try:
            text = Path(self.log.name).read_text(errors="replace")
        except OSError as e:
            return f"(unreadable: {e})"
        return text[-max_chars:].rstrip() or "(empty)"

    def stop(self) -> None:
        self._end()
        if self.healthy and self.proc.returncode not in (0, -15):  # died mid-run (not by our SIGTERM): say why
            print(f"`hwkv serve` exited with {self.proc.returncode}; its stderr ends:\n{self.stderr_tail()}",
                  file=sys.stderr)
        self.log.close()
        if not self.keep:
            Path(self.log.name).unlink(missing_ok=True)

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _model_dir(args: argparse.Namespace) -> str:
    from hwkv.bench import e2e

    if args.model in e2e.SHAPES:
        dtype = args.dtype or ("float32" if args.backend == "cpu" else "bfloat16")
        return str(e2e._model_dir(argparse.Namespace(model=args.model, workdir=args.workdir, dtype=dtype)))
    return args.model


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _print(res: dict[str, Any]) -> None:
    print(f"\n{res['server'].get('model')} on {res['server'].get('backend')} ({res['server'].get('device')}); "
          f"{res['num_prompts']} requests/rate, input {res['input_len']}, output {res['output_len']}")
    hdr = ["rate", "done", "fail", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
           "TPOT p50", "E2E p50", "E2E p99"]
    print(" | ".join(hdr))
    for r in res["results"]:
        row = [str(r["request_rate"]), str(r["completed"]), str(r["failed"]), f"{r['request_throughput']:.2f}",
               f"{r['output_throughput']:.1f}", f"{r['ttft']['p50_ms']:.1f}", f"{r['ttft']['p99_ms']:.1f}",
               f"{r['itl']['p50_ms']:.2f}", f"{r['itl']['p99_ms']:.2f}", f"{r['tpot']['p50_ms']:.2f}",
               f"{r['e2e']['p50_ms']:.0f}", f"{r['e2e']['p99_ms']:.0f}"]
        print(" | ".join(row))
    print("(latencies in ms)")


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        rates = _rates(args.request_rate)
    except ValueError as e:
        print(f"hwkv bench serve: error: {e}", file=sys.stderr)
        return 2
    if args.base_url is None and args.model is None:
        print("hwkv bench serve: error: give --base-url URL (a running server) or --model DIR|SHAPE", file=sys.stderr)
        return 2
    server = _Server(_model_dir(args), args) if args.base_url is None else None
    url = (args.base_url or server.url).rstrip("/")  # type: ignore[union-attr]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        info = httpx.get(url + "/server_info", headers=headers, timeout=30).json()
        vocab = args.vocab_size or info.get("vocab_size")
        if not vocab:
            print("hwkv bench serve: error: the server does not say its vocabulary; give --vocab-size", file=sys.stderr)
            return 2
        rng = random.Random(args.seed)
        results = []
        for i, rate in enumerate(rates):
            work = _workload(args.num_prompts + args.warmup, args, vocab, rng)
            warm, meas = work[: args.warmup], work[args.warmup :]
            r = asyncio.run(_run_rate(url, info["model"], rate, warm, meas, args, headers, args.seed + i))
            results.append(r)
            print(f"rate {rate}: {r['completed']} done, {r['failed']} failed, {r['output_throughput']:.1f} out tok/s",
                  file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.stop()
    res = {
        "bench": "serve", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "hwkv bench serve " + shlex.join(sys.argv[3:]), "commit": _commit(), "server": info,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "range_ratio": args.range_ratio, "results": results,
    }
    _print(res)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(str(info.get("model", "model"))).name
    device = re.sub(r"[^A-Za-z0-9._-]+", "_", str(info.get("device", "unknown"))).strip("_")
    stem = f"serve-{name}-{device}-{time.strftime('%Y-%m-%d', time.gmtime())}{'-' + args.tag if args.tag else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out_dir / stem}.json")
    return 0 if all(r["failed"] == 0 for r in results) else 1
