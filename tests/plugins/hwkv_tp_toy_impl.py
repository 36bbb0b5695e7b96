"""Backend classes behind hwkv_tp_toy's specs."""

from hwkv.reference.backend import CpuBackend

DRIVER = {"installed": False}  # tests flip it to model a driver/emulator appearing at run time


class ToyBackend(CpuBackend):
    name = "tp-toy"


class DownBackend(CpuBackend):
    name = "tp-toy-down"

    @classmethod
    def availability(cls):
        if DRIVER["installed"]:
            return True, ""
        return False, "needs the toy driver: pip install toy-driver"


class RaisingBackend(CpuBackend):
    name = "tp-toy-raises"

    @classmethod
    def availability(cls):
        raise RuntimeError("probe exploded")


class NotABackend:
    pass
