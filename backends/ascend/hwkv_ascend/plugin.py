"""Entry point ``hwkv.backends: ascend``: registers the Ascend backend. Imports nothing vendor-specific."""

from __future__ import annotations

from hwkv.interfaces.backend import API_VERSION, BackendSpec

try:
    from hwkv.plugins import hookimpl
except ImportError:  # older hwkv without the plugins package: same marker by project name
    import pluggy

    hookimpl = pluggy.HookimplMarker("hwkv")


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="ascend",
            api_version=API_VERSION,
            factory="hwkv_ascend.backend:AscendBackend",
            description="Huawei Ascend NPU via torch_npu (FIA TND / ATB paged attention, HCCS transfer)",
        )
    ]
