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


def test_bars_are_the_itl_ratio_per_rate_and_the_transfer_share_of_the_prefill():
    from hwkv.bench.pd import _bars

    def row(rate, ttft, itl99):
        return {"request_rate": rate, "ttft": {"p50_ms": ttft}, "itl": {"p99_ms": itl99}}

    colocated = [row(1.0, 200.0, 30.0), row("inf", 300.0, 180.0)]
    disagg = [row(1.0, 210.0, 6.0), row("inf", 230.0, 9.0)]
    b = _bars(colocated, disagg, {"seconds": 0.04, "transfers": 20})
    assert b["transfer_ms_per_load"] == pytest.approx(2.0) and b["prefill_ms"] == 200.0
    assert b["transfer_over_prefill"] == pytest.approx(0.01)
    assert [r["itl_p99_ratio"] for r in b["rates"]] == [pytest.approx(0.2), pytest.approx(0.05)]
    assert [r["ttft_p50_added_ms"] for r in b["rates"]] == [pytest.approx(10.0), pytest.approx(-70.0)]
    assert _bars(None, disagg, {"seconds": 0.0, "transfers": 0}) == {}
    assert _bars(colocated, disagg, {"seconds": 0.0, "transfers": 0})["transfer_over_prefill"] is None
