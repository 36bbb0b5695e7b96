# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s8-b1.sh   (<= 120 s: P 40, AB the rest)
# perf (#36) session 8 batch 1, over main: (P) one layer of the offline workload's batch-256 decode attention
# (1B shape, 256 x 544/640/768 keys, shuffled block tables) at the default tile and decode-tile variants: us and
# K/V bytes read per second against the copy bandwidth; (AB) the 1B public-defaults offline workload in ONE engine
# with the split-K linear (HWKV_CUDA_GEMM=1: last session's A/B of it ran before offline_ab cleared the prefix
# cache, so it never ran clean) and decode-only tile variants (HWKV_CUDA_ATTN_CONFIG_DECODE), decode graphs
# recaptured per variant, tokens compared.
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "P: backends/cuda/scripts/attn_step_probe.py (decode 256 x 544/640/768)"
HWKV_PROBE_CASES="decode 256" \
HWKV_PROBE_DECODE="prefetch=1,block_n=64,num_warps=2;prefetch=1;num_stages=5,block_n=64,num_warps=2,head_major=1;prefetch=1,num_warps=2;num_stages=5,block_n=64,num_warps=2;head_major=1;num_warps=1,block_n=64;prefetch=1,block_n=32,num_warps=1;num_stages=4,block_n=32,num_warps=2" \
  timeout -k 2 40 python3 backends/cuda/scripts/attn_step_probe.py "$OUT/attn-decode-probe.json" 2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
        print(r['case'], '|', r['variant'], '|', r.get('us') and round(r['us'], 1), 'us |', r.get('kv_TBps') and round(r['kv_TBps'], 2), 'TB/s |', r.get('block_n'), r.get('num_warps'), r.get('num_stages'), 'hm', r.get('head_major'), 'pf', r.get('prefetch'), '| err', r.get('rel_err_vs_default'), r.get('error', ''))
    except Exception:
        print(line.rstrip()[:300])
"
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 2 (base, split-K linear, decode tiles pf64w2, s5hm)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 $(( 116 - ($(date +%s) - t0) )) python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 2 --gaps --out "$OUT" --variants '[{"name": "base"}, {"name": "gemm", "env": {"HWKV_CUDA_GEMM": "1"}},
  {"name": "pf64w2", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "prefetch=1,block_n=64,num_warps=2"}},
  {"name": "s5hm", "env": {"HWKV_CUDA_ATTN_CONFIG_DECODE": "num_stages=5,block_n=64,num_warps=2,head_major=1"}}]' \
  2>&1 | cut -c1-400
echo "rc=${PIPESTATUS[0]}"
say done
