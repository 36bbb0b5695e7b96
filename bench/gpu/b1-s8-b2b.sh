# 2b: batch 2's A/B was cut after two rows by a 47 s engine start - the race check (PDL off), the argmax and the tile rows did not run; they decide batch 3's defaults.
# b1 (#36 batch-1 decode), session 8, GPU batch 2b (90 s): the batch-1 decode A/B at the public defaults in ONE engine
# (b1_decode_ab.py, one measure per row, no trace) at main (early attention on, gate_up 8-row tile): the one-launch
# argmax, PDL off (a race check: the same math without overlap must give main's tokens), qkv's 8-row preloaded tile,
# gate_up's previous 4-row tile, register caps (maxnreg: two 8-row programs per SM instead of one).
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[b1] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
QKV=HWKV_CUDA_DENSE_CONFIG_3072X2048 GU=HWKV_CUDA_DENSE_CONFIG_16384X2048 DOWN=HWKV_CUDA_DENSE_CONFIG_2048X8192
V='[{"name": "main"},
 {"name": "argmax", "env": {"HWKV_CUDA_ARGMAX": "1"}},
 {"name": "pdl-off", "env": {"HWKV_CUDA_PDL": "0"}},
 {"name": "qkv-8-pre", "env": {"'$QKV'": "block_n=8,block_k=2048,num_warps=8,num_stages=1,preload=1"}},
 {"name": "gu-4-ev (previous)", "env": {"'$GU'": "block_n=4,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1"}},
 {"name": "gu-8-ev-r128", "env": {"'$GU'": "block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0,evict=1,maxnreg=128"}},
 {"name": "down-8-r128", "env": {"'$DOWN'": "block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=2,evict=0,maxnreg=128"}},
 {"name": "qkv-4x1024", "env": {"'$QKV'": "block_n=4,block_k=1024,num_warps=8,num_stages=3,preload=0"}},
 {"name": "gu-8x1024-ev", "env": {"'$GU'": "block_n=8,block_k=1024,num_warps=8,num_stages=3,preload=0,evict=1"}}]'
step "b1_decode_ab.py --repeat 1 --variants $V"
timeout -k 5 84 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --repeat 1 --variants "$V"
echo "rc=$?"
step done
