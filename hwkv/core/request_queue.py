"""Waiting queues: first-come-first-served and priority order (the shape of vLLM's request_queue.py).

The scheduler only peeks, pops, adds and prepends; the queue decides the order. ``prepend_request`` puts a
preempted or skipped request back where it resumes first under the queue's order: at the front for
FCFS, by its key for priority (a priority queue has no front to jump to).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from hwkv.core.request import Request


class RequestQueue(Protocol):
    def add_request(self, request: Request) -> None: ...
    def peek_request(self) -> Request: ...
    def pop_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: list[Request]) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue(deque):
    """Arrival order. A deque (``queue[0]``, iteration), with the queue methods the scheduler calls."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put ``requests`` at the front, keeping their order."""
        self.extendleft(reversed(requests))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)


class PriorityQueue:
    """Lowest ``Request.priority`` first; ties by ``arrival_time``, then ``request_id`` (as vLLM)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.request_id, request))

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty priority queue")
        return self._heap[0][3]

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty priority queue")
        return heapq.heappop(self._heap)[3]

    prepend_request = add_request

    def prepend_requests(self, requests: list[Request]) -> None:
        for r in requests:
            self.add_request(r)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = set(map(id, requests))
        self._heap = [e for e in self._heap if id(e[3]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In pop order."""
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))
