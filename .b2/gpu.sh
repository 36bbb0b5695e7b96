# b1 (#36 batch-1 decode) batch 2 on one H200: the batch-1 decode A/B at the public defaults in ONE engine
# (backends/cuda/scripts/b1_decode_ab.py: per variant the batch-1 graphs captured again, hwkv bench e2e's batch-1
# measure twice, greedy tokens against the first variant); a step trace + replay timeline + host phases of the
# first and the last variant; then the conformance decode-op sections on the GPU.
set -u
source bench/gpu/lib.sh
gpu_env
gpu_header
t0=$(date +%s); say() { echo "[b1] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
V=$(cat .gpu/b1/variants.json)
say "b1_decode_ab.py --variants $V"
timeout -k 2 92 python3 backends/cuda/scripts/b1_decode_ab.py --out "$OUT" --tokens 256 --repeat 2 \
  --variants "$V" --trace "$(python3 -c "import json,sys; v=json.load(open('.gpu/b1/variants.json')); print(v[0]['name']+','+v[-1]['name'])")" 2>&1 | cut -c1-900
echo "rc=${PIPESTATUS[0]}"
say "hwkv conformance --backend cuda -k 'test_decode_ops and (norm_logits or linear)'"
timeout -k 2 14 python3 -m hwkv conformance --backend cuda -k "test_decode_ops and (norm_logits or linear)" 2>&1 | tail -n 8
echo "rc=${PIPESTATUS[0]}"
say done
