"""Compile the transposed fp8-KV decode kernel (hwkv_cuda.kernels.attention_fp8t) for sm_90 without a GPU and say
how its dots lowered: wgmma instructions and whether their A operand comes from registers (``{...}`` in the PTX)
or a shared-memory descriptor, the shared-memory traffic in the TTGIR (local_alloc / local_load / convert_layout),
and the registers and spills ptxas reports. Writes the TTGIR and PTX of each variant to OUT_DIR.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/fp8t_asm.py OUT_DIR [BN,WARPS,STAGES,LACC ...]
"""
import json
import re
import subprocess
import sys
from pathlib import Path

from hwkv_cuda.kernels import attention_fp8t as k
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
variants = sys.argv[2:] or ["64,1,5,1", "128,4,5,1", "128,4,5,0"]
ptrs = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv", out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32",
            counter_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32", kv_scale_ptr="*fp32")
ints = ("stride_scale", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_blk", "stride_kv", "stride_tok",
        "stride_head", "stride_bt")
consts = ("G", "HEAD_SIZE", "BS", "BLOCK_N", "N_PAD", "SPLIT", "FUSED", "NUM_SPLITS_PAD", "G_PAD", "MERGE_ROWS",
          "MERGE_SPLITS", "PDL", "LACC")
sig = {**ptrs, "qk_scale": "fp32", **{n: "i32" for n in ints}, **{n: "constexpr" for n in consts}}
rows = []
for v in variants:
    bn, nw, ns, la = (int(x) for x in v.split(","))
    vals = dict(G=4, HEAD_SIZE=64, BS=16, BLOCK_N=bn, N_PAD=16, SPLIT=True, FUSED=True, NUM_SPLITS_PAD=8, G_PAD=4,
                MERGE_ROWS=4, MERGE_SPLITS=8, PDL=True,
                LACC=bool(la))
    # the 1B shape's strides (blocks of 16 x 8 heads x 64) as the engine passes them (i32; 16-divisible)
    # what the launch specialises on at the 1B shape: every pointer and every stride but the scales' (8) a multiple
    # of 16 (the JIT's tt.divisibility; without it the loads compile to byte loads)
    names = k.fp8t_decode_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *ints) if n != "stride_scale"}
    c = compile(ASTSource(k.fp8t_decode_kernel, sig, vals, attrs), target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=nw, num_stages=ns))
    ttgir, ptx = c.asm["ttgir"], c.asm["ptx"]
    name = f"bn{bn}-w{nw}-s{ns}-l{la}"
    (out_dir / f"{name}.ttgir").write_text(ttgir)
    (out_dir / f"{name}.ptx").write_text(ptx)
    wg = re.findall(r"wgmma\.mma_async[^\n]*", ptx)
    info = dict(variant=name, wgmma=len(wg), wgmma_shapes=sorted({re.search(r"m\d+n\d+k\d+", w).group(0) for w in wg}),
                wgmma_reg_a=sum(1 for w in wg if re.search(r"\}\s*,\s*\{", w)),  # {D}, {A regs}, B desc
                local_alloc=ttgir.count("ttg.local_alloc"), local_load=ttgir.count("ttg.local_load"),
                convert_layout=ttgir.count("ttg.convert_layout"), async_copy=ttgir.count("async_copy_global_to_local"),
                warp_group_dot=ttgir.count("warp_group_dot "), ld_shared=ptx.count("ld.shared"),
                st_shared=ptx.count("st.shared"), cvt_e4m3=ptx.count("e4m3x2"), bar_sync=ptx.count("bar.sync"),
                n_regs=getattr(c, "n_regs", None), n_spills=getattr(c, "n_spills", None),
                shared=c.metadata.shared)
    try:  # ptxas's own count (registers, spills)
        cub = out_dir / f"{name}.cubin"
        cub.write_bytes(c.asm["cubin"])
        from triton.backends.nvidia.compiler import get_ptxas
        try:
            ptxas = get_ptxas()
        except TypeError:
            ptxas = get_ptxas(90)
        ptxas = getattr(ptxas, "path", ptxas)
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(out_dir / f"{name}.ptx"), "-o", "/dev/null"],
                           capture_output=True, text=True, timeout=120)
        m = re.search(r"Used (\d+) registers", r.stderr)
        info["ptxas_regs"] = int(m.group(1)) if m else r.stderr[-300:]
        m = re.search(r"(\d+) bytes spill stores", r.stderr)
        info["ptxas_spill_stores"] = int(m.group(1)) if m else None
    except Exception as e:  # noqa: BLE001 - the counts above stand without it
        info["ptxas"] = repr(e)[:200]
    for w in wg[:2]:
        info.setdefault("wgmma_sample", []).append(w.strip()[:160])
    rows.append(info)
    print(json.dumps(info), flush=True)
(out_dir / "summary.json").write_text(json.dumps(rows, indent=2))
