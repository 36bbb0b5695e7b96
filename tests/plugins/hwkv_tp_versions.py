"""Specs written for a newer major and a newer minor version of the backend API."""

from hwkv.interfaces import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl

MAJOR, MINOR = (int(x) for x in API_VERSION.split("."))


@hookimpl
def hwkv_backends():
    factory = "hwkv_tp_toy_impl:ToyBackend"
    return [
        BackendSpec("tp-nextmajor", f"{MAJOR + 1}.0", factory),
        BackendSpec("tp-newminor", f"{MAJOR}.{MINOR + 1}", factory),
        BackendSpec("tp-badversion", "one", factory),
    ]
