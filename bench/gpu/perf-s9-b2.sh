# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s9-b2.sh   (<= 140 s: AB ~70, D ~35)
# note: HWKV_CUDA_ROPE_KV (ElementwiseOps.rope_write_kv) existed only on the perf branch for these runs; it was removed after
# batch 2b (no measurable gain) and never landed: on main the variable does nothing.
# perf (#36) session 9 batch 2, over main + perf: (AB) the 1B public-defaults offline workload in ONE engine, three
# rounds, tokens compared, every step timed on the device: main (argmax in one launch up to 256 rows, 8 warps on the
# wide prefill tile - both landed after batch 1 - and RoPE + KV write in one launch, HWKV_CUDA_ROPE_KV) against RoPE
# and the KV write in launches of their own (rk0: HWKV_CUDA_ROPE_KV=0; must give the same tokens) and the argmax up
# to 64 rows as before (a64), and two decode-tile A/Bs: the full-grid tile loading its first K/V tile before the PDL
# wait (e1: HWKV_CUDA_ATTN_CONFIG_DECODE=early=1; auto is off for a loop of many tiles) and that with the elementwise
# kernels launched with PDL too (e1pdl: + HWKV_CUDA_ELEMENTWISE_PDL=1); then main's batch-256 decode graph taken apart at 544/640/768 keys, its inputs pinned
# to those lengths (graph_timeline since c6c019f); (D) the literal public-defaults figure over this tree,
# `python3 -m hwkv bench defaults --model llama-1b --b1-tokens 0`.
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,uuid,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 3 --steps --timeline (main, rk0, a64, e1, e1pdl)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 88 python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 3 --steps --timeline 256:544,256:640,256:768 --out "$OUT" \
  --variants '[{"name": "main"}, {"name": "rk0", "env": {"HWKV_CUDA_ROPE_KV": "0"}},
  {"name": "a64", "env": {"HWKV_CUDA_ARGMAX_ROWS": "64"}},
  {"name": "e1", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "early=1"}},
  {"name": "e1pdl", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "early=1", "HWKV_CUDA_ELEMENTWISE_PDL": "1"}}]' \
  2>&1 | cut -c1-1500
echo "rc=${PIPESTATUS[0]}"
say "D: python3 -m hwkv bench defaults --model llama-1b --b1-tokens 0"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 $(( 137 - ($(date +%s) - t0) )) python3 -m hwkv bench defaults \
  --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 0 --out "$OUT/defaults-llama-1b.json" 2>&1 | tail -n 25 | cut -c1-600
echo "rc=${PIPESTATUS[0]}"
say done
