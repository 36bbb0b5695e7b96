"""`hwkv bench pd --prefill-devices/--decode-devices`: each server sees every device, its own first."""

from __future__ import annotations

import pytest

from hwkv.bench.pd import _visible


def test_own_devices_first_and_every_other_still_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert _visible("2") == "2,0,1,3"
    assert _visible("1,0") == "1,0,2,3"
    assert _visible(None) is None
    with pytest.raises(ValueError, match="devices 7 are not among the visible ones"):
        _visible("7")
