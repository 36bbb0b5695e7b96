#!/bin/bash
# #34 batch-1 decode at tp=2, session 10 batch 1 (tpb1; 180 s, 2 GPUs: the 8B checkpoint write ~30 s and a tp=2
# engine start ~50 s leave ~90 s of sweep). While GPU 0 writes the checkpoint, GPU 1 probes the persistent GEMV at a
# rank's Llama-3-8B shard (stream_probe.py, PDL chains of distinct weight copies). Then ONE tp=2 engine at the public
# defaults: a greedy per-shape sweep of dense_kernel tiles around main's (tp_b1_sweep.py --set dense, the default since
# the stream tiles lost on one GPU: every variant recaptured on both ranks, batch-1 step time as hwkv bench tp), the
# low-latency push all-reduce (HWKV_PUSH_LL=1) and logits gather (HWKV_PUSH_GATHER=1) over the winners
# (HWKV_PUSH_LL=0 at the start: its buffer set up and self-tested, not taken until a row sets 1); then a second
# tp=2 engine with the greedy argmax inside the decode graphs (HWKV_TP_GRAPH_SAMPLE=1): main and the winners, then
# the sweep goes on there over the shapes the first engine had no time for.
source bench/gpu/lib.sh
gpu_env
W=/dev/shm/hwkv-models; T0=$SECONDS
gpu_header
env | grep -E "HWKV_" || echo "no HWKV_ variable set"
ckpt_start llama-8b bfloat16 0 70
S="block_k=4096,num_stages=1,num_warps=4,preload=2"
CFG='{"qkv": ["'$S',block_n=4,stream=6", "'$S',block_n=4,stream=4", "block_k=4096,num_stages=1,num_warps=8,preload=2,block_n=8,stream=2"],
 "o_proj": ["block_k=2048,num_stages=1,num_warps=4,preload=2,evict=1,block_n=4,stream=4", "block_k=2048,num_stages=1,num_warps=4,preload=2,evict=1,block_n=4,stream=6"],
 "down": ["block_k=8192,num_stages=1,num_warps=8,preload=2,evict=1,block_n=4,stream=2", "block_k=8192,num_stages=1,num_warps=4,preload=2,evict=1,block_n=2,stream=4"],
 "gate_up": ["block_k=4096,num_stages=1,num_warps=8,preload=0,evict=1,block_n=8,stream=4", "block_k=4096,num_stages=1,num_warps=8,preload=0,evict=1,block_n=8,stream=2"]}'
(CUDA_VISIBLE_DEVICES=1 timeout -k 2 35 python3 backends/cuda/scripts/stream_probe.py --model llama-8b-tp2 \
  --shapes qkv,down,o_proj,gate_up --configs "$CFG" --out $OUT > $OUT/stream-probe.log 2>&1; echo "probe rc=$?") &
PROBE=$!
ckpt_wait; wait $PROBE; echo "ckpt + probe at $((SECONDS - T0)) s"
grep -E "default|stream|BEST" $OUT/stream-probe.log | grep -v "^compiled" | head -n 30
L=$((172 - (SECONDS - T0)))
HWKV_PUSH_LL=0 timeout -k 2 -s ABRT $L python3 backends/cuda/scripts/tp_b1_sweep.py --tp 2 --workdir $W --out $OUT --sweep all \
  --deadline 75 --final-s 20 --total-s $((L - 3)) --second-s 36 --final2-s 9 --decode 16,144 --reps 2 \
  --rows '[{"name": "winners + ll", "env": {"HWKV_PUSH_LL": "1"}, "over_winners": true}, {"name": "winners + ll + gather", "env": {"HWKV_PUSH_LL": "1", "HWKV_PUSH_GATHER": "1"}, "over_winners": true}]' \
  --second-env '{"HWKV_TP_GRAPH_SAMPLE": "1"}' \
  > $OUT/tp-b1-sweep.log 2>&1; echo "sweep rc=$? at $((SECONDS - T0)) s"
grep -v "^ \|^\[W" $OUT/tp-b1-sweep.log | tail -n 40
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
date -u; echo "wall $((SECONDS - T0)) s"
