# host (#36 batch-1 step vs replay), session 9, GPU batch 2 (150 s; batch 1b took 20 s with a warm compile cache):
# the A/B of the two sets of small decode graphs taking turns (graph2, the default now: inputs on a side stream while
# the previous step runs, read-back on another) vs one set with the argmax inside (graph1) vs the path before (host),
# one engine, each with a 200-step torch.profiler trace; then the public-defaults figures (1B offline 256 x 512/256 -
# it must not regress - and batch 1) in one more engine.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[host] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "python3 bench/gpu/host_step_gaps.py --out \$OUT"
HWKV_PLUGIN_MODULES=hwkv_cuda.plugin timeout -k 3 75 python3 bench/gpu/host_step_gaps.py --out "$OUT"
echo "rc=$?"
step "python3 -m hwkv bench defaults --model llama-1b --b1-tokens 256"
timeout -k 3 65 python3 -m hwkv bench defaults --model llama-1b --b1-tokens 256 --out "$OUT/defaults-llama-1b.json"
echo "rc=$?"
step done
