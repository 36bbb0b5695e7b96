#!/bin/bash
# issue 31 e2e A/B: this tree (HEAD, see COMMIT) vs the round's base 6f2a14f (./base), one GPU, alternating.
# Public defaults on both sides: no --engine-args; the base bench's own ENGINE_DEFAULTS (4096/256/8192) are
# cleared so that its engine resolves its public defaults too.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
START=$(date +%s); BUDGET=${BUDGET:-192}
HERE=$PWD; NEWC=$(cat COMMIT)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
ARGS=(--model llama-1b --dtype bfloat16 --workdir /dev/shm/hwkv-ab-models --parts b,r --no-hf --b1-variants '[]'
      --b1-tokens 256 --roofline-requests 256 --roofline-in 512 --roofline-out 128)
runone() {  # tree-label pythonpath-prefix round
  local label=$1 pp=$2 round=$3 left=$(( BUDGET - ($(date +%s) - START) ))
  local t=$(( left < 95 ? left : 95 ))
  if [ $t -lt 60 ]; then echo "[ab] skip $label round $round: ${left}s left"; return; fi
  mkdir -p "$OUT/$label-$round"
  echo "[ab] $(date -u +%T) run $label round $round (timeout ${t}s)"
  ( cd /tmp && PYTHONPATH=$pp${PYTHONPATH:+:$PYTHONPATH} timeout $t python3 -c "
import runpy, sys
# pip's editable install adds a meta-path finder that wins over PYTHONPATH: drop it so the tree on PYTHONPATH is what runs
sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in type(f).__module__]
sys.path_hooks[:] = [h for h in sys.path_hooks if '__editable__' not in getattr(h, '__module__', '')]
sys.path_importer_cache.clear()
import hwkv, hwkv.bench.e2e as e
print('[ab] hwkv from', hwkv.__file__, flush=True)
e.ENGINE_DEFAULTS.clear()
sys.argv = ['hwkv', 'bench', 'e2e'] + sys.argv[1:]
runpy.run_module('hwkv', run_name='__main__')
" "${ARGS[@]}" --out-dir "$OUT/$label-$round" 2>&1 | tail -n 60 ); echo "[ab] rc=$? $label round $round at $(( $(date +%s) - START ))s"
}
NEWPP=$HERE:$HERE/backends/cuda
BASEPP=$HERE/base:$HERE/base/backends/cuda
runone new-$NEWC "$NEWPP" 1
runone base-6f2a14f "$BASEPP" 1
runone new-$NEWC "$NEWPP" 2
runone base-6f2a14f "$BASEPP" 2
echo "[ab] done at $(( $(date +%s) - START ))s"
