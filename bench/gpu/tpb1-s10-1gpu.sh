#!/bin/bash
# #34 batch-1 decode at tp=2 on ONE H200 (session 10, tpb1; 180 s: the 8 GB checkpoint ~15 s, an engine start ~30 s,
# ~13 candidate tiles recaptured in one engine): a tp=2 rank's GEMV tiles, measured in the decode graphs of a model whose
# shapes ARE a rank's (llama-8b-tp2-rank: Llama-3-8B with 16 q / 4 kv heads, ffn 7168, vocab 64128, at tp=1), i.e. the
# rank's GEMVs and attention chained by PDL as in a tp=2 step, without the all-reduces. b1_tile_sweep.py: greedy per
# shape on one graph replay's GPU time (tp_b1_sweep.SWEEP's persistent-GEMV candidates), then the batch-1 measure and
# greedy tokens of main, the winners, each winner alone, main again. tp=1's 1B / 8B tiles are other M1_TILES keys.
# SET=8b-tp2-dense LIMIT=86 FINAL_S=14 EVICT_RERUN=0 (batch 3, 90 s): dense_kernel variants of main's per-rank tiles.
source bench/gpu/lib.sh
gpu_env
W=/dev/shm/hwkv-models; T0=$SECONDS
gpu_header
env | grep -E "HWKV_" || echo "no HWKV_ variable set"
ckpt_start llama-8b-tp2-rank bfloat16 0 60; ckpt_wait; echo "ckpt at $((SECONDS - T0)) s"
L=$((${LIMIT:-174} - (SECONDS - T0)))
timeout -k 2 -s ABRT $L python3 backends/cuda/scripts/b1_tile_sweep.py --model llama-8b-tp2-rank --set ${SET:-8b-tp2} \
  --workdir $W --out $OUT --deadline $((L - 4)) --final-s ${FINAL_S:-40} --reps 3 --evict-rerun ${EVICT_RERUN:-1} \
  > $OUT/b1-tile-sweep.log 2>&1
echo "sweep rc=$? at $((SECONDS - T0)) s"
grep "^\[sweep\]" $OUT/b1-tile-sweep.log | tail -n 45
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
date -u; echo "wall $((SECONDS - T0)) s"
