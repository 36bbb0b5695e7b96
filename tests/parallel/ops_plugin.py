"""A test plugin (``HWKV_PLUGIN_MODULES=tests.parallel.ops_plugin``): the CPU reference backend that
also offers the torch reference decode ops, so the tensor-parallel fused decode path (each
projection's partial output summed by ``Communicator.all_reduce_add``) runs in worker processes."""

from __future__ import annotations

from hwkv.interfaces.backend import API_VERSION, BackendSpec
from hwkv.model.decode_ops import TorchDecodeOps
from hwkv.plugins import hookimpl
from hwkv.reference.backend import CpuBackend

NAME = "cpu-decode-ops"


class OpsBackend(CpuBackend):
    name = NAME

    def decode_ops(self) -> TorchDecodeOps:
        return TorchDecodeOps()


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [BackendSpec(name=NAME, api_version=API_VERSION, factory="tests.parallel.ops_plugin:OpsBackend",
                        description="CPU reference backend with the torch reference decode ops (tests)")]
