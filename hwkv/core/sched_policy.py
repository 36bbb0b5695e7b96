"""Scheduling policies: the waiting order and who is preempted when KV blocks or seats run out.

One policy object answers three questions for the scheduler (``SchedulerConfig.scheduling_policy``):

* ``new_queue()`` — the waiting queue's order;
* ``victim(running)`` — which running request to preempt when a running request cannot get blocks
  (the failing request itself may be the answer);
* ``may_displace(waiting, running_req)`` — whether a waiting request may preempt a running one to be
  admitted (for lack of KV blocks or of a ``max_num_seqs`` seat).

``fcfs`` (vLLM's default): arrival order; the most recently admitted running request is preempted;
a waiting request never preempts. ``priority`` (vLLM's ``scheduling_policy="priority"``): lower
``Request.priority`` first, ties by arrival; the victim is the running request with the largest
``(priority, arrival_time)``; a waiting request may preempt running requests of a strictly larger
priority value (strict, so equal priorities never ping-pong). A new policy is one class here plus
its entry in ``POLICIES``.
"""

from __future__ import annotations

from hwkv.core.request import Request
from hwkv.core.request_queue import FCFSQueue, PriorityQueue, RequestQueue


class FCFSPolicy:
    name = "fcfs"

    def new_queue(self) -> RequestQueue:
        return FCFSQueue()

    def victim(self, running: list[Request]) -> int:
        return len(running) - 1

    def may_displace(self, waiting: Request, running_req: Request) -> bool:
        return False

    def displace_order(self, running: list[Request]) -> list[Request]:
        return []


def _rank(r: Request) -> tuple[int, float]:
    return r.priority, r.arrival_time


class PriorityPolicy:
    name = "priority"

    def new_queue(self) -> RequestQueue:
        return PriorityQueue()

    def victim(self, running: list[Request]) -> int:
        return max(range(len(running)), key=lambda i: _rank(running[i]))

    def may_displace(self, waiting: Request, running_req: Request) -> bool:
        return waiting.priority < running_req.priority

    def displace_order(self, running: list[Request]) -> list[Request]:
        """Candidates in the order they are preempted: lowest priority (largest value) first."""
        return sorted(running, key=_rank, reverse=True)


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> FCFSPolicy | PriorityPolicy:
    if name not in POLICIES:
        raise ValueError(f"scheduling policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
