"""Transfer interface (NIXL / Mooncake TransferEngine shaped): one-sided reads and writes of
registered memory between endpoints."""

from __future__ import annotations

from abc import ABC, abstractmethod

# Exclusive end of user-space virtual addresses on 64-bit Linux (x86-64 with 5-level paging and
# RISC-V sv57 reach 2**56; aarch64 2**52; device pointers of CUDA/NPU UVA live in the same space).
ADDRESS_LIMIT = 1 << 56
ADDRESS_RANGE = "0 < ptr, 0 < nbytes, ptr + nbytes <= 2**56"


class TransferError(RuntimeError):
    """A transfer could not be submitted or completed."""


class TransferTimeout(TransferError):
    """A transfer call did not finish within its timeout."""


def check_range(what: str, ptr: object, nbytes: object) -> None:
    """``ValueError`` naming ``what`` (argument and item index) unless ``ptr`` and ``nbytes`` are
    ints (bools are not) with ``0 < ptr``, ``0 < nbytes`` and ``ptr + nbytes <= ADDRESS_LIMIT``.

    This only rejects values that cannot be user-space memory: a pointer inside the range that
    is not mapped can still crash the process."""
    for name, v in (("pointer", ptr), ("nbytes", nbytes)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{what}: {name} {v!r} is a {type(v).__name__}, not an int (allowed: {ADDRESS_RANGE})")
    if ptr <= 0 or nbytes <= 0 or ptr + nbytes > ADDRESS_LIMIT:
        shown = f"{ptr:#x}" if ptr > 0 else str(ptr)
        raise ValueError(f"{what}: range (ptr={shown}, nbytes={nbytes}) is outside the address space "
                         f"(allowed: {ADDRESS_RANGE})")


class Transfer(ABC):
    """A transfer endpoint.

    Contract:
    * Addresses: every pointer (``register``, ``unregister``, the pointer lists of ``write``/``read``/
      ``submit_*``) is an int (bools are not) and every range satisfies ``0 < ptr``,
      ``0 < nbytes``, ``ptr + nbytes <= ADDRESS_LIMIT`` (2**56, the user address space of 64-bit
      Linux); the pointer and length lists are lists of equal, non-zero length and ``peer`` a
      non-empty str. Anything else raises ``ValueError`` naming the argument, the item index and
      the allowed range, before any memory is touched (see :func:`check_range`).
    * ``endpoint()`` is the address peers pass to ``write``/``read`` (e.g. ``"127.0.0.1:17001"``).
    * Memory must be ``register``-ed on both sides before it is used; ``unregister`` releases it.
    * ``write(peer, src_ptrs, dst_ptrs, lengths)`` copies ``lengths[i]`` bytes from local
      ``src_ptrs[i]`` to the peer's ``dst_ptrs[i]``; ``read`` copies peer → local. Both block until
      done and raise :class:`TransferError` on failure (never partial silent success), or
      :class:`TransferTimeout` after the endpoint's timeout; after either, the destination ranges
      are undefined (some may have been written: an endpoint may move a call in several batches).
    * ``submit_write`` / ``submit_read`` return a batch id; ``poll(batch)`` returns ``True`` when it
      completed, ``False`` while pending, and raises :class:`TransferError` on failure; it never
      blocks. ``wait(batch, timeout_s)`` raises :class:`TransferTimeout` past its timeout.
    * Networked endpoints bound every blocking call (their ``timeout_s``) and keep other Python
      threads running while one waits; a timed-out transfer may still complete, so ``unregister``
      and ``close`` wait for it (bounded) before releasing its memory.
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
        """Poll ``batch`` until it completed; :class:`TransferTimeout` after ``timeout_s``."""
        import time

        deadline = time.monotonic() + timeout_s
        while not self.poll(batch):
            if time.monotonic() > deadline:
                raise TransferTimeout(f"transfer batch {batch} did not complete within {timeout_s:g} s")
            time.sleep(0.0002)

    def write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self.wait(self.submit_write(peer, src_ptrs, dst_ptrs, lengths))

    def read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        self.wait(self.submit_read(peer, local_ptrs, remote_ptrs, lengths))

    def probe(self, peer: str) -> None:
        """Check that the path to ``peer`` works before relying on it; :class:`TransferError` naming
        why not. Same-host direct endpoints (``cuda_ipc``, ``cma``) describe the peer and read a probe
        word of its memory (the p2p handshake falls back to another protocol when this fails);
        networked endpoints have nothing to check ahead of a transfer (this default)."""
        return None

    def close(self) -> None:
        return None
