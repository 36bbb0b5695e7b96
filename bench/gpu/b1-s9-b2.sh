# b1 (#36 batch-1 decode), session 9, GPU batch 2 (175 s, more than a usual slot: one engine start ~40 s, then a greedy
# sweep of ~45 tile candidates at ~1 s each and eight final batch-1 rows with greedy tokens; one engine instead of a
# probe + A/B pair). Main since batch 1b: gate_up, qkv and the LM head on the persistent GEMV; this branch adds the
# balanced grid (HWKV_CUDA_STREAM_GRID) and bulk L2 prefetches (l2pf). Rows: main, the sweep's winners (neighbours of the stream
# tiles with l2pf, o_proj, down), the full grid, session 8's tiles for the three shapes (the whole change in one run) and for qkv alone (its
# tokens), each winner alone, main again. Then GPU tests of the stream kernels (bf16) and the production tiles.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
OLD_GU='block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1,stream=0'
OLD_QKV='block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=0,stream=0'
OLD_LM='block_n=4,block_k=1024,num_warps=4,num_stages=1,preload=1,evict=0,stream=0'
E=HWKV_CUDA_DENSE_CONFIG_
ROWS='[{"name": "grid full", "env": {"HWKV_CUDA_STREAM_GRID": "full"}},
 {"name": "session-8 tiles (gate_up, qkv, LM head)", "env": {"'${E}'16384X2048": "'$OLD_GU'",
  "'${E}'3072X2048": "'$OLD_QKV'", "'${E}'128256X2048": "'$OLD_LM'"}},
 {"name": "session-8 qkv tile", "env": {"'${E}'3072X2048": "'$OLD_QKV'"}}]'
step "b1_tile_sweep.py --deadline 138 --final-s 42 --keep 0.004 --rows $ROWS"
timeout -k 2 148 python3 backends/cuda/scripts/b1_tile_sweep.py --out "$OUT" --deadline 138 --final-s 42 --keep 0.004 \
  --rows "$ROWS"
echo "rc=$?"
step "GPU tests: stream kernels (bf16), the 1B production tiles"
timeout -k 2 20 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_decode_ops.py \
  -k "(stream and dtype1 and (qkv or True-3)) or (production and llama-1b) or grid" 2>&1 | tail -3
step done
