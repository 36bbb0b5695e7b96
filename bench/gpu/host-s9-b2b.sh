# host (#36 batch-1 step vs replay), session 9, GPU batch 2b (100 s, one engine, no profiler): a clean interleaved A/B
# of the two graph sets (graph2, the default on main) vs the path before (host), then whether a large offline pass
# slows the following batch-1 steps (batch 2: every variant measured right after an offline pass or a profiler trace
# was 3-10% slower until gc.collect + gc.freeze) - graph2 after the offline pass, after gc.collect(), after
# gc.freeze() - with the host's own work per step and Python's collections counted in each; then the GPU check that
# graphs + async scheduling (now with two sets of small graphs on real streams) give the eager engine's greedy tokens
# over 11 requests that join and leave (tests/engine/test_cuda_graphs.py, plain elementwise ops, fp32 and bf16).
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[host] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
V=graph2,host,graph2,host,offline,graph2,collect,graph2,freeze,graph2
step "python3 bench/gpu/host_step_gaps.py --variants $V --trace none --offline none --out \$OUT"
HWKV_PLUGIN_MODULES=hwkv_cuda.plugin timeout -k 3 62 python3 bench/gpu/host_step_gaps.py --variants "$V" \
  --trace none --offline none --out "$OUT"
echo "rc=$?"
step "pytest tests/engine/test_cuda_graphs.py -k 'greedy_identical_to_eager and plain'"
timeout -k 3 28 python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graphs.py \
  -k "greedy_identical_to_eager and plain" 2>&1 | tail -5
echo "rc=${PIPESTATUS[0]}"
step done
