from hwkv.interfaces import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl


@hookimpl
def hwkv_backends():
    return [BackendSpec("tp-dup", API_VERSION, "hwkv_tp_toy_impl:ToyBackend", "second of two")]
