# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/fp8-s10-b3.sh   (<= 150 s: A 36, B 30, T 38, N rest)
# fp8 (#36) session 10, batch 3, over main with decode_heads_kernel the fp8 long-split default (all_heads=1: 4 warps,
# 32-key tiles, 3 stages). (A) one layer, 1B shape, 32 x 32k, same run: the new default, session 9's one-warp tile
# (all_heads=0 plus its fields), all_heads at 5 stages / 6 and 12 splits. (B) one layer, 8B shape (head 128), 32 x
# 32k: both caches' defaults against all_heads at 8 warps (sm_90 compile: 251 registers, no spill, one program per SM)
# with 4 / 8 splits and 16-key tiles. (T) compiled tests of the heads kernel and its fallback. (N) Nsight Compute of
# the new default: DRAM / L2 sectors read against the step's 1 GiB, occupancy, stall reasons.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
export CUDA_VISIBLE_DEVICES=0
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 146 - ($(date +%s) - t0) )); }
say "A: one layer, 1B shape, 32 x 32k"
F8="default;all_heads=0,block_n=64,num_warps=1,num_stages=5;num_stages=5;split_target=11;split_target=23;default"
timeout -k 2 36 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 \
  --head-size 64 --replays 20 --variants default --fp8-variants "$F8" --out "$OUT/kv-decode-1b.json" 2>&1 | cut -c1-300
echo "rc=${PIPESTATUS[0]}"
say "B: one layer, 8B shape (head 128), 32 x 32k"
H="all_heads=1,num_warps=8,num_stages=3,block_n=32"
timeout -k 2 30 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 \
  --head-size 128 --replays 15 --variants default \
  --fp8-variants "default;$H,split_target=7;$H,split_target=15;all_heads=1,num_warps=8,num_stages=3,block_n=16" \
  --out "$OUT/kv-decode-8b.json" 2>&1 | cut -c1-300
echo "rc=${PIPESTATUS[0]}"
say "T: pytest test_fp8_kv.py test_kernels.py test_split_reduce.py -k 'all_heads or short_splits'"
timeout -k 2 38 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_fp8_kv.py \
  backends/cuda/tests/test_kernels.py backends/cuda/tests/test_split_reduce.py -k "all_heads or short_splits" 2>&1 \
  | tee "$OUT/pytest.txt" | tail -n 6
say "N: ncu of the default fp8 layer"
M=dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers
M=$M,launch__occupancy_limit_shared_mem,smsp__inst_executed.sum,l1tex__throughput.avg.pct_of_peak_sustained_active
for s in long_scoreboard short_scoreboard wait mio_throttle math_pipe_throttle barrier not_selected selected lg_throttle; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
timeout -k 2 $(( $(left) - 1 )) "$NCU" --kernel-name decode_heads_kernel --launch-skip 2 --launch-count 1 \
  --metrics "$M" python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 2 --kv-dtypes fp8 --fp8-variants default > "$OUT/ncu-heads.txt" 2>&1
echo "rc=$?"; grep -E "dram__|lts__|gpu__time|warps_active|registers|occupancy|inst_executed|stalled|l1tex" "$OUT/ncu-heads.txt" | cut -c1-150
say done
