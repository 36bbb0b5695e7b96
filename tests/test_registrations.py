"""Registration bookkeeping shared by the Mooncake transfer and store adapters."""

import pytest

from hwkv.interfaces import TransferError
from hwkv.transfer.mooncake import Registrations


def test_failed_register_tracks_nothing_and_failed_unregister_keeps_tracking():
    regs = Registrations()
    with pytest.raises(TransferError, match="register_memory.*code -1"):
        regs.register(0x1000, 64, lambda p, n: -1, TransferError, "register_memory")
    assert regs.items() == []
    regs.register(0x1000, 64, lambda p, n: 0, TransferError, "register_memory")
    with pytest.raises(ValueError, match="overlaps"):
        regs.register(0x1020, 64, lambda p, n: 0, TransferError, "register_memory")
    with pytest.raises(TransferError, match="unregister_memory.*code -5"):
        regs.unregister(0x1000, lambda p: -5, TransferError, "unregister_memory")
    assert regs.items() == [(0x1000, 64)] and regs.covers(0x1010, 16)  # still registered
    regs.unregister(0x1000, lambda p: 0, TransferError, "unregister_memory")
    assert regs.items() == []
    with pytest.raises(ValueError, match="not a registered buffer"):
        regs.unregister(0x1000, lambda p: 0, TransferError, "unregister_memory")
