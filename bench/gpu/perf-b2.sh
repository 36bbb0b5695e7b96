# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/perf-b2.sh   (<= 200 s: A 48, T 18, L 22, E 66, D 40 at most)
# perf (#36) batch 2, over main: (A) the attention of the offline workload's steps, default tiles vs variants
# (mixed steps: the 64/32/16-row tiles; decodes 256 x 640/544: stages, keys, warps; batch 1: splits);
# (L) the LM head's logits path (bf16 + float cast vs cuBLAS float32 out, argmax on bf16); (E) the public defaults at main;
# (D) 1B one-token GEMV tiles of gate_up and down (the rule vs the sweep).
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
t0=$(date +%s); say() { echo "[perf] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
say "commit $(cat COMMIT 2>/dev/null); $(python3 -c 'import hwkv, hwkv_cuda; print(hwkv.__file__, hwkv_cuda.__file__)')"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
say "A: backends/cuda/scripts/attn_step_probe.py (decodes and the mixed steps; call 1 has the prefill rows)"
HWKV_PROBE_CASES="decode,mixed 224,mixed 128" timeout -k 2 48 python3 backends/cuda/scripts/attn_step_probe.py "$OUT/attn-step-probe.json" cuda \
  2>&1 | python3 -c "
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line); print(r['case'][:44], '|', r['variant'], '|', round(r.get('us', -1), 1), '|', r.get('block_m'), r.get('block_q'), r.get('block_n'), r.get('num_warps'), r.get('num_stages'), r.get('splits'), '| err', r.get('rel_err_vs_default', r.get('error')))
    except Exception:
        print(line.rstrip()[:300])
"
echo "rc=$?"
say "T: the float32-out LM head on the GPU (backends/cuda/tests/test_elementwise.py -k logits)"
timeout -k 2 18 python3 -m pytest -q -x -p no:cacheprovider backends/cuda/tests/test_elementwise.py -k logits 2>&1 | tail -n 3
say "L: backends/cuda/scripts/logits_probe.py"
timeout -k 2 22 python3 backends/cuda/scripts/logits_probe.py "$OUT/logits-probe.json" 2>&1 | cut -c1-300
echo "rc=$?"
say "E: python3 -m hwkv bench defaults --model llama-1b --b1-tokens 256 (main)"
timeout -k 2 66 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --b1-tokens 256 \
  --out "$OUT/defaults-llama-1b.json" 2>&1 | grep -E "^\[defaults\]|Error|Traceback" | cut -c1-300
echo "rc=$?"
say "D: backends/cuda/scripts/dense_probe.py --model llama-1b --quick --shapes gate_up,down --pick"
timeout -k 2 40 python3 backends/cuda/scripts/dense_probe.py --model llama-1b --quick --shapes gate_up,down \
  --out "$OUT" --pick "$OUT/dense-picks.env" 2>&1 | grep -v "^\s*$" | cut -c1-300
echo "rc=$?"; cat "$OUT/dense-picks.env" 2>/dev/null
say done
