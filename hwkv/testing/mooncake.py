"""Mooncake for tests: :func:`skip_unless_mooncake` (the launcher itself is
:mod:`hwkv.stores.mooncake_service`)."""

from __future__ import annotations

import os

from hwkv.stores.mooncake_service import mooncake_available


def skip_unless_mooncake(allow_module_level: bool = False) -> None:
    """Skip the calling test when Mooncake is unusable — or fail it when ``HWKV_REQUIRE_MOONCAKE=1``
    (CI sets it: there a missing wheel or ``libibverbs`` is a broken set-up, not a reason to skip)."""
    import pytest

    ok, why = mooncake_available()
    if ok:
        return
    if os.environ.get("HWKV_REQUIRE_MOONCAKE") == "1":
        pytest.fail(f"HWKV_REQUIRE_MOONCAKE=1 but {why}", pytrace=False)
    pytest.skip(why, allow_module_level=allow_module_level)
