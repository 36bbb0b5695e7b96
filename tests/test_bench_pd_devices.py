"""`hwkv bench pd`: --prefill-devices/--decode-devices (each server sees every device, its own first) and the
token check between setups."""

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


def test_token_check_compares_every_setup_with_the_first():
    import argparse

    from hwkv.bench.pd import _token_check

    args = argparse.Namespace(reference="none")
    doc = _token_check("unused", args, 100, {"colocated": [[1, 2, 3], [4, 5]], "disaggregated": [[1, 2, 3], [4, 6]]})
    assert doc["agreement"] == {"disaggregated": {"identical_sequences": 1, "of": 2, "first_divergence": [None, 1]}}
    assert "margin_rule" not in doc and doc["tokens"]["disaggregated"] == [[1, 2, 3], [4, 6]]
