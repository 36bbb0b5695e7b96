# b1 (#36 batch-1 decode), session 8, GPU batch 2 (110 s): the batch-1 decode A/B at the public defaults in ONE engine
# (b1_decode_ab.py) at main with the early attention tile on (auto): early off (what it is worth, with its one-pass
# merge), PDL off (a race check: the same math without overlap must give the same tokens), the one-launch argmax,
# batch 1's best GEMV tiles (gate_up 8 rows evict-first, qkv 8 rows preloaded) alone and together, register caps
# (maxnreg: two 8-row programs per SM instead of one);
# then the kernel tests (attention, argmax) and the conformance sections of attention and the argmax on the GPU.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
QKV=HWKV_CUDA_DENSE_CONFIG_3072X2048 GU=HWKV_CUDA_DENSE_CONFIG_16384X2048 DOWN=HWKV_CUDA_DENSE_CONFIG_2048X8192
O=HWKV_CUDA_DENSE_CONFIG_2048X2048
GU8='"'$GU'": "block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1"'
QKV8='"'$QKV'": "block_n=8,block_k=2048,num_warps=8,num_stages=1,preload=1"'
V='[{"name": "main"},
 {"name": "early-off", "env": {"HWKV_CUDA_ATTN_CONFIG": "early=0"}},
 {"name": "pdl-off", "env": {"HWKV_CUDA_PDL": "0"}},
 {"name": "argmax", "env": {"HWKV_CUDA_ARGMAX": "1"}},
 {"name": "gu8+qkv8+argmax", "env": {'$GU8', '$QKV8', "HWKV_CUDA_ARGMAX": "1"}},
 {"name": "gu-8-ev", "env": {'$GU8'}},
 {"name": "gu-8-ev-r128", "env": {"'$GU'": "block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1,maxnreg=128"}},
 {"name": "qkv-8-pre", "env": {'$QKV8'}},
 {"name": "gu-4-ev-r80", "env": {"'$GU'": "block_n=4,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1,maxnreg=80"}},
 {"name": "down-8-r128", "env": {"'$DOWN'": "block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=2,evict=0,maxnreg=128"}}]'
step "b1_decode_ab.py --trace main --variants $V"
timeout -k 5 72 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --trace main --variants "$V"
echo "rc=$?"
step "pytest attention kernels + argmax on the GPU"
(cd backends/cuda/tests && timeout -k 5 20 python3 -m pytest -q -p no:cacheprovider test_split_reduce.py test_decode_ops.py -k "early or argmax")
echo "rc=$?"
step "conformance: attention decode sections + argmax (early auto, HWKV_CUDA_ARGMAX=1)"
HWKV_CUDA_ARGMAX=1 timeout -k 5 15 python3 -m hwkv conformance --backend cuda --quick --workers 2 -k "test_decode_argmax or (test_attention and decode)" --report "$OUT/conf"
echo "rc=$?"
step done
