"""A well-formed plugin; its factories live in hwkv_tp_toy_impl, which must be imported lazily."""

from hwkv.interfaces import API_VERSION, BackendSpec
from hwkv.plugins import BenchSpec, hookimpl


@hookimpl
def hwkv_backends():
    impl = "hwkv_tp_toy_impl"
    return [
        BackendSpec("tp-toy", API_VERSION, f"{impl}:ToyBackend", "toy backend for tests"),
        BackendSpec("tp-toy-down", API_VERSION, f"{impl}:DownBackend"),
        BackendSpec("tp-toy-raises", API_VERSION, f"{impl}:RaisingBackend"),
        BackendSpec("tp-toy-missing", API_VERSION, "hwkv_tp_does_not_exist:Backend"),
        BackendSpec("tp-toy-notbackend", API_VERSION, f"{impl}:NotABackend"),
    ]


@hookimpl
def hwkv_benches():
    return [BenchSpec("tp-toy-bench", "hwkv_tp_toy_bench", "a toy bench")]
