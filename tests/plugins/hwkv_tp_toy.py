"""A well-formed plugin; its factories live in hwkv_tp_toy_impl, which must be imported lazily."""

from hwkv.interfaces import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl


@hookimpl
def hwkv_backends():
    impl = "hwkv_tp_toy_impl"
    return [
        BackendSpec("toy", API_VERSION, f"{impl}:ToyBackend", "toy backend for tests"),
        BackendSpec("toy-down", API_VERSION, f"{impl}:DownBackend"),
        BackendSpec("toy-raises", API_VERSION, f"{impl}:RaisingBackend"),
        BackendSpec("toy-missing", API_VERSION, "hwkv_tp_does_not_exist:Backend"),
        BackendSpec("toy-notbackend", API_VERSION, f"{impl}:NotABackend"),
    ]
