"""What Gluon (triton.experimental.gluon) offers on this machine for sm_90, and whether a one-warp mma_v2 with the
keys in M (``S^T = K Q^T``: K ``[64 keys, 64]`` fp16 from e4m3, Q^T ``[64, 8]``) compiles, runs and is exact against
torch. ``python backends/cuda/scripts/gluon_probe.py`` (a GPU for the run; without one it only compiles)."""

from __future__ import annotations

import json
import os


def names() -> dict:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    out = {"triton": triton.__version__, "gluon": sorted(n for n in dir(gl) if not n.startswith("_"))[:400]}
    for sub in ("ampere", "hopper", "blackwell"):
        try:
            mod = __import__(f"triton.experimental.gluon.language.nvidia.{sub}", fromlist=["x"])
            out[sub] = sorted(n for n in dir(mod) if not n.startswith("_"))
        except Exception as e:  # noqa: BLE001 - a probe reports what it cannot import
            out[sub] = f"import failed: {e!r}"
    del gluon
    return out


def kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    @gluon.jit
    def st_kernel(k_ptr, q_ptr, s_ptr, N: gl.constexpr, D: gl.constexpr, H: gl.constexpr):
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                            order=[1, 0])
        qld: gl.constexpr = gl.BlockedLayout(size_per_thread=[2, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                             order=[0, 1])
        rn = gl.arange(0, N, layout=gl.SliceLayout(1, ld))
        cd = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        k8 = gl.load(k_ptr + rn[:, None] * D + cd[None, :])  # e4m3 rows
        k = gl.convert_layout(k8.to(gl.float16), a_l)
        rd = gl.arange(0, D, layout=gl.SliceLayout(1, qld))
        ch = gl.arange(0, H, layout=gl.SliceLayout(0, qld))
        qt = gl.convert_layout(gl.load(q_ptr + ch[None, :] * D + rd[:, None]), b_l)  # Q^T [D, H] from Q [H, D]
        acc = gl.zeros([N, H], gl.float32, layout=mma)
        s = mma_v2(k, qt, acc)
        so = gl.arange(0, N, layout=gl.SliceLayout(1, mma))
        sh = gl.arange(0, H, layout=gl.SliceLayout(0, mma))
        gl.store(s_ptr + so[:, None] * H + sh[None, :], s)

    return st_kernel


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    info = names()
    print(json.dumps(info), flush=True)
    k = kernel()
    try:
        import torch
    except ImportError:  # a compile-only check (a triton install of its own)
        torch = None
    if torch is not None and torch.cuda.is_available():
        g = torch.Generator(device="cuda").manual_seed(0)
        kk = (torch.randn(64, 64, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
        q = torch.randn(8, 64, device="cuda", generator=g).to(torch.float16)
        s = torch.empty(64, 8, device="cuda", dtype=torch.float32)
        c = k[(1,)](kk, q, s, N=64, D=64, H=8, num_warps=1)
        ref = kk.float() @ q.float().t()
        err = ((s - ref).norm() / ref.norm()).item()
        print(json.dumps({"mma_v2_keys_in_m": "ran", "rel_err": err, "regs": getattr(c, "n_regs", None),
                          "spills": getattr(c, "n_spills", None)}), flush=True)
    else:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import compile
        from triton.experimental.gluon._runtime import GluonASTSource

        src = GluonASTSource(k, dict(k_ptr="*fp8e4nv", q_ptr="*fp16", s_ptr="*fp32", N="constexpr", D="constexpr",
                                     H="constexpr"), dict(N=64, D=64, H=8))
        c = compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
        print(json.dumps({"mma_v2_keys_in_m": "compiled", "ptx_mma": c.asm["ptx"].count("mma.sync")}), flush=True)


if __name__ == "__main__":
    main()
