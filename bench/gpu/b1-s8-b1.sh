# b1 (#36 batch-1 decode), session 8, GPU batch 1 (110 s): the batch-1 decode A/B at the public defaults in ONE
# engine (b1_decode_ab.py: main traced - per-kernel critical path of the replay, host phases, GPU idle - then the
# attention's first K/V tile before the PDL wait (early=1), the one-launch argmax (HWKV_CUDA_ARGMAX=1) and qkv / gate_up / down tiles that load their weights
# before the wait), then the early decode's kernel tests on the GPU (graph replay included).
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
QKV=HWKV_CUDA_DENSE_CONFIG_3072X2048 GU=HWKV_CUDA_DENSE_CONFIG_16384X2048 DOWN=HWKV_CUDA_DENSE_CONFIG_2048X8192
V='[{"name": "main"},
 {"name": "early", "env": {"HWKV_CUDA_ATTN_CONFIG": "early=1"}},
 {"name": "argmax", "env": {"HWKV_CUDA_ARGMAX": "1"}},
 {"name": "qkv-4-pre", "env": {"'$QKV'": "block_n=4,block_k=2048,num_warps=4,num_stages=1,preload=1"}},
 {"name": "gu-4-pre-ev", "env": {"'$GU'": "block_n=4,block_k=2048,num_warps=8,num_stages=1,preload=1,evict=1"}},
 {"name": "down-ev", "env": {"'$DOWN'": "block_n=4,block_k=2048,num_warps=8,num_stages=3,preload=2,evict=1"}},
 {"name": "early+argmax+qkv-4-pre", "env": {"HWKV_CUDA_ATTN_CONFIG": "early=1", "HWKV_CUDA_ARGMAX": "1", "'$QKV'": "block_n=4,block_k=2048,num_warps=4,num_stages=1,preload=1"}},
 {"name": "qkv-4x1024", "env": {"'$QKV'": "block_n=4,block_k=1024,num_warps=8,num_stages=3,preload=0"}},
 {"name": "gu-4x1024-ev", "env": {"'$GU'": "block_n=4,block_k=1024,num_warps=8,num_stages=3,preload=0,evict=1"}},
 {"name": "qkv-2-pre", "env": {"'$QKV'": "block_n=2,block_k=2048,num_warps=8,num_stages=1,preload=1"}}]'
step "b1_decode_ab.py --trace main --variants $V"
timeout -k 5 78 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --trace main --variants "$V"
echo "rc=$?"
step "pytest early decode + one-launch argmax on the GPU"
(cd backends/cuda/tests && timeout -k 5 15 python3 -m pytest -q -p no:cacheprovider test_decode_ops.py test_split_reduce.py -k "early or argmax")
echo "rc=$?"
step "conformance decode argmax (HWKV_CUDA_ARGMAX=1)"
HWKV_CUDA_ARGMAX=1 timeout -k 5 15 python3 -m hwkv conformance --backend cuda -k "test_decode_argmax" --workers 1 --report "$OUT/conf"
echo "rc=$?"
step done
