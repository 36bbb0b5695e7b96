"""Backend: the unit a plugin provides — a Device, an AttentionBackend, Capabilities, and
factories for Transfer and Store."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hwkv.interfaces.attention import AttentionBackend
from hwkv.interfaces.capabilities import Capabilities, NotSupported  # noqa: F401 (NotSupported: raised by backends)
from hwkv.interfaces.device import Device

if TYPE_CHECKING:
    from hwkv.interfaces.decode_ops import DecodeOps
    from hwkv.interfaces.elementwise_ops import ElementwiseOps
    from hwkv.interfaces.store import Store
    from hwkv.interfaces.transfer import Transfer

API_VERSION = "1.0"

# The standard endpoints, named rather than imported (resolved on the first call, as the registry's
# "package.module:Class" factories are): the interfaces import no implementation.
STANDARD_TRANSFER = "hwkv.transfer:standard_transfer"
STANDARD_STORE = "hwkv.stores:standard_store"


def _resolve(qualname: str) -> Any:
    module, _, attr = qualname.partition(":")
    return getattr(importlib.import_module(module), attr)


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

    def elementwise_ops(self) -> ElementwiseOps | None:
        """Hand-written RMSNorm / RoPE / SiLU·mul for forwards of many tokens, taken before
        torch.compile's where the engine fuses elementwise ops (contract:
        :mod:`hwkv.interfaces.elementwise_ops`), or ``None`` (the default): the compiled functions run."""
        return None

    def create_transfer(self, **options: Any) -> Transfer:
        """A Transfer endpoint on this device; default: the standard one
        (:func:`hwkv.transfer.standard_transfer`: Mooncake TransferEngine with the first declared
        protocol, or a same-host ``cma`` endpoint)."""
        return _resolve(STANDARD_TRANSFER)(self, **options)

    def create_store(self, kind: str = "embedded", **options: Any) -> Store:
        """A Store: ``"embedded"`` (in-process LRU, the default) or ``"mooncake"``; default: the
        standard one (:func:`hwkv.stores.standard_store`)."""
        return _resolve(STANDARD_STORE)(self, kind, **options)
