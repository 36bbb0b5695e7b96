"""Backend classes behind hwkv_tp_toy's specs."""

from hwkv.reference.backend import CpuBackend


class ToyBackend(CpuBackend):
    name = "tp-toy"


class DownBackend(CpuBackend):
    name = "tp-toy-down"

    @classmethod
    def availability(cls):
        return False, "needs the toy driver: pip install toy-driver"


class RaisingBackend(CpuBackend):
    name = "tp-toy-raises"

    @classmethod
    def availability(cls):
        raise RuntimeError("probe exploded")


class NotABackend:
    pass
