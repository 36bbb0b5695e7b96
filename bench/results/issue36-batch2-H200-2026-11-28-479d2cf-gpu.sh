# fp8 (#36) batch 2 (one GPU), over main: the hand-written elementwise kernels (HWKV_CUDA_ELEMENTWISE=1) against
# torch.compile's, through the public defaults (no engine argument), same run; where the decode step goes.
# T: the kernels' tests compiled (bf16 rounding on the GPU); B1: defaults --profile with the kernels on;
# B0: defaults with torch.compile's kernels (main's default); A: 1B decode GEMV tile sweep (optional, last).
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[fp8] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
say "T pytest backends/cuda/tests/test_elementwise.py"
timeout -k 2 14 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_elementwise.py 2>&1 | tail -n 12 | tee "$OUT/pytest-elementwise.txt"
say "B1 HWKV_CUDA_ELEMENTWISE=1 hwkv bench defaults --model llama-1b --profile --b1-tokens 128"
HWKV_CUDA_ELEMENTWISE=1 timeout -k 2 68 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def \
  --b1-tokens 128 --profile --out "$OUT/defaults-llama-1b-elementwise-profile.json" > "$OUT/defaults-elementwise.log" 2>&1
echo "rc=$?"; grep "^\[defaults\]" "$OUT/defaults-elementwise.log" | cut -c1-1500; grep -m5 -i "error\|Traceback" "$OUT/defaults-elementwise.log"
say "B0 hwkv bench defaults --model llama-1b --b1-tokens 0 (torch.compile's kernels, main's default)"
timeout -k 2 58 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 0 \
  --out "$OUT/defaults-llama-1b-compiled.json" > "$OUT/defaults-compiled.log" 2>&1
echo "rc=$?"; grep "^\[defaults\]" "$OUT/defaults-compiled.log"; grep -m5 -i "error\|Traceback" "$OUT/defaults-compiled.log"
say "A dense_probe.py --model llama-1b --quick --pick (optional)"
timeout -k 2 40 python3 backends/cuda/scripts/dense_probe.py --model llama-1b --quick --out "$OUT" \
  --pick "$OUT/dense-picks.sh" > "$OUT/dense.log" 2>&1
echo "rc=$?"; grep -E "picked|default_us|Error" "$OUT/dense.log" | cut -c1-200
say done
