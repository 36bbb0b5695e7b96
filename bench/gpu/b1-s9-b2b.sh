# b1 (#36 batch-1 decode), session 9, GPU batch 2b (110 s): main has gate_up, qkv, o_proj and the LM head on the
# persistent GEMV (balanced grid). One public-defaults engine (~40-50 s to start), then b1_tile_sweep.py over 19
# candidates with bulk L2 prefetches (l2pf=1: the first tile before the PDL wait; 2: also the next tile every
# iteration) and down on the stream kernel with K in chunks, greedy per shape, no evict-first reruns; final rows
# main / winners / main again with greedy tokens.
# Then the l2pf GPU tests (bf16).
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "b1_tile_sweep.py --deadline 92 --final-s 20 --keep 0.003 --evict-rerun 0"
timeout -k 2 94 python3 backends/cuda/scripts/b1_tile_sweep.py --out "$OUT" --deadline 92 --final-s 20 --keep 0.003 \
  --evict-rerun 0
echo "rc=$?"
step "GPU tests: l2pf (bf16)"
timeout -k 2 12 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_decode_ops.py \
  -k "l2pf and dtype1" 2>&1 | tail -3
step done
