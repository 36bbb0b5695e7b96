#!/bin/bash
# Tensor parallelism (#34), batch 3 (the last) of the 2026-11-28 fifth session. Batch 2 ran only its first engine:
# the second tp=2 engine of that process never came up after the first's close (the bench hung to its limit), so
# every engine here runs in a process of its own. In order of need:
# 0) beside the 8B checkpoint write: two tp=2 engines in one process (tiny model) with main's close (every rank
#    aborts its NCCL group at the same time), every thread's stack dumped if it hangs
# 1) Llama-3-8B shape bf16 at tp=2, batch-1 decode, offline 128 x 512/128, each checked prompt generated alone:
#    B = the all-reduce inside the decode GEMVs + the prefill's MLP halves (HWKV_TP_FUSED_AR=1
#    HWKV_TP_OVERLAP_TOKENS=4096), A = main's defaults (push kernel, no halves); B's tokens must equal A's
# 2) time left: the same loop with closed NCCL groups kept instead (HWKV_NCCL_CLOSE=keep)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:$PYTHONPATH
OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
W=/dev/shm/hwkv-models
source bench/gpu/lib.sh
LIMIT=${LIMIT:-175}; T0=$SECONDS
left() { echo $((LIMIT - 3 - (SECONDS - T0))); }
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep HWKV_ || echo "no HWKV_ variable set"
ckpt_start llama-8b bfloat16 0 60
echo "=== beside the checkpoint write: two tp=2 engines in one process (tiny), main's close (every rank aborts)"; date -u
timeout -k 3 -s ABRT 50 python3 bench/gpu/tp_engines_loop.py --engines 2 --dump-after 46 > $OUT/loop-abort.log 2>&1; echo "rc=$?"; tail -n 60 $OUT/loop-abort.log
ckpt_wait; echo "at $((SECONDS - T0)) s"
B8="--model llama-8b --workdir $W --decode 16,144 --decode-batch 1 --offline 128:512:128 --check-tokens 32 --check-alone --reference none"
for run in B:2:HWKV_TP_FUSED_AR=1+HWKV_TP_OVERLAP_TOKENS=4096 A:2; do
  name=${run%%:*}; tp=${run#*:}; L=$(left); [ $L -gt 20 ] || break; [ $L -gt 62 ] && L=62
  echo "=== $name: --tp $tp ($L s)"; date -u
  timeout -k 3 -s ABRT $L python3 -m hwkv.bench.tp $B8 --tp $tp --out $OUT/tp-llama8b-$name.json > $OUT/tp-llama8b-$name.log 2>&1; echo "rc=$?"
  grep -v "^ " $OUT/tp-llama8b-$name.log | grep -v "^\[W\|^{\|^}" | tail -n 8
done
python3 - "$OUT" <<'PY'
import json, sys
runs = {}
for n in "AB":
    try:
        runs[n] = json.load(open(f"{sys.argv[1]}/tp-llama8b-{n}.json"))["runs"][0]
    except Exception as e:  # noqa: BLE001
        print(n, "missing:", e)
for n, r in runs.items():
    print(n, r.get("label"), r.get("batch1"), (r.get("offline") or {}).get("output_tok_per_s"), r.get("custom_paths", {}).get("fused"))
if len(runs) == 2 and "tokens" in runs["A"] and "tokens" in runs["B"]:
    a, b = runs["A"], runs["B"]
    print("B tokens identical to A:", sum(x == y for x, y in zip(a["tokens"], b["tokens"])), "of", len(a["tokens"]))
    print("batch-1 B/A:", round(b["batch1"]["tok_per_s"] / a["batch1"]["tok_per_s"], 4),
          "offline B/A:", round(b["offline"]["output_tok_per_s"] / a["offline"]["output_tok_per_s"], 4))
PY
L=$(left); if [ $L -gt 25 ]; then [ $L -gt 40 ] && L=40
  echo "=== two tp=2 engines in one process, closed NCCL groups kept ($L s)"; date -u
  HWKV_NCCL_CLOSE=keep timeout -k 3 -s ABRT $L python3 bench/gpu/tp_engines_loop.py --engines 2 --dump-after $((L - 4)) > $OUT/loop-keep.log 2>&1; echo "rc=$?"; tail -n 40 $OUT/loop-keep.log
fi
date -u; echo "wall $((SECONDS - T0)) s"
