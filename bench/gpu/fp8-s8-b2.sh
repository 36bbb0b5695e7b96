# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/fp8-s8-b2.sh   (<= 120 s: A 55, C 40, B rest)
# (Ran at main cbca144. The FMA kernel it sweeps, fma=1/2/3, was removed in 9dcc153 after this run: at a later commit
# those rows report an error; check out cbca144 to repeat it.)
# fp8 (#36 FP8 KV decode) session 8 batch 2, over main. (A) the e2e A/B, all rows of the issue in one run:
# `hwkv bench kv-dtype --model llama-1b ... --moved-bytes --profile` (its decode step is now the forward the public
# defaults' graphs replay: fuse_elementwise on). (B) the same step as last session's bench ran it
# (fuse_elementwise off), to split the ratio's change into its parts. (C) one layer: the FMA decode kernel (fma=1,
# kernels/decode_fma.py) at a few tiles, and fp8 tile neighbours not swept before.
# (D) Nsight Compute on one bf16 and one fp8 attention launch, where ncu exists (what bounds the fp8 read).
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( 117 - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "A: hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 --decode-context 32768 --moved-bytes --profile"
timeout -k 3 55 python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --moved-bytes --profile --workdir /dev/shm/hwkv-fp8 --out "$OUT/kv-dtype-main.json" 2>&1 | cut -c1-2500
echo "rc=${PIPESTATUS[0]}"
say "C: one layer, the FMA decode kernel (fma=1) and fp8 tile neighbours"
timeout -k 2 $(( $(left) > 70 ? 40 : $(left) )) python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 \
  --heads 32/8 --head-size 64 --replays 20 --variants "default;fma=1,block_n=32,num_warps=4,num_stages=3" \
  --fp8-variants "default;fma=1,block_n=32,num_warps=4;fma=2,block_n=32,num_warps=4;fma=3,block_n=32,num_warps=4;fma=1,block_n=64,num_warps=4;fma=2,block_n=64,num_warps=4;fma=1,block_n=16,num_warps=1;fma=2,block_n=32,num_warps=2;fma=1,block_n=64,num_warps=8,split_target=8;num_stages=4" \
  --out "$OUT/kv-decode-neighbours.json" 2>&1 | cut -c1-420
echo "rc=${PIPESTATUS[0]}"
say "B: the same decode step without fuse_elementwise (last session's bench)"
timeout -k 3 $(( $(left) > 45 ? 25 : $(left) - 20 )) python3 -m hwkv bench kv-dtype --model llama-1b --backend cuda --decode-batch 32 \
  --decode-context 32768 --agree-prompts 1 --agree-tokens 4 --engine-args '{"fuse_elementwise": false}' \
  --workdir /dev/shm/hwkv-fp8 --out "$OUT/kv-dtype-nofuse.json" 2>&1 | grep -v "^    " | cut -c1-600
echo "rc=${PIPESTATUS[0]}"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [[ -n $NCU && $(left) -gt 12 ]]; then
  for kd in fp8 bf16; do
    [[ $(left) -gt 8 ]] || break
    say "D: $NCU on one $kd attention launch"
    timeout -k 2 $(( $(left) / 2 + 2 )) "$NCU" --kernel-name attention_kernel --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section InstructionStats --section SchedulerStats \
      python3 -m hwkv_cuda.bench.kv_dtype_decode --batch 32 --context 32768 --heads 32/8 --head-size 64 --replays 2 \
      --kv-dtypes "$kd" > "$OUT/ncu-$kd.txt" 2>&1
    echo "rc=$?"; grep -E "Duration|Throughput|Achieved Occupancy|Registers Per|Shared Memory Config|Stall|Warp Cycles|Issued Ipc|Block Limit|Theoretical Occ|Executed Ipc|Eligible" "$OUT/ncu-$kd.txt" | head -n 40
  done
else
  say "D: no ncu on the device ($(left) s left)"
fi
say done
