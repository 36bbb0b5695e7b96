"""Backend: the unit a plugin provides — a Device, an AttentionBackend, Capabilities, and
factories for Transfer and Store."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hwkv.interfaces.attention import AttentionBackend
from hwkv.interfaces.capabilities import Capabilities, NotSupported
from hwkv.interfaces.device import Device

if TYPE_CHECKING:
    from hwkv.interfaces.decode_ops import DecodeOps
    from hwkv.interfaces.store import Store
    from hwkv.interfaces.transfer import Transfer

API_VERSION = "1.0"


class BackendUnavailable(RuntimeError):
    """The backend cannot run here; the message says why and how to fix it."""


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin's ``hwkv_backends`` hook returns.

    ``factory`` is ``"package.module:Class"`` of a :class:`Backend` subclass, imported lazily.
    ``api_version`` is the hwkv backend API the plugin was written for: a different major version
    is refused, a newer minor version warns.
    """

    name: str
    api_version: str
    factory: str
    description: str = ""


class Backend(ABC):
    """A hardware backend.

    Contract:
    * ``availability()`` is cheap, never raises and imports no more than it must; it returns
      ``(True, "")`` or ``(False, reason)`` with the reason and the fix.
    * Constructing a backend that is unavailable raises :class:`BackendUnavailable`.
    * ``capabilities`` is constant for the backend's lifetime.

    Subclasses set ``self._caps``, ``self._device`` and ``self._attention`` in ``__init__`` (or
    override the three properties).
    """

    name: str = "base"
    _caps: Capabilities
    _device: Device
    _attention: AttentionBackend

    @classmethod
    @abstractmethod
    def availability(cls) -> tuple[bool, str]: ...

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def device(self) -> Device:
        return self._device

    @property
    def attention(self) -> AttentionBackend:
        return self._attention

    def decode_ops(self) -> DecodeOps | None:
        """Fused dense ops for forwards of a few tokens (:mod:`hwkv.interfaces.decode_ops`), or
        ``None`` (the default): the model then runs its torch ops."""
        return None

    def create_transfer(self, **options: Any) -> Transfer:
        """A Transfer endpoint on this device; default: Mooncake TransferEngine with the first
        declared protocol."""
        caps = self.capabilities
        if not caps.transfer_protocols:
            raise NotSupported(f"backend {self.name!r} declares no transfer protocol: {caps.transfer_reason}")
        options.setdefault("protocol", caps.transfer_protocols[0])
        if options["protocol"] == "cma":  # same-host host memory, no Mooncake (hwkv.transfer.direct)
            from hwkv.transfer.direct import DirectTransfer, HostMover

            options.pop("protocol")
            return DirectTransfer(HostMover(), **options)
        from hwkv.transfer.mooncake import MooncakeTransfer

        return MooncakeTransfer(**options)

    def create_store(self, kind: str = "embedded", **options: Any) -> Store:
        """A Store: ``"embedded"`` (in-process LRU, the default) or ``"mooncake"``."""
        from hwkv.stores import create_store

        if kind == "mooncake":
            caps = self.capabilities
            if not caps.transfer_protocols:
                raise NotSupported(f"backend {self.name!r} declares no transfer protocol: {caps.transfer_reason}")
            options.setdefault("protocol", caps.transfer_protocols[0])
        return create_store(kind, **options)
