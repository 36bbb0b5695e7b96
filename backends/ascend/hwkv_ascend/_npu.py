"""Lazy access to ``torch_npu``: import, version range, SoC family.

Nothing here imports torch_npu at module import time. ``torch_npu()`` resolves the module when an op
is about to run, through ``importlib`` (which consults ``sys.modules`` first), so a test can install
an emulation under the name ``torch_npu`` before the backend is used.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

# The torch_npu releases whose op signatures match what attention.py calls (see docs/ascend-backend.md
# "Source facts"). Lower bound: the release vllm-ascend pinned when it switched its KV write to
# npu_scatter_pa_kv_cache(cache_mode="Norm"); upper bound: the next minor after today's 2.10 pin.
MIN_VERSION = (2, 8, 0)
MAX_VERSION_EXCLUSIVE = (2, 11, 0)
VERSION_RANGE = "torch_npu>=2.8.0,<2.11"
FIX = f"install CANN and {VERSION_RANGE} (see docs/ascend-backend.md)"
REQUIRED_OPS = ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "_npu_paged_attention")

# torch_npu.npu.get_soc_version() ranges (as vllm-ascend's device/hardware.py reads them).
_SOC_FAMILIES = ((200, 205, "310P"), (220, 225, "A2"), (250, 255, "A3"), (260, 260, "A5"))


def torch_npu() -> ModuleType:
    """The ``torch_npu`` module (real or an installed emulation); raises what its import raises."""
    return importlib.import_module("torch_npu")


def is_emulated(mod: ModuleType | None = None) -> bool:
    """True when ``torch_npu`` is the test emulator: tensors then live on the CPU."""
    try:
        mod = mod or torch_npu()
    except Exception:
        return False
    return bool(getattr(mod, "HWKV_EMULATED", False))


def parse_version(text: str) -> tuple[int, int, int] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check() -> tuple[bool, str]:
    """``(True, "")`` when torch_npu loads, is in range, has the ops and sees an NPU; else the reason."""
    try:
        mod = torch_npu()
    except BaseException as e:  # a broken CANN install can raise OSError, RuntimeError, even SystemExit
        if isinstance(e, KeyboardInterrupt):
            raise
        return False, f"torch_npu import failed: {type(e).__name__}: {e}; {FIX}"
    ver_text = str(getattr(mod, "__version__", ""))
    ver = parse_version(ver_text)
    if ver is None or not MIN_VERSION <= ver < MAX_VERSION_EXCLUSIVE:
        return False, f"torch_npu {ver_text or '(unknown version)'} is outside the supported range; {FIX}"
    missing = [op for op in REQUIRED_OPS if not hasattr(mod, op)]
    if missing:
        return False, f"torch_npu {ver_text} lacks {', '.join(missing)}; {FIX}"
    try:
        count = int(mod.npu.device_count())
    except Exception as e:
        return False, f"torch_npu loaded but the NPU runtime failed: {type(e).__name__}: {e}; check the driver and CANN"
    if count < 1:
        return False, "torch_npu loaded but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES and npu-smi info)"
    return True, ""


def soc_family(mod: ModuleType | None = None) -> str:
    """``"A2"``, ``"A3"``, ``"310P"``, ``"A5"`` or ``"unknown"``."""
    mod = mod or torch_npu()
    try:
        soc = int(mod.npu.get_soc_version())
    except Exception:
        return "unknown"
    for lo, hi, name in _SOC_FAMILIES:
        if lo <= soc <= hi:
            return name
    return "unknown"
