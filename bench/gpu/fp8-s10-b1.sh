# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/fp8-s10-b1.sh   (<= 150 s: P 20, T 40, A rest)
# fp8 (#36 FP8 KV decode at 32 x 32k) session 10, batch 1. (P) Gluon on the device's Triton: what it offers for sm_90
# and one mma_v2 tile with the keys in M (backends/cuda/scripts/gluon_probe.py). (T) the compiled kernel tests of
# the keys-in-M decode tile (TileConfig.keys_m: S^T = K Q^T, O^T = V^T P^T, the 4-head GQA group padded to 8 MMA
# columns instead of 16 rows). (A) one attention layer of the 1B shape at 32 x 32k, same run: bf16 default, the fp8
# default tile (M=16, 64 keys, 5 stages, 8 splits), keys_m at 64 / 32 / 128 keys, 3 / 5 stages and register caps
# (sm_90 compile on a CPU, backends/cuda/scripts/attn_compile_probe.py: 246 registers / 488 instructions a 64-key
# tile against the default's 254 / 775; 32 keys at 3 stages capped at 128 registers: 279 instructions a tile, no
# spill, 16 one-warp programs per SM), splits set for whole waves, and the default tile at 32 keys / 3 stages (is it
# the tile size or the keys in M).
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
export CUDA_VISIBLE_DEVICES=0
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 146 - ($(date +%s) - t0) )); }
say "P: gluon probe"
timeout -k 2 20 python3 backends/cuda/scripts/gluon_probe.py > "$OUT/gluon-probe.txt" 2>&1
echo "rc=$?"; tail -c 1500 "$OUT/gluon-probe.txt"
say "T: pytest backends/cuda/tests/test_fp8_kv.py -k keys_m"
timeout -k 2 40 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8_kv.py -k keys_m 2>&1 \
  | tee "$OUT/pytest-keys-m.txt" | tail -n 12
say "A: one attention layer, 1B shape, 32 x 32k"
K="keys_m=1"  # most promising first (registers, warps per SM from the sm_90 compile)
F8="default;$K,block_n=32,num_stages=3,maxnreg=128;$K,block_n=32,num_stages=3;$K,block_n=32,num_stages=3,split_target=11"
F8="$F8;$K,block_n=32,maxnreg=128;$K,num_stages=3,maxnreg=168,split_target=11;$K"
F8="$F8;$K,block_n=32,num_stages=3,maxnreg=96,split_target=19;$K,block_n=32,num_stages=3,maxnreg=128,split_target=30"
F8="$F8;block_n=32,num_stages=3;$K,block_n=128,num_stages=3"
timeout -k 2 $(( $(left) - 1 )) python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 \
  --head-size 64 --replays 20 --variants "default;keys_m=1,block_n=32,num_stages=3,num_warps=1,split_target=15" \
  --fp8-variants "${FP8_VARIANTS:-$F8}" --out "$OUT/kv-decode.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say done
