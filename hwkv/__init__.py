"""hwkv: a hardware-abstracted LLM-inference backend SDK."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "hwkv.engine",
    "SamplingParams": "hwkv.sampling_params",
    "RequestOutput": "hwkv.outputs",
    "get_backend": "hwkv.plugins",
    "available_backends": "hwkv.plugins",
    "list_backends": "hwkv.plugins",
}


def __getattr__(name: str) -> Any:
    # Lazy so `import hwkv` stays cheap and never fails because of a plugin or a vendor library.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hwkv' has no attribute {name!r}")


__all__ = [
    "Engine", "RequestOutput", "SamplingParams", "__version__", "available_backends", "get_backend", "list_backends",
]
