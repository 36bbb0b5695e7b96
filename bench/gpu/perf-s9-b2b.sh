# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s9-b2b.sh   (<= 105 s)
# note: HWKV_CUDA_ROPE_KV (ElementwiseOps.rope_write_kv) existed only on the perf branch for these runs; it was removed after
# batch 2b (no measurable gain) and never landed: on main the variable does nothing.
# perf (#36) session 9 batch 2b, over main + perf: the 1B public-defaults offline workload in ONE engine, main (RoPE +
# KV write in one launch, HWKV_CUDA_ROPE_KV) against rk0 (HWKV_CUDA_ROPE_KV=0: RoPE and the KV write in a launch
# each), six alternating rounds (batch 2 had them within noise in two), tokens compared, every step timed on the
# device; before the rounds, the engine's batch-256 decode graph taken apart at 544/640/768 keys with its inputs
# pinned to those lengths (graph_timeline; batch 2's ran after the rounds and was lost to the A/B tool running out of
# memory, fixed since: a recapture frees the old graphs first).
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,uuid,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 6 --steps --timeline (main, rk0)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 100 python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 6 --steps --timeline 256:544,256:640,256:768 --out "$OUT" \
  --variants '[{"name": "main"}, {"name": "rk0", "env": {"HWKV_CUDA_ROPE_KV": "0"}}]' 2>&1 | cut -c1-900
echo "rc=${PIPESTATUS[0]}"
say done
