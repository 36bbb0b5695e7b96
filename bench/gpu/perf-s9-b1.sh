# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-s9-b1.sh   (<= 170 s: AB ~105, P ~40, G the rest)
# perf (#36) session 9 batch 1, over main + perf: (AB) the 1B public-defaults offline workload in ONE engine, two
# rounds, tokens compared, every step timed on the device (--steps: prompt steps apart from pure decodes): main
# (budget 16,384) against the scheduler's token budget at 32,768 and 65,536 (set on the scheduler at run time) and
# the one-launch greedy argmax at 256 rows (HWKV_CUDA_ARGMAX_ROWS=256; main: 64, larger batches take the sampler's
# chunked torch argmax), then main's batch-256 decode graph taken apart at 544/640/768 keys with its inputs pinned to
# those lengths (graph_timeline after the session-9 fix; replay ms beside it); (P) one layer of the prefill step's attention (32 x 512 causal; 32 decodes + 31 prefills)
# at tile variants, and the batch-256 decode (256 x 640) split in two or more KV splits per program (the full-grid
# tile is unsplit: four waves of one-warp programs); (G) the 1B projections at 256 tokens: cuBLAS against split-K as one strided batched cuBLAS call
# (bmm_split: 2 / 4 K-slices, fp32 or bf16 partials, summed) and the transposed problem (swap).
set -u
source bench/gpu/lib.sh; gpu_env
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,uuid,memory.used --format=csv,noheader
say "AB: backends/cuda/scripts/offline_ab.py --model llama-1b --rounds 2 --steps (main, b32k, b64k, a256)"
HWKV_COMMIT=$(cat COMMIT 2>/dev/null) timeout -k 3 105 python3 backends/cuda/scripts/offline_ab.py \
  --model llama-1b --workdir /dev/shm/hwkv-def --rounds 2 --steps --timeline 256:544,256:640,256:768 --out "$OUT" --variants '[{"name": "main"},
  {"name": "b32k", "sched": {"max_num_batched_tokens": 32768}},
  {"name": "b64k", "sched": {"max_num_batched_tokens": 65536}},
  {"name": "a256", "env": {"HWKV_CUDA_ARGMAX_ROWS": "256"}}]' \
  2>&1 | cut -c1-1500
echo "rc=${PIPESTATUS[0]}"
say "P: backends/cuda/scripts/attn_step_probe.py (prefill 32 x 512, mixed 32 + 31 x 512, decode 256 x 640 split in 2-5)"
HWKV_PROBE_CASES="prefill,mixed 32,decode 256 x 640" \
HWKV_PROBE_PREFILL="num_stages=2;num_stages=4;block_n=128,num_warps=8;num_warps=8;block_m=256,block_q=64,num_warps=8;block_m=64,block_q=16" \
HWKV_PROBE_DECODE="split_below=32,split_target=16,block_n=64,num_warps=1,head_major=1,num_stages=3;split_below=32,split_target=32,block_n=64,num_warps=1,head_major=1,num_stages=3;split_below=32,split_target=16" \
  timeout -k 2 $(( 146 - ($(date +%s) - t0) )) python3 backends/cuda/scripts/attn_step_probe.py "$OUT/attn-prefill-probe.json" 2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
        print(r['case'], '|', r['variant'], '|', r.get('us') and round(r['us'], 1), 'us |', r.get('TFLOPs') and round(r['TFLOPs'], 1), 'TFLOP/s |', r.get('kv_TBps') and round(r['kv_TBps'], 2), 'TB/s | splits', r.get('splits'), '|', r.get('block_m'), r.get('block_q'), r.get('block_n'), r.get('num_warps'), r.get('num_stages'), '| err', r.get('rel_err_vs_default'), r.get('error', ''))
    except Exception:
        print(line.rstrip()[:300])
"
say "G: backends/cuda/scripts/gemm_probe.py --shapes 1b --tokens 256 --sweep - --bmm 2,4 --swap"
timeout -k 2 $(( 167 - ($(date +%s) - t0) )) python3 backends/cuda/scripts/gemm_probe.py --shapes 1b --tokens 256 \
  --sweep - --bmm 2,4 --swap --out "$OUT/gemm-probe.json" 2>&1 | cut -c1-300
say done
