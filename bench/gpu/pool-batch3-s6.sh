#!/bin/bash
# pool (#35) session 6 batch 3, one GPU, LIMIT s (default 118). 1. routing, 4 instances of the 1B shape on
# this GPU, servers with --long-prefill-token-threshold 2048 --short-prefills-first (routing-x4-sp.sh);
# 2. time left: the host's single-thread memcpy, then bench/gpu/holders_tput.py (1 and 4 holders, each
# value read through the holder that has it): does a second holder add get bandwidth where one
# holder's copies do not run side by side (batch 2: 5.2-5.8 GB/s whatever the callers and clients)?
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 OMP_NUM_THREADS=4
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
OUT=${OUT:-/tmp/hwkv-pool-b3}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${LIMIT:-118} - ($(date +%s) - T0) - $1 )); }
echo "commit $(cat COMMIT 2>/dev/null); $(date -u +%T); $(nproc) cores"
LIMIT=$(left 18) OUT="$OUT/routing" bash bench/gpu/routing-x4-sp.sh
if [[ $(left 0) -ge 8 ]]; then
  echo "== memcpy, one thread ($(left 0) s left)"
  timeout 6 python3 -c "
import ctypes, time
n = 1 << 30; a = ctypes.create_string_buffer(n); b = ctypes.create_string_buffer(n)
ctypes.memmove(b, a, n); t = time.perf_counter(); ctypes.memmove(b, a, n); dt = time.perf_counter() - t
print(f'memmove 1 GiB, one thread: {n / dt / 1e9:.2f} GB/s')" 2>&1 | tee "$OUT/memcpy.log"
fi
if [[ $(left 0) -ge 8 ]]; then
  echo "== holders ($(left 0) s left)"
  HOLDERS=${HOLDERS:-1,4} timeout "$(left 1)" python3 bench/gpu/holders_tput.py 32 16777216 32 2>&1 | grep -v "^[IWE][0-9]" \
    | tee "$OUT/holders_tput.log" | tail -n 4
fi
echo "done ($(date -u +%T))"
