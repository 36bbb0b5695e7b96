"""Backend classes behind hwkv_tp_toy's specs."""

from hwkv.reference.backend import CpuBackend


class ToyBackend(CpuBackend):
    name = "toy"


class DownBackend(CpuBackend):
    name = "toy-down"

    @classmethod
    def availability(cls):
        return False, "needs the toy driver: pip install toy-driver"


class RaisingBackend(CpuBackend):
    name = "toy-raises"

    @classmethod
    def availability(cls):
        raise RuntimeError("probe exploded")


class NotABackend:
    pass
