# b1 (#36 batch-1 decode), session 9, GPU batch 1 (150 s): the persistent streaming GEMV (stream=N, kernels/dense.py
# dense_stream_kernel: a few programs per SM looping over row tiles, weights pipelined through shared memory).
# 1) stream_probe.py: gate_up and down alone (PDL chains in graphs, 35 s); 2) the engine A/B at the public defaults
# (b1_decode_ab.py, one engine, one measure per row): stream tiles for gate_up, the LM head, down, o_proj and qkv (RoPE/KV epilogue), alone
# and together; greedy tokens against main's.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "stream_probe.py --shapes gate_up,down"
timeout -k 2 35 python3 backends/cuda/scripts/stream_probe.py --out "$OUT" --shapes gate_up,down
echo "rc=$?"
GU=HWKV_CUDA_DENSE_CONFIG_16384X2048 LM=HWKV_CUDA_DENSE_CONFIG_128256X2048 DOWN=HWKV_CUDA_DENSE_CONFIG_2048X8192
O=HWKV_CUDA_DENSE_CONFIG_2048X2048 QKV=HWKV_CUDA_DENSE_CONFIG_3072X2048
S=block_k=2048,preload=0,evict=0
V='[{"name": "main"},
 {"name": "gu-8w8s4x1", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1"}},
 {"name": "gu-8w4s3x2", "env": {"'$GU'": "'$S',block_n=8,num_warps=4,num_stages=3,stream=2"}},
 {"name": "gu-8w8s3x2", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,num_stages=3,stream=2"}},
 {"name": "gu-16w8s3x1", "env": {"'$GU'": "'$S',block_n=16,num_warps=8,num_stages=3,stream=1"}},
 {"name": "gu-8w8s4x1-late", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1,late=1"}},
 {"name": "lm-8w8s4x1", "env": {"'$LM'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1"}},
 {"name": "lm-8w4s3x2", "env": {"'$LM'": "'$S',block_n=8,num_warps=4,num_stages=3,stream=2"}},
 {"name": "down-2w8s4x2", "env": {"'$DOWN'": "'$S',block_n=2,num_warps=8,num_stages=4,stream=2"}},
 {"name": "down-4w8s3x1", "env": {"'$DOWN'": "'$S',block_n=4,num_warps=8,num_stages=3,stream=1"}},
 {"name": "o-4w8s3x2", "env": {"'$O'": "'$S',block_n=4,num_warps=8,num_stages=3,stream=2"}},
 {"name": "qkv-8w8s4x1", "env": {"'$QKV'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1"}},
 {"name": "qkv-8w4s3x2-late", "env": {"'$QKV'": "'$S',block_n=8,num_warps=4,num_stages=3,stream=2,late=1"}},
 {"name": "gu+lm+down+o", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1",
   "'$LM'": "'$S',block_n=8,num_warps=8,num_stages=4,stream=1", "'$DOWN'": "'$S',block_n=2,num_warps=8,num_stages=4,stream=2",
   "'$O'": "'$S',block_n=4,num_warps=8,num_stages=3,stream=2"}}]'
step "b1_decode_ab.py --repeat 1 --variants $V"
timeout -k 2 108 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --repeat 1 --variants "$V"
echo "rc=$?"
step done
