"""AscendBackend: torch_npu attention ops, one NPU, Mooncake transfer over HCCS (protocol "ascend")."""

from __future__ import annotations

from typing import Any

import torch

from hwkv.interfaces import (
    Backend,
    BackendUnavailable,
    Capabilities,
    KVCache,
    KVLayoutKind,
    NotSupported,
    Store,
    Transfer,
)
from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.transfer.mooncake import engine_installed
from hwkv_ascend import _npu
from hwkv_ascend.attention import (
    ATTENTION_FEATURES,
    BLOCK_SIZE,
    FEATURES_REASON,
    HEAD_SIZES,
    AscendAttentionBackend,
)
from hwkv_ascend.device import TRANSFER_ALIGNMENT, AscendDevice

MOONCAKE_MISSING = "mooncake-transfer-engine-npu not installed: pip install 'hwkv-ascend[mooncake]'"
KV_FP8_REFUSED = ("the Ascend attention ops (npu_fused_infer_attention_score, npu_reshape_and_cache) take no "
                  "float8 KV; vllm-ascend's quantised KV cache is int8 with per-channel antiquant scales (FIA "
                  "antiquant_scale/antiquant_offset), which hwkv-ascend does not implement yet")
EMULATED_NO_HCCS = "torch_npu is emulated on the CPU: no HCCS link to transfer over"


class AscendBackend(Backend):
    """The Ascend backend.

    KV allocations start on 2 MiB boundaries (what HCCS registration needs) whenever transfer is
    possible: Mooncake is installed on real hardware, ``transfer=True``, or after
    :meth:`create_transfer` / a Mooncake store (then create it before allocating the KV cache).
    """

    name = "ascend"

    def __init__(self, device_index: int = 0, transfer: bool = False):
        ok, reason = self.availability()
        if not ok:
            raise BackendUnavailable(reason)
        npu = _npu.torch_npu()
        self._device = AscendDevice(device_index, kv_alignment=TRANSFER_ALIGNMENT if transfer else 0)
        soc = _npu.soc_family(npu)
        self._attention = AscendAttentionBackend(soc)
        if self._device.emulated:
            protocols, why = (), EMULATED_NO_HCCS
        elif engine_installed():
            protocols, why = ("ascend",), ""
        else:
            protocols, why = (), MOONCAKE_MISSING
        if protocols:
            self._device.kv_alignment = TRANSFER_ALIGNMENT
        graphs, graphs_why = _npu.graph_support(npu)
        self._caps = Capabilities(
            dtypes=(torch.float16, torch.bfloat16),  # FIA / ATB PA take no float32 query
            head_sizes=HEAD_SIZES,  # FIA TND: 64/128/192 only
            block_sizes=(BLOCK_SIZE,),
            max_block_size=BLOCK_SIZE,
            default_block_size=BLOCK_SIZE,
            kv_layouts=(KVLayoutKind.SEPARATE_KV,),
            transfer_protocols=protocols,
            transfer_reason=why,
            graph_capture=graphs,  # ACL graphs with per-replay task updates (A3 + CANN 9: _npu.graph_support)
            max_gqa_ratio=64,  # FIA: num_heads / num_key_value_heads <= 64
            # fp8 e4m3 KV is refused by name: the NPU attention ops take no float8 KV. vllm-ascend's quantised
            # KV cache is int8 (C8): npu_quant_scatter writes it and npu_fused_infer_attention_score
            # dequantises it through antiquant_scale/antiquant_offset (per channel); not implemented here
            kv_cache_dtypes=("auto",),
            kv_cache_dtype_reason=KV_FP8_REFUSED,
            # windows through FIA's band mode (sparse_mode=4, pre_tokens/next_tokens; hwkv_ascend.attention);
            # no op takes a logit soft-cap or sink logits: refused by name
            attention_features=ATTENTION_FEATURES,
            attention_features_reason=FEATURES_REASON,
            extras={"torch_npu": str(getattr(npu, "__version__", "?")), "soc": soc,
                    "emulated": "yes" if self._device.emulated else "no",
                    "graphs": "acl (task update)" if graphs else f"off: {graphs_why}"},
        )

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            return _npu.check()
        except Exception as e:  # the contract: never raises
            return False, f"torch_npu check failed: {type(e).__name__}: {e}; {_npu.FIX}"

    def decode_ops(self) -> DecodeOps | None:
        """vllm-ascend's fused ops (``npu_rms_norm``, ``npu_rotary_mul``, ``npu_swiglu``) for
        forwards of a few tokens; ``None`` when this torch_npu lacks one of them."""
        from hwkv_ascend.decode_ops import AscendDecodeOps

        return AscendDecodeOps.create()

    def create_transfer(self, **options: Any) -> Transfer:
        # Mooncake's "ascend" transport takes the NPU id as device_name (vllm-ascend passes
        # str(torch.npu.current_device())); registered KV must start on 2 MiB boundaries.
        if not self._caps.transfer_protocols:
            raise NotSupported(f"backend {self.name!r} declares no transfer protocol: {self._caps.transfer_reason}")
        from hwkv_ascend.registration import HccsTransfer

        options.setdefault("device_name", str(self._device.index))
        options.setdefault("protocol", self._caps.transfer_protocols[0])
        self._device.kv_alignment = TRANSFER_ALIGNMENT
        return HccsTransfer(**options)

    def register_kv_cache(self, endpoint: Transfer | Store, kv_cache: KVCache) -> list[tuple[int, int]]:
        """Register ``kv_cache`` for HCCS transfer as few merged regions (one for a cache this device
        allocated with transfer enabled), refusing more than HCCL's 256; returns ``(ptr, nbytes)``
        of each (release with :func:`hwkv_ascend.registration.unregister_kv_cache`)."""
        from hwkv_ascend.registration import MERGE_GAP, register_kv_cache

        # gaps inside one arena are alignment padding of our own allocation: merge across them
        return register_kv_cache(endpoint, kv_cache, gap=max(MERGE_GAP, self._device.kv_alignment))

    def create_store(self, kind: str = "embedded", **options: Any) -> Store:
        if kind == "mooncake":
            options.setdefault("device_name", str(self._device.index))
            self._device.kv_alignment = TRANSFER_ALIGNMENT
        return super().create_store(kind, **options)
