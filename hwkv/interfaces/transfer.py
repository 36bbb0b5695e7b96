"""Transfer interface (NIXL / Mooncake TransferEngine shaped): one-sided reads and writes of
registered memory between endpoints."""

from __future__ import annotations

from abc import ABC, abstractmethod


class TransferError(RuntimeError):
    """A transfer could not be submitted or completed."""


class Transfer(ABC):
    """A transfer endpoint.

    Contract:
    * ``endpoint()`` is the address peers pass to ``write``/``read`` (e.g. ``"127.0.0.1:17001"``).
    * Memory must be ``register``-ed on both sides before it is used; ``unregister`` releases it.
    * ``write(peer, src_ptrs, dst_ptrs, lengths)`` copies ``lengths[i]`` bytes from local
      ``src_ptrs[i]`` to the peer's ``dst_ptrs[i]``; ``read`` copies peer → local. Both block until
      done and raise :class:`TransferError` on failure (never partial silent success).
    * ``submit_write`` / ``submit_read`` return a batch id; ``poll(batch)`` returns ``True`` when it
      completed, ``False`` while pending, and raises :class:`TransferError` on failure.
    """

    protocol: str = "tcp"

    @abstractmethod
    def endpoint(self) -> str: ...

    @abstractmethod
    def register(self, ptr: int, nbytes: int) -> None: ...

    @abstractmethod
    def unregister(self, ptr: int) -> None: ...

    @abstractmethod
    def submit_write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> int: ...

    @abstractmethod
    def submit_read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> int: ...

    @abstractmethod
    def poll(self, batch: int) -> bool: ...

    def wait(self, batch: int, timeout_s: float = 30.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while not self.poll(batch):
            if time.monotonic() > deadline:
                raise TransferError(f"transfer batch {batch} timed out after {timeout_s}s")
            time.sleep(0.0002)

    def write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self.wait(self.submit_write(peer, src_ptrs, dst_ptrs, lengths))

    def read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        self.wait(self.submit_read(peer, local_ptrs, remote_ptrs, lengths))

    def close(self) -> None:
        return None
