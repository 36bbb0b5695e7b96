"""Structured outputs: a grammar constrains which tokens a request may sample next.

A request asks with ``SamplingParams.structured_outputs``, vLLM's keys, exactly one of:
``{"json": schema}`` (a JSON Schema, dict or string; compact JSON, no free whitespace, unless the
schema's ``x-guidance`` says otherwise), ``{"json_object": True}`` (any JSON object),
``{"regex": pattern}``, ``{"choice": ["a", "b"]}``, ``{"grammar": text}`` (Lark or GBNF / EBNF).
The grammar engine is llguidance (the library behind vLLM's ``guidance`` backend and SGLang's
``llguidance`` backend); it is imported only when a request asks for structure.

Per step, before sampling, :meth:`StructuredOutputs.bitmask` advances each constrained request's
matcher by the tokens it sampled since (the runner records every token before the next sample,
also with async scheduling) and fills one packed int32 row per request: bit ``j`` of word ``w``
allows token ``32 w + j`` (llguidance's and xgrammar's layout). The sampler applies it with plain
tensor ops on the device (:func:`hwkv.model.sampler.apply_token_bitmask`): no vendor kernel, no host
sync. Rows of unconstrained requests stay all ones. Compiled grammars are cached (LRU by grammar
text, for validation and errors); each request gets a matcher of its own, taken from the grammar's
idle matchers (reset when their request ended) or compiled for it. Not a copy of the cached one:
llguidance's ``deep_copy`` shares the lexer (and the lock around it) between copies, so a parallel
fill of many copies runs one row at a time.

Overlap (:meth:`StructuredOutputs.prefetch`): as soon as a step's sampling is launched, a worker
thread waits for its tokens, advances the matchers (llguidance's executor, in parallel, the GIL
released) and computes the *next* step's masks into host rows indexed by the runner's request
slot - while the main thread applies the previous step's output, schedules, builds and launches the
next forward, and the device runs it (SGLang's overlap scheduler and vLLM's async scheduling hide
grammar work behind the forward the same way). The next :meth:`~StructuredOutputs.bitmask` joins
the worker and gathers those rows. A new request's first mask is computed on the worker too, submitted
when the request is added (:meth:`~StructuredOutputs.start_fresh`, beside its prefill); only a
matcher in error, or ``overlap = False``, leaves a row to be computed in the step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from hwkv.interfaces.device import Device

KEYS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept
IDLE_MAX = 256  # idle matchers kept per grammar (at most the peak of its concurrent requests)
SWITCH_S: float | None = None  # StructuredOutputs.switch_s: the GIL switch interval while constrained requests run
# llguidance's executor threads: at most 8, and two cores left to the engine's main thread and the
# process's other work. Its own default (80% of the cores, up to 32) oversubscribes a host shared by
# several GPUs' processes, where a parallel fill waits for its last thread to be scheduled; 64 rows
# at tens of microseconds each need no more than 8.
MASK_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) - 2 if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 1) - 2))


def grammar_of(spec: Any) -> str:
    """The llguidance grammar of a ``structured_outputs`` dict; ``ValueError`` names what is wrong."""
    import llguidance

    if not isinstance(spec, dict):
        raise ValueError(f"SamplingParams.structured_outputs must be a dict with one of {', '.join(KEYS)}, "
                         f"got {type(spec).__name__}")
    given = {k: v for k, v in spec.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KEYS))
    if unknown:
        raise ValueError(f"SamplingParams.structured_outputs has unknown key(s) {unknown} (allowed: {', '.join(KEYS)})")
    if len(given) != 1:
        raise ValueError(f"SamplingParams.structured_outputs must set exactly one of {', '.join(KEYS)}, "
                         f"got {sorted(given) or 'none'}")
    (kind, value), = given.items()
    try:
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            return llguidance.grammar_from("json_schema", json.dumps(_compact(schema)))
        if kind == "json_object":
            return llguidance.grammar_from("json_schema", json.dumps(_compact({"type": "object"})))
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", value)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind} must be a non-empty string")
        return llguidance.grammar_from("regex" if kind == "regex" else "grammar", value)
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured_outputs.{kind} is invalid: {e}") from None


def _compact(schema: Any) -> Any:
    """JSON without free whitespace (``{"a":1,"b":[2]}``), as vLLM's ``disable_any_whitespace``: a
    model cannot pad its answer with whitespace until max_tokens, and answers take fewer tokens. A
    schema's own ``x-guidance`` options (llguidance's) win."""
    if isinstance(schema, dict) and "x-guidance" not in schema:
        return {**schema, "x-guidance": {"whitespace_flexible": False}}
    return schema


class StructuredOutputs:
    """The grammar state of one engine's constrained requests (built lazily: the tokenizer on the first
    grammar). ``tokenizer``: the model's :class:`~hwkv.model.tokenizer.Tokenizer`; ``vocab_size``: the
    model's logits width (tokens the tokenizer does not have are never allowed)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer  # hwkv.model.tokenizer.Tokenizer (its tokenizers JSON feeds llguidance), or None
        self.vocab_size, self.eos = vocab_size, list(eos_token_ids)
        self._tok: Any = None
        self._executor: Any = None
        # grammar text -> [the compiled matcher (validation), idle matchers of their own (reset)]
        self._cache: OrderedDict[str, list[Any]] = OrderedDict()
        # req id -> [matcher, tokens consumed, slot whose prefetched row is the mask after them (or None),
        #            its grammar's cache entry]
        self.matchers: dict[str, list[Any]] = {}
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats
        self.num_matchers = 0  # matchers built for requests (the rest were idle ones, reused)
        # True: a request's matcher is a deep_copy of the cached one (llguidance shares the lexer and its
        # lock between copies: the A/B of matchers of their own, `hwkv bench structured NAME+shared`)
        self.shared_lexer = False
        self._retired: list[list[Any]] = []  # dropped requests' states, made idle after the worker's join
        # The GIL switch interval while constrained requests run (None: Python's, 5 ms by default). The worker
        # needs the GIL to start on a step's tokens; while the main thread runs Python (output processing,
        # scheduling, input building) it gets it only after one interval, so a step's host work can hold the
        # mask off. The process's previous interval comes back when the last constrained request leaves.
        self.switch_s: float | None = SWITCH_S
        self._saved_switch: float | None = None
        # bitmask() calls that masked something, and their main-thread time (the part on the step's
        # critical path: the join of the worker included)
        self.num_masks, self.mask_s = 0, 0.0
        self.join_s = 0.0  # of mask_s: waiting for the worker
        self.worker_s = 0.0  # the worker's matcher and mask time (overlapped), its waits for the tokens left out
        self.rows_prefetched = self.rows_computed = 0  # mask rows from the worker / computed in bitmask()
        self.rows_in_place = 0  # of rows_prefetched: written by the worker into the staging buffer, in order
        # (staging buffer address, request ids, epoch) of the rows the worker wrote in place (see prefetch())
        self._pred: tuple[int, tuple[str, ...], int] | None = None
        self._epoch = 0  # prefetch() and bitmask() calls
        # where mask_s goes after the join (gather of the worker's rows, rows computed in the step, the
        # copy's launch) and where the worker's time goes (consume, fill): the bench reports them
        self.gather_s = self.compute_s = self.copy_s = 0.0
        self.consume_s = self.fill_s = 0.0
        self.wake_s = 0.0  # worker: from a step's submit to its tokens read (device + GIL waits)
        self._worker: ThreadPoolExecutor | None = None
        self.overlap = True  # masks on the worker thread (False: every mask computed in the step)
        self._futures: list[Future[None]] = []
        self._fresh: list[tuple[list[Any], int, list[int]]] = []  # added matchers whose first mask is due
        self._slot_rows = torch.empty((0, 0), dtype=torch.int32)  # the worker's masks, row = request slot
        # two pinned host buffers, used in turn: a pageable buffer's copy would wait for the device
        # stream (the step's forward) and stall the host; a buffer is written again two steps later,
        # when its copy has long completed (the step in between read its sampled tokens)
        self._bufs: list[torch.Tensor] = []
        self._turn = 0

    @property
    def words(self) -> int:
        return (self.vocab_size + 31) // 32

    def _tokenizer(self) -> Any:
        if self._tok is None:
            import llguidance

            if self.tokenizer is None:
                raise ValueError("SamplingParams.structured_outputs needs the model's tokenizer, and this model "
                                 "has none (no tokenizer.json)")
            self._tok = llguidance.LLTokenizer(self.tokenizer.to_json(), n_vocab=self.vocab_size,
                                               eos_token=self.eos or None)
        return self._tok

    def compile(self, spec: dict[str, Any]) -> Any:
        """The compiled matcher of ``spec`` (cached); ``ValueError`` if the grammar is invalid."""
        return self._entry(spec)[0]

    def _entry(self, spec: dict[str, Any]) -> list[Any]:
        import llguidance

        grammar = grammar_of(spec)
        entry = self._cache.get(grammar)
        if entry is not None:
            self._cache.move_to_end(grammar)
            return entry
        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            kind = next(k for k in KEYS if spec.get(k) not in (None, False))
            raise ValueError(f"SamplingParams.structured_outputs.{kind} is invalid: {m.get_error()}")
        self.num_compiled += 1
        entry = self._cache[grammar] = [m, [], grammar]
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return entry

    def _matcher(self, entry: list[Any]) -> Any:
        """A matcher of ``entry``'s grammar at its start, with a lexer of its own: an idle one, else
        compiled (about as costly as a few masks; llguidance releases the GIL meanwhile)."""
        import llguidance

        if self.shared_lexer:
            return entry[0].deep_copy()
        if entry[1]:
            return entry[1].pop()
        self.num_matchers += 1
        return llguidance.LLMatcher(self._tokenizer(), entry[2], log_level=0)

    def add(self, req_id: str, spec: dict[str, Any], slot: int | None = None, outputs: list[int] | None = None) -> None:
        """Start (or, after a preemption, restart) ``req_id``'s matcher at its first output token. With
        its runner ``slot`` (and the ``outputs`` a restarted request recomputes), :meth:`start_fresh`
        computes its first mask on the worker, beside the request's prefill."""
        self.drop(req_id)
        entry = self._entry(spec)
        st = self.matchers[req_id] = [self._matcher(entry), 0, None, entry]  # a new list: the worker keeps the old
        if slot is not None and self.overlap:
            self._fresh.append((st, slot, list(outputs or ())))

    def start_fresh(self) -> None:
        """Submit the first masks of the matchers added since the last call to the worker."""
        if self._fresh:
            jobs, self._fresh = self._fresh, []
            self._submit(self._first, jobs)

    def _submit(self, fn: Any, *args: Any) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="hwkv-grammar")
        if self.switch_s is not None and self._saved_switch is None and sys.getswitchinterval() > self.switch_s:
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_s)
        self._futures.append(self._worker.submit(fn, *args))

    def _restore_switch(self) -> None:
        if self._saved_switch is not None:
            sys.setswitchinterval(self._saved_switch)
            self._saved_switch = None

    def drop(self, req_id: str) -> None:
        st = self.matchers.pop(req_id, None)
        if st is not None and not self.shared_lexer:
            self._retired.append(st)  # made idle once no worker job can hold it (join)
            if all(f.done() for f in self._futures):
                self.join()  # the worker is done: no wait
        if not self.matchers:
            self._restore_switch()

    def _recycle(self) -> None:
        """Reset the dropped requests' matchers into their grammar's idle list (the worker is joined).
        A matcher whose first mask is still to be submitted (:meth:`start_fresh`) waits."""
        due = {id(st) for st, _, _ in self._fresh}
        keep = []
        for st in self._retired:
            if id(st) in due:
                keep.append(st)
            elif not st[0].is_error() and len(st[3][1]) < IDLE_MAX:
                st[0].reset()
                st[3][1].append(st[0])
        self._retired = keep

    def _executor_(self) -> Any:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        return self._executor

    def prefetch(self, req_ids: list[str], slots: list[int], num_outputs: list[int], host: torch.Tensor,
                 event: Any) -> None:
        """Start the next step's masks on the worker thread: row ``j`` of ``host`` (valid once ``event``
        fired; ``None``: now) is the token just sampled for ``req_ids[j]`` (slot ``slots[j]``,
        ``num_outputs[j]`` outputs recorded before it). Only matchers that have consumed every
        recorded output take part; :meth:`bitmask` joins the worker before anything reads its rows."""
        self.join()
        if not self.overlap:
            return
        jobs = [(j, st, slots[j]) for j, rid in enumerate(req_ids)
                if (st := self.matchers.get(rid)) is not None and st[1] == num_outputs[j]]
        if not jobs:
            return
        for _, st, _ in jobs:
            st[2] = None  # until the worker wrote the row
        # when every row takes part, the worker also writes the rows in this order into the staging buffer the
        # next bitmask() takes: a next step of the same requests in the same order (a decode step) gathers
        # nothing. That buffer's last copy was launched a step before this one's, before the sampling whose
        # tokens the worker waits for, so it has completed when the worker writes
        pred = None
        self._epoch += 1  # a prediction holds for the next bitmask() call only
        if len(jobs) == len(req_ids) and self._bufs and len(jobs) <= self._bufs[0].shape[0]:
            pred = (self._bufs[self._turn ^ 1], tuple(req_ids), self._epoch)
        self._submit(self._advance, jobs, host, event, time.perf_counter(), pred)

    def _first(self, jobs: list[tuple[list[Any], int, list[int]]]) -> None:
        t0 = time.perf_counter()
        todo = []
        for st, slot, outs in jobs:
            if outs:
                st[0].consume_tokens(outs)
                st[1] = len(outs)
            if not st[0].is_error():
                todo.append((st[0], slot))
        self._fill(todo)
        for st, slot, _ in jobs:
            if not st[0].is_error():
                st[2] = slot
        self.worker_s += time.perf_counter() - t0

    def _fill(self, todo: list[tuple[Any, int]]) -> None:
        """Masks of ``(matcher, slot)`` into the slot rows (grown as needed; only the worker writes them)."""
        if not todo:
            return
        n = max(slot for _, slot in todo) + 1
        if self._slot_rows.shape[0] < n or self._slot_rows.shape[1] != self.words:
            self._slot_rows = torch.empty((max(n, 2 * self._slot_rows.shape[0]), self.words), dtype=torch.int32)
        self._executor_().unsafe_compute_mask_ptr(todo, self._slot_rows.data_ptr(), self.words * 4,
                                                  self._slot_rows.shape[0])

    def _advance(self, jobs: list[tuple[int, list[Any], int]], host: torch.Tensor, event: Any, t_submit: float,
                 pred: tuple[torch.Tensor, tuple[str, ...], int] | None = None) -> None:
        if event is not None:
            event.synchronize()  # (releases the GIL)
        t0 = time.perf_counter()
        self.wake_s += t0 - t_submit
        toks = host.tolist()
        ex = self._executor_()
        ok = ex.consume_token_par([(st[0], toks[j]) for j, st, _ in jobs])
        t1 = time.perf_counter()
        todo = []
        for (_, st, slot), good in zip(jobs, ok):
            st[1] += 1
            if good:  # a matcher in error is left to bitmask() (it allows only EOS)
                todo.append((st[0], slot))
        self._fill(todo)
        if pred is not None and len(todo) == len(jobs):
            buf, ids, epoch = pred
            np.take(self._slot_rows.numpy(), [slot for _, _, slot in jobs], axis=0, out=buf.numpy()[: len(jobs)],
                    mode="clip")
            self._pred = (buf.data_ptr(), ids, epoch)
        self.consume_s += t1 - t0
        self.fill_s += time.perf_counter() - t1
        for (_, st, slot), good in zip(jobs, ok):
            if good:
                st[2] = slot
        self.worker_s += time.perf_counter() - t0

    def join(self) -> None:
        """Wait for the worker's masks (re-raising its failure)."""
        futs, self._futures = self._futures, []
        for fut in futs:
            fut.result()
        if self._retired:
            self._recycle()

    def close(self) -> None:
        """Stop the worker thread (idempotent)."""
        self._fresh.clear()
        self.join()
        self._restore_switch()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def bitmask(self, req_ids: list[str], outputs: list[list[int]], device: Device,
                slots: list[int] | None = None) -> torch.Tensor | None:
        """Packed allowed-token bits ``[R, ceil(V / 32)]`` int32 on ``device`` for these rows, or
        ``None`` when none of them is constrained. A row the worker prefetched for this request's slot
        (``slots[i]``) after all of its outputs is gathered; any other matcher first consumes the
        row's tokens since the last call and computes its mask here."""
        epoch = self._epoch
        self._epoch += 1
        rows = [(i, self.matchers[rid]) for i, rid in enumerate(req_ids) if rid in self.matchers]
        if not rows:
            return None
        t0 = time.perf_counter()
        join0 = self.join_s
        self.join()
        self.join_s += time.perf_counter() - t0
        todo, hit, hit_slots, dead = [], [], [], []
        for i, state in rows:
            m, seen, ready = state[:3]
            out = outputs[i]
            if ready is not None and seen == len(out) and slots is not None and ready == slots[i]:
                hit.append(i)
                hit_slots.append(ready)
                continue
            state[2] = None
            if len(out) > seen:
                m.consume_tokens(out[seen:])
                state[1] = len(out)
            if m.is_error():  # cannot happen through the mask; end the request rather than sample garbage
                dead.append(i)
            else:
                todo.append((m, i))
        t1 = time.perf_counter()
        # host rows through numpy: single-threaded copies. torch's CPU fill / gather of a 1 MB mask run
        # on its intra-op thread pool, which on a many-core host beside llguidance's threads waits for its
        # slowest thread to be scheduled (milliseconds, on the step's critical path)
        mask = self._buffer(len(req_ids), device, fill=len(hit) < len(req_ids))
        rows_np = mask.numpy()
        pred, self._pred = self._pred, None
        if len(hit) == len(req_ids) and pred == (mask.data_ptr(), tuple(req_ids), epoch):
            self.rows_in_place += len(hit)  # the worker wrote them there, in this order (see prefetch())
        elif len(hit) == len(req_ids):  # every row from the worker: one pass, no temporary
            np.take(self._slot_rows.numpy(), hit_slots, axis=0, out=rows_np, mode="clip")  # (clip: unbuffered)
        elif hit:
            rows_np[hit] = self._slot_rows.numpy()[hit_slots]
        for i in dead:
            rows_np[i] = 0
            for t in self.eos:
                rows_np[i, t // 32] |= _bit(t % 32)
        t2 = time.perf_counter()
        # (llguidance.torch's helpers do the same; importing it runs torch.compile decorators)
        row_bytes = self.words * 4
        if len(todo) == 1:
            m, i = todo[0]
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
        elif todo:  # in parallel, on llguidance's own threads (the GIL released)
            self._executor_().unsafe_compute_mask_ptr(todo, mask.data_ptr(), row_bytes, len(req_ids))
        t3 = time.perf_counter()
        self.rows_prefetched += len(hit)
        self.rows_computed += len(todo)
        self.num_masks += 1
        out_mask = mask.to(device.torch_device, non_blocking=True)
        t4 = time.perf_counter()
        self.gather_s += t2 - t1
        self.compute_s += (t3 - t2) + (t1 - t0 - (self.join_s - join0))  # the consumes in the loop included
        self.copy_s += t4 - t3
        self.mask_s += t4 - t0
        return out_mask

    def _buffer(self, rows: int, device: Device, fill: bool = True) -> torch.Tensor:
        """``[rows, words]`` int32 on the host, all ones (``fill``; else the caller writes every row):
        staging buffers (page-locked, used in turn) for a device with asynchronous copies, plain host
        memory where the host is the device."""
        if not device.async_copies:
            return torch.full((rows, self.words), -1, dtype=torch.int32)
        if not self._bufs or self._bufs[0].shape[0] < rows:
            n = max(rows, 2 * self._bufs[0].shape[0] if self._bufs else 64)
            try:
                self._bufs = [device.host_empty((n, self.words), torch.int32) for _ in range(2)]
            except RuntimeError:  # no pinned memory here: pageable (the copy then waits for the stream)
                return torch.full((rows, self.words), -1, dtype=torch.int32)
        self._turn ^= 1
        buf = self._bufs[self._turn][:rows]
        if fill:
            buf.numpy().fill(-1)  # (numpy: one thread, see bitmask())
        return buf


def _bit(j: int) -> int:
    return (1 << j) - (1 << 32 if j == 31 else 0)  # int32 two's complement of bit j
