# b1 (#36 batch-1 decode), session 9, GPU batch 2 (175 s, more than a usual slot: one engine start ~45 s, then a greedy
# sweep of ~70 tile candidates at ~1 s each - capture, compile, 60 replays - and the final batch-1 rows with tokens;
# this sweep replaces separate probe + A/B runs). Batch 1 showed the persistent GEMV at 1-2 register-heavy programs per
# SM losing (Triton does not pipeline a loop without a dot); this tries the light variant (45-64 registers) at 2-12
# programs per SM, per shape, in the engine (b1_tile_sweep.py), then GPU tests of the stream kernels (bf16).
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "b1_tile_sweep.py --deadline 140 --final-s 30"
timeout -k 2 150 python3 backends/cuda/scripts/b1_tile_sweep.py --out "$OUT" --deadline 140 --final-s 30
echo "rc=$?"
step "GPU tests of the stream kernels (bf16)"
timeout -k 2 16 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_decode_ops.py \
  -k "stream and dtype1 and (qkv or True-3)" 2>&1 | tail -3
step done
