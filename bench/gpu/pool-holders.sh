#!/bin/bash
# pool (#35) sessions 7-8: the 8B cold restart read from several holders at once. One holder copies ~5.5 GB/s
# into engines' shared memory however many clients call it (session 6); 4 holders gave 13.68 GB/s raw
# (holders_tput.py). Here the pool has HOLDERS holders (hwkv bench pool-restart --holders: each its
# segment name fixed), the engine is given all of them ("holders") and reads each value through the
# holder that has it (MooncakeStore.locate: one master RPC per load). --one-process per dtype (an 8B
# start is ~40 s, ~56 s with graphs): recompute, device-cache hit, load from the pool; A/B in the same process:
# rP = routed (one call per holder client whatever P); hKpP = another prompt whose chunks all went to the first
# K holders (the K-holder baseline, same engine and run); P / cK = not routed (one client / K clients in contiguous
# shares, values of other holders over their tcp transport). Suffixes: o = one landing launch per KV tensor
# (HWKV_CUDA_COPY_LAUNCH=tensor), k = every block through copy_blocks (HWKV_POOL_LAND_MEMCPY=0), s = GIL switch
# interval 0.2 ms, #N = a repeat under its own name. Knobs: LIMIT s (default 120); DTYPES (default "fp8 bf16"),
# first first; HOLDERS, PAR, CLIENTS, AB, CAP_MB, STAGING_MB, HOLDER_THREADS, PROC_S; RAW (0: no raw
# holders_tput.py at the end); MIN_RUN_S (skip a dtype with less left, default 40); GRAPHS (1: graphs on,
# max_num_seqs MAX_SEQS; FUSE=0: without fuse_elementwise).
set -u
source bench/gpu/lib.sh
gpu_env
OUT=${OUT:-/tmp/hwkv-pool-holders}; mkdir -p "$OUT"
export HWKV_COMMIT=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)
T0=$(date +%s)
left() { echo $(( ${LIMIT:-120} - ($(date +%s) - T0) - $1 )); }
gpu_header
echo "$(nproc) host cores; HOLDERS=${HOLDERS:-4} DTYPES=${DTYPES:-fp8 bf16}"
W=/dev/shm/hwkv-pool-models
timeout -k 5 "$(left 5)" python3 -c "
import argparse, time; t = time.time()
from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='llama-8b', dtype='bfloat16', workdir='$W')), 'written in', round(time.time() - t, 1), 's')
" 2>&1 | tail -n 3; echo "write rc=${PIPESTATUS[0]} ($(date -u +%T))"
R=(python3 -m hwkv bench pool-restart --backend cuda --repeats 1 --capacity-mb "${CAP_MB:-3072}" --via holder --one-process
   --holders "${HOLDERS:-4}" --workdir "$W" --model llama-8b --prompt-len 7905 --suffix-len 32 --chunk-size 256
   --staging-mb "${STAGING_MB:-1024}" --timeout "${PROC_S:-90}" --holder-threads "${HOLDER_THREADS:-8}"
   --pool-config "{\"load_parallel\": ${PAR:-2}, \"load_clients\": ${CLIENTS:-1}}" --ab-parallel "${AB:-r1,r4,h1p1,h1p4,c4}")
for d in ${DTYPES:-fp8 bf16}; do
  if [[ $(left 0) -lt ${MIN_RUN_S:-40} ]]; then echo "== skip $d: $(left 0) s left"; continue; fi
  echo "== llama-8b $d KV, 7,937-token prompt, 256-token chunks, ${HOLDERS:-4} holders, GRAPHS=${GRAPHS:-0} ($(left 0) s left, $(date -u +%T))"
  # GRAPHS=1: the engine's default graphs (a restarted instance's tail - one token after 7,936 loaded - runs as a
  # captured short-query step instead of an eager forward), max_num_seqs MAX_SEQS (fewer buckets to capture)
  ea='"enforce_eager": true'; [[ ${GRAPHS:-0} == 1 ]] && ea="\"max_num_seqs\": ${MAX_SEQS:-8}"
  [[ ${GRAPHS:-0} == 1 && ${FUSE:-1} == 0 ]] && ea="$ea, \"fuse_elementwise\": false"  # no torch.compile at start
  [[ $d == fp8 ]] && ea="$ea, \"kv_cache_dtype\": \"fp8\""; ea="{$ea}"
  mkdir -p "$OUT/8b-$d"
  timeout "$(left 1)" "${R[@]}" --engine-args "$ea" --out-dir "$OUT/8b-$d" 2>&1 | tee "$OUT/8b-$d.log" \
    | grep -v "^[IW][0-9]" | tail -n 12
  echo "8b-$d rc=${PIPESTATUS[0]} ($(date -u +%T))"
done
if [[ ${RAW:-1} == 1 && $(left 0) -ge 12 ]]; then
  echo "== raw: holders_tput.py, HOLDERS_RAW=${HOLDERS_RAW:-4,8} ($(left 0) s left)"
  HOLDERS=${HOLDERS_RAW:-4,8} timeout "$(left 1)" python3 bench/gpu/holders_tput.py 32 16777216 32 2>&1 \
    | tee "$OUT/holders_tput.log" | grep -v "^[IW][0-9]" | tail -n 6
fi
echo "done ($(date -u +%T))"
