# b1 (#36 batch-1 decode), session 9, GPU batch 1 (150 s): the persistent GEMV (stream=N, kernels/dense.py
# dense_kernel_stream: N light programs per SM looping over row tiles, the input row normalised once a program).
# 1) stream_probe.py: gate_up, qkv, o_proj, the LM head alone (PDL chains in graphs, 36 s); 2) the engine A/B at the public defaults
# (b1_decode_ab.py, one engine, one measure per row): stream tiles for gate_up, the LM head, down, o_proj and qkv (RoPE/KV epilogue), alone
# and together; greedy tokens against main's.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "stream_probe.py --shapes gate_up,qkv,o_proj,lm_head"
timeout -k 2 36 python3 backends/cuda/scripts/stream_probe.py --out "$OUT" --shapes gate_up,qkv,o_proj,lm_head
echo "rc=$?"
GU=HWKV_CUDA_DENSE_CONFIG_16384X2048 LM=HWKV_CUDA_DENSE_CONFIG_128256X2048 DOWN=HWKV_CUDA_DENSE_CONFIG_2048X8192
O=HWKV_CUDA_DENSE_CONFIG_2048X2048 QKV=HWKV_CUDA_DENSE_CONFIG_3072X2048
S=block_k=2048,num_stages=1,evict=0
V='[{"name": "main"},
 {"name": "gu+lm+qkv+o", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,preload=0,stream=4",
   "'$LM'": "'$S',block_n=8,num_warps=8,preload=0,stream=4", "'$QKV'": "'$S',block_n=4,num_warps=8,preload=2,stream=4",
   "'$O'": "'$S',block_n=4,num_warps=8,preload=2,stream=4"}},
 {"name": "gu-8w8x4", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,preload=0,stream=4"}},
 {"name": "gu-8w8p2x2", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,preload=2,stream=2"}},
 {"name": "gu-4w8p2x4", "env": {"'$GU'": "'$S',block_n=4,num_warps=8,preload=2,stream=4"}},
 {"name": "gu-16w8x3", "env": {"'$GU'": "'$S',block_n=16,num_warps=8,preload=0,stream=3"}},
 {"name": "gu-8w8p1x2", "env": {"'$GU'": "'$S',block_n=8,num_warps=8,preload=1,stream=2"}},
 {"name": "lm-8w8x4", "env": {"'$LM'": "'$S',block_n=8,num_warps=8,preload=0,stream=4"}},
 {"name": "lm-4w8p2x4", "env": {"'$LM'": "'$S',block_n=4,num_warps=8,preload=2,stream=4"}},
 {"name": "qkv-4w8x4", "env": {"'$QKV'": "'$S',block_n=4,num_warps=8,preload=0,stream=4"}},
 {"name": "qkv-4w8p2x4", "env": {"'$QKV'": "'$S',block_n=4,num_warps=8,preload=2,stream=4"}},
 {"name": "o-4w8p2x4", "env": {"'$O'": "'$S',block_n=4,num_warps=8,preload=2,stream=4"}},
 {"name": "o-4w8x4", "env": {"'$O'": "'$S',block_n=4,num_warps=8,preload=0,stream=4"}},
 {"name": "down-2w8p2x1", "env": {"'$DOWN'": "'$S',block_n=2,num_warps=8,preload=2,stream=1"}}]'
step "b1_decode_ab.py --repeat 1 --variants $V"
timeout -k 2 90 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --repeat 1 --variants "$V"
echo "rc=$?"
step "GPU tests of the stream variant (bf16 included)"
timeout -k 2 20 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_decode_ops.py -k "stream and (qkv or True-3)" 2>&1 | tail -3
step done
