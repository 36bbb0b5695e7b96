"""Compile the attention kernel's one-token decode for sm_90 on a machine without a GPU and print what its
SASS costs: registers, spills, shared memory and the instruction mix (``python backends/cuda/scripts/
attn_compile_probe.py --kv fp8 --set all_heads=1 --set num_warps=4 --set block_n=32``). The launch mirrors
``TritonAttentionImpl.forward_into`` for a split, fused decode (defaults: the 1B shape at 32 x 32k, 8 splits,
the fp8 long-split tile); ints that are multiples of 16 get the divisibility hint the runtime gives them."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from hwkv_cuda.kernels.attention import attention_kernel, decode_heads_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="fp8", choices=["fp8", "bf16"])
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--splits", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="NAME=VALUE: a constexpr or num_warps / num_stages")
    a = ap.parse_args()
    fp8 = a.kv == "fp8"
    g, d, hkv, bs = a.group, a.head_size, 8, 16
    h = g * hkv
    cfg = dict(block_n=64, num_warps=1, num_stages=5, fp8_unpack=7 if fp8 else 0, block_m=16, head_major=1)
    for kv in a.set:
        k, v = kv.split("=")
        cfg[k] = int(v)
    gp = 1 << (g - 1).bit_length()
    sp = 1 << (a.splits - 1).bit_length()
    consts = dict(G=g, HEAD_SIZE=d, D_PAD=d, BS=bs, BLOCK_M=cfg["block_m"], BLOCK_Q=1,
                  BLOCK_N=cfg["block_n"], SPLIT=a.splits > 1, FUSED=a.splits > 1, NUM_SPLITS_PAD=sp, G_PAD=gp,
                  MERGE_ROWS=cfg.get("merge_rows", 4), MERGE_SPLITS=cfg.get("merge_splits", sp), IEEE=False, PDL=True,
                  KV_FP8=fp8, UNPACK=cfg["fp8_unpack"] if fp8 else 0, ONE_TOKEN=True,
                  HEAD_MAJOR=bool(cfg["head_major"]), PREFETCH=False, EARLY=False, WINDOW=False,
                  SOFTCAP=False, SINKS=False, sinks_ptr=None)
    kvt = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = dict(q_ptr="*bf16", kv_ptr=kvt, out_ptr="*bf16", part_acc_ptr="*fp32", part_ml_ptr="*fp32",
                counter_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32", block_tables_ptr="*i32",
                kv_scale_ptr="*fp32")
    e = 1 if fp8 else 2
    ints = dict(num_seqs=32, min_seg=128, stride_scale=hkv if fp8 else 0, stride_qt=h * d, stride_qh=d,
                stride_ot=h * d, stride_oh=d, stride_blk=2 * bs * hkv * d, stride_kv=bs * hkv * d, stride_tok=hkv * d,
                stride_head=d, stride_bt=2048, window=0)
    del e
    names = attention_kernel.arg_names
    sig, attrs = {}, {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = ptrs[n]
            attrs[(names.index(n),)] = [["tt.divisibility", 16]]
        elif n in ints:
            sig[n] = "i32"
            if ints[n] % 16 == 0 and ints[n] and n not in ("num_seqs", "window", "min_seg", "stride_bt"):
                attrs[(names.index(n),)] = [["tt.divisibility", 16]]
        else:
            sig[n] = "fp32"
    fn = attention_kernel
    if cfg.get("all_heads"):  # decode_heads_kernel: every KV head of a request in one program
        fn = decode_heads_kernel
        names = fn.arg_names
        consts = dict(HKV=hkv, H_PAD=hkv, G=g, GN=max(8, gp), HEAD_SIZE=d, D_PAD=d, BS=bs, BLOCK_N=cfg["block_n"],
                      SPLIT=a.splits > 1, FUSED=a.splits > 1, NUM_SPLITS_PAD=sp, G_PAD=gp,
                      MERGE_ROWS=cfg.get("merge_rows", 4), MERGE_SPLITS=cfg.get("merge_splits", sp), IEEE=False,
                      PDL=True, KV_FP8=fp8, F16=fp8)
        sig, attrs = {}, {}
        for n in names:
            if n in consts:
                sig[n] = "constexpr"
            elif n in ptrs:
                sig[n] = ptrs[n]
                attrs[(names.index(n),)] = [["tt.divisibility", 16]]
            elif n in ints:
                sig[n] = "i32"
                if ints[n] % 16 == 0 and ints[n] and n not in ("min_seg", "stride_bt"):
                    attrs[(names.index(n),)] = [["tt.divisibility", 16]]
            else:
                sig[n] = "fp32"
    k = compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                             **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(tool, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(tool, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    # the loops: a branch back to an earlier address (the first is the unmasked key loop)
    lines = [(int(m.group(1), 16), m.group(2)) for m in
             (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]
    loops = []
    for addr, ins in lines:
        b = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s*)?(?:0x)?([0-9a-f]+)", ins)
        if b and not re.search(r"\.L_x_", ins):
            tgt = int(b.group(1), 16)
            if tgt < addr and not re.match(r"BRA", ins):
                loops.append((tgt, addr))
    labels = {}
    for ln in sass.splitlines():
        m = re.match(r"\s*\.L_x_(\d+):", ln)
        if m:
            labels[m.group(1)] = None
    body = collections.Counter()
    if loops:
        lo, hi = min((t for t in loops if t[1] > t[0]), key=lambda t: t[0])  # the first: unmasked tiles
        for addr, ins in lines:
            if lo <= addr <= hi:
                m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ins)
                if m:
                    body[m.group(1)] += 1
    keep = ("LDL", "STL", "HMMA", "F2FP", "F2F", "I2F", "MUFU", "SHFL", "LDS", "LDSM", "LDGSTS", "LDG", "STS", "PRMT",
            "FMUL", "FADD", "FFMA", "FMNMX", "BAR", "IMAD", "LOP3", "IADD3", "LEA", "SHF", "BRA")
    spill = re.search(r"STACK:(\d+)", res)
    print(json.dumps(dict(set=a.set, kv=a.kv, regs=int(regs.group(1)) if regs else None,
                          stack=int(spill.group(1)) if spill else None,
                          shared=k.metadata.shared, total=sum(ops.values()),
                          ops={o: ops[o] for o in keep if ops[o]}, loop_total=sum(body.values()),
                          loop={o: body[o] for o in keep if body[o]}, triton=triton.__version__)))
    if os.environ.get("TTGIR_OUT"):
        with open(os.environ["TTGIR_OUT"], "w") as f:
            f.write(k.asm["ttgir"])
    if os.environ.get("SASS_OUT"):
        with open(os.environ["SASS_OUT"], "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
