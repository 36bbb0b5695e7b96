#!/bin/bash
# issue 31 e2e A/B in one device call: this tree (HEAD, see COMMIT) vs the round's base 6f2a14f (./base,
# a `git archive 6f2a14f` copy), one GPU (cuda:0), one fresh process per run, new then base.
# Public defaults on both sides: no --engine-args; the base bench's own ENGINE_DEFAULTS are cleared so
# that its engine resolves its public defaults too. pip's editable finder is dropped so that the tree
# on PYTHONPATH is what runs ("hwkv from" in the log proves it).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
START=$(date +%s); BUDGET=${BUDGET:-125}
HERE=$PWD; NEWC=$(cat COMMIT)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/nvidia-smi.txt"
ARGS=(--model llama-1b --dtype bfloat16 --workdir /dev/shm/hwkv-ab-models --parts b,r --no-hf --b1-variants '[]'
      --b1-tokens 256 --roofline-requests 256 --roofline-in 512 --roofline-out 128)
runone() {  # label pythonpath
  local label=$1 pp=$2 left=$(( BUDGET - ($(date +%s) - START) ))
  local t=$(( left < 75 ? left : 75 ))
  if [ $t -lt 45 ]; then echo "[ab] skip $label: ${left}s left"; return; fi
  mkdir -p "$OUT/$label"
  echo "[ab] $(date -u +%T) run $label (timeout ${t}s)"
  ( cd /tmp && PYTHONPATH=$pp${PYTHONPATH:+:$PYTHONPATH} timeout $t python3 -c "
import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in type(f).__module__]
sys.path_hooks[:] = [h for h in sys.path_hooks if '__editable__' not in getattr(h, '__module__', '')]
sys.path_importer_cache.clear()
import hwkv, hwkv.bench.e2e as e
print('[ab] hwkv from', hwkv.__file__, flush=True)
getattr(e, 'ENGINE_DEFAULTS', {}).clear()
sys.argv = ['hwkv', 'bench', 'e2e'] + sys.argv[1:]
runpy.run_module('hwkv', run_name='__main__')
" "${ARGS[@]}" --out-dir "$OUT/$label" 2>&1 | tail -n 40 ); echo "[ab] rc=$? $label at $(( $(date +%s) - START ))s"
}
runone new-$NEWC "$HERE:$HERE/backends/cuda"
runone base-6f2a14f "$HERE/base:$HERE/base/backends/cuda"
echo "[ab] done at $(( $(date +%s) - START ))s"
