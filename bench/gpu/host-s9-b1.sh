# host (#36 batch-1 step vs replay), session 9, GPU batch 1 (150 s: one engine start of 40-60 s, then four variants
# of recapture + 2x batch-1 measure + 300 timed steps, two of them with a 200-step torch.profiler trace):
# where a batch-1 decode step's time goes beyond its graph replay, and the A/B of the greedy argmax inside the decode
# graphs (graph) vs after the replay with a device-side fill (host: the path before this change), one engine.
source bench/gpu/lib.sh
gpu_env
gpu_header
T0=$(date +%s)
step() { echo "[host] $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s $*"; }
step "python3 bench/gpu/host_step_gaps.py --out \$OUT"
HWKV_PLUGIN_MODULES=hwkv_cuda.plugin timeout -k 3 140 python3 bench/gpu/host_step_gaps.py --out "$OUT"
echo "rc=$?"
step done
