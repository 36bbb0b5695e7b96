"""Lazy access to ``torch_npu``: import, version floor, op schemas, CANN version, SoC family.

Nothing here imports torch_npu at module import time. ``torch_npu()`` resolves the module when an op
is about to run, through ``importlib`` (which consults ``sys.modules`` first), so a test can install
an emulation under the name ``torch_npu`` before the backend is used.
"""

from __future__ import annotations

import importlib
import inspect
import re
from types import ModuleType

# torch_npu 2.8.0-2.9.x have npu_scatter_pa_kv_cache without ``cache_mode`` (every KV write raises
# TypeError); op-plugin added it in April 2026 and vllm-ascend moved A2/A3 to it with torch-npu
# 2.10.0 / CANN 9.x (docs/ascend-backend.md "Source facts"). Upper bound: the next minor release.
MIN_VERSION = (2, 10, 0)
MAX_VERSION_EXCLUSIVE = (2, 11, 0)
VERSION_RANGE = "torch_npu>=2.10.0,<2.11"
MIN_CANN = 9  # older CANN rejects FIA's TND layout together with page attention
FIX = f"install CANN >= {MIN_CANN} and {VERSION_RANGE} (see docs/ascend-backend.md)"
REQUIRED_OPS = ("npu_scatter_pa_kv_cache", "npu_fused_infer_attention_score", "_npu_paged_attention")
SCATTER_KWARG = "cache_mode"

# torch_npu.npu.get_soc_version() ranges (as vllm-ascend's device/hardware.py reads them).
_SOC_FAMILIES = ((200, 205, "310P"), (220, 225, "A2"), (250, 255, "A3"), (260, 260, "A5"))
SUPPORTED_SOCS = ("A2", "A3")
# Why the others are refused (vllm-ascend runs them on separate code paths we do not implement).
SOC_REFUSALS = {
    "310P": "Ascend 310P is not supported: FIA cannot take a block table there, its KV caches are "
            "NZ-format and it has no bfloat16 (vllm-ascend's separate _310p path); use an Atlas A2/A3",
    "A5": "Ascend 950 (A5) is not supported: it has no ATB paged attention and must split mixed "
          "prefill/decode batches into separate FIA calls (vllm-ascend's A5 path); use an Atlas A2/A3",
}


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


def op_arguments(mod: ModuleType, name: str) -> set[str] | None:
    """Argument names of op ``name``: from the registered schema (``torch.ops.npu``), else the
    Python signature (the emulator's ops are plain functions); ``None`` when neither is readable."""
    import torch

    try:
        packet = getattr(torch.ops.npu, name)
        return {a.name for ov in packet.overloads() for a in getattr(packet, ov)._schema.arguments}
    except Exception:
        pass
    try:
        return set(inspect.signature(getattr(mod, name)).parameters)
    except (TypeError, ValueError, AttributeError):
        return None


def cann_version(mod: ModuleType) -> str | None:
    """CANN version string (e.g. ``"9.0.0"``, ``"8.3.RC1"``) as torch_npu reports it."""
    try:
        return str(mod.npu.utils.get_cann_version(module="CANN"))
    except Exception:
        pass
    import torch

    return getattr(torch.version, "cann", None)  # torch_npu sets it on import


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


def check() -> tuple[bool, str]:
    """``(True, "")`` when torch_npu loads, is in range, has the ops with the arguments we pass,
    runs on CANN >= 9 and sees an A2/A3 NPU; else the reason and the fix."""
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
    args = op_arguments(mod, "npu_scatter_pa_kv_cache")
    if args is None or SCATTER_KWARG not in args:
        seen = "cannot read its schema" if args is None else f"its arguments are {sorted(args)}"
        return False, (f"torch_npu {ver_text}: npu_scatter_pa_kv_cache has no {SCATTER_KWARG!r} argument "
                       f"({seen}); the ND KV write needs it; {FIX}")
    cann = cann_version(mod)
    cann_ver = parse_version(cann or "")
    if cann_ver is None or cann_ver[0] < MIN_CANN:
        return False, (f"CANN {cann or '(version unknown)'} is too old: FIA's TND layout with page attention "
                       f"needs CANN >= {MIN_CANN} (check /usr/local/Ascend/ascend-toolkit/latest/version.cfg, "
                       f"source its set_env.sh); {FIX}")
    try:
        count = int(mod.npu.device_count())
    except Exception as e:
        return False, f"torch_npu loaded but the NPU runtime failed: {type(e).__name__}: {e}; check the driver and CANN"
    if count < 1:
        return False, "torch_npu loaded but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES and npu-smi info)"
    soc = soc_family(mod)
    if soc not in SUPPORTED_SOCS:
        if soc in SOC_REFUSALS:
            return False, SOC_REFUSALS[soc]
        return False, (f"unknown Ascend SoC (get_soc_version() = {_soc_number(mod)}); supported: Atlas A2 "
                       "(220-225) and A3 (250-255)")
    return True, ""


# ACL graph decode (vllm-ascend's full decode graphs): capture, task groups and task updates on
# torch_npu.npu, the ops' workspace getters and FIA's ``.out`` variant (what a task update re-issues)
GRAPH_RUNTIME = ("NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing", "ExternalEvent",
                 "graph_task_group_begin", "graph_task_group_end", "graph_task_update_begin",
                 "graph_task_update_end")
GRAPH_OPS = ("_npu_paged_attention_get_workspace", "_npu_fused_infer_attention_score_get_max_workspace")


def capturing(mod: ModuleType) -> bool:
    """A graph capture is in progress on the current stream."""
    fn = getattr(mod.npu, "is_current_stream_capturing", None)
    return bool(fn()) if fn is not None else False


def graph_support(mod: ModuleType) -> tuple[bool, str]:
    """``(True, "")`` when decode steps can run as ACL graphs here, else why not.

    A decode graph writes the KV of its padding rows (the rows a batch is padded up to its bucket
    with) through slot -1: the write is captured at the bucket size, so it cannot be sliced to the
    real tokens per step. ``npu_scatter_pa_kv_cache`` skipping slot -1 is confirmed only on A3 with
    CANN 9 (docs/ascend-backend.md), so graphs are declared there only."""
    missing = [f"torch_npu.npu.{n}" for n in GRAPH_RUNTIME if not hasattr(mod.npu, n)]
    missing += [f"torch_npu.{n}" for n in GRAPH_OPS if not hasattr(mod, n)]
    if not hasattr(getattr(mod, "npu_fused_infer_attention_score", None), "out"):
        missing.append("torch_npu.npu_fused_infer_attention_score.out")
    if missing:
        return False, f"this torch_npu lacks the ACL graph task-update API ({', '.join(missing)})"
    soc, cann = soc_family(mod), parse_version(cann_version(mod) or "")
    if soc != "A3" or cann is None or cann[0] < MIN_CANN:
        return False, (f"decode graphs write padding rows through slot -1, which npu_scatter_pa_kv_cache is "
                       f"confirmed to skip only on A3 with CANN >= {MIN_CANN} (this is {soc}, CANN "
                       f"{cann_version(mod)}): eager decode")
    return True, ""


def _soc_number(mod: ModuleType) -> str:
    try:
        return str(int(mod.npu.get_soc_version()))
    except Exception as e:
        return f"failed: {type(e).__name__}: {e}"
