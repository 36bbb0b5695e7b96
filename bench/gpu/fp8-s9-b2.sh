# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s9-b2.sh   (<= 145 s: A 75, B rest)
# fp8 (#36 FP8 KV decode) session 9 batch 2. Batch 1 (same run): V pages transposed (fp8_unpack=8, over a
# transposed copy of the cache) took L1/shared from 80% to 34% busy, but the layer did not get faster (411 vs 412 us
# at best, one warp); Nsight Compute then showed a latency-bound tile: 0.57 eligible warps per scheduler, 12.5%
# occupancy (246 registers, 8 one-warp programs per SM), DRAM 47%, 2.18 waves of programs (a partial last wave).
# (A) one attention layer, 32 x 32k, 1B shape, both V layouts in one run: split counts that fill whole waves
# (split_target 5 / 7 / 10 / 12 / 15 -> 3 / 4 / 6 / 7 / 8 splits of the 256 (request, KV head) pairs), one and two
# warps, stages, a register cap; bf16 beside. (B) Nsight Compute stall reasons of the default tile and of the best
# transposed-V tile.
set -u
source bench/gpu/lib.sh; gpu_env; gpu_header
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 142 - ($(date +%s) - t0) )); }
say "A: one layer, split counts / warps / stages, token-major and transposed V"
V="default;split_target=10;split_target=5;split_target=12;num_warps=1,split_target=7;num_warps=1,split_target=15"
V="$V;fp8_unpack=8,num_warps=1;fp8_unpack=8,num_warps=1,split_target=7;fp8_unpack=8,num_warps=1,split_target=15"
V="$V;fp8_unpack=8,num_warps=1,num_stages=3;fp8_unpack=8,num_warps=1,num_stages=4;fp8_unpack=8,num_warps=1,maxnreg=168"
V="$V;fp8_unpack=8,split_target=10;fp8_unpack=8,num_stages=3,split_target=10;fp8_unpack=8,split_target=5"
V="$V;fp8_unpack=8,num_warps=1,block_n=32,split_target=15;fp8_unpack=8,num_warps=1,block_n=128,split_target=7;default"
timeout -k 2 75 python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 \
  --replays 20 --variants "default" --fp8-variants "$V" --out "$OUT/kv-decode-waves.json" 2>&1 | cut -c1-330
echo "rc=${PIPESTATUS[0]}"
BEST=$(python3 - "$OUT/kv-decode-waves.json" <<'PY'
import json, sys
try:
    rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kv"] == "fp8" and r["fp8_unpack"] == 8
            and r["rel_err_vs_same_cache"] < 1e-2]
    print(min(rows, key=lambda r: r["us"])["variant"])
except Exception:
    print("fp8_unpack=8,num_warps=1")
PY
)
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
M=smsp__average_warps_issue_stalled
MET="${M}_long_scoreboard_per_issue_active.ratio,${M}_short_scoreboard_per_issue_active.ratio"
MET="$MET,${M}_barrier_per_issue_active.ratio,${M}_mio_throttle_per_issue_active.ratio"
MET="$MET,${M}_lg_throttle_per_issue_active.ratio,${M}_wait_per_issue_active.ratio"
MET="$MET,${M}_math_pipe_throttle_per_issue_active.ratio,${M}_not_selected_per_issue_active.ratio"
MET="$MET,${M}_selected_per_issue_active.ratio,${M}_no_instruction_per_issue_active.ratio"
MET="$MET,${M}_dispatch_stall_per_issue_active.ratio,${M}_branch_resolving_per_issue_active.ratio"
MET="$MET,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed"
MET="$MET,l1tex__throughput.avg.pct_of_peak_sustained_active,gpu__time_duration.sum,launch__registers_per_thread"
MET="$MET,smsp__inst_executed.sum,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem"
for v in default "$BEST"; do
  [[ -n $NCU && $(left) -gt 14 ]] || break
  say "B: $NCU stall reasons, fp8 variant '$v'"
  timeout -k 2 $(( $(left) > 30 ? 28 : $(left) - 2 )) "$NCU" --kernel-name attention_kernel --launch-skip 2 \
    --launch-count 1 --metrics "$MET" python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 \
    --heads 32/8 --head-size 64 --replays 2 --kv-dtypes fp8 --fp8-variants "$v" > "$OUT/ncu-stalls-${v//[,=]/_}.txt" 2>&1
  echo "rc=$?"; grep -E "stalled|warps_active|throughput|duration|registers|inst_executed|occupancy" \
    "$OUT/ncu-stalls-${v//[,=]/_}.txt" | sed 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
done
say done
