# Shared steps of the bench/gpu scripts; source it from the repository root.
# gpu_env: the device rules (NVLink multicast off), unbuffered output with faulthandler, this tree first on
#   PYTHONPATH, $OUT made (default /tmp/hwkv-tp-out). gpu_header: the commit, the time, the GPUs and what runs on them.
# ckpt_start MODEL DTYPE GPU [LIMIT_S]: draw the random-weight checkpoint of MODEL into $W (default
#   /dev/shm/hwkv-models) on GPU in the background - an 8B checkpoint takes 25-100 s, so it is written while the
#   script's first step runs on the other GPU; log in $OUT/write.log (ends with "write rc=N").
# ckpt_wait: wait for it, show the log's tail, and remove a half-written checkpoint (config.json is written first,
#   so a checkpoint cut by its limit would look whole to the next step).
W=${W:-/dev/shm/hwkv-models}

ckpt_start() {
  local model=$1 dtype=$2 gpu=$3 limit=${4:-150}
  CKPT_DIR=$W/$model-$dtype
  (CUDA_VISIBLE_DEVICES=$gpu timeout -k 5 "$limit" python3 -c "
import argparse, time; t = time.time()
from hwkv.bench.common import model_dir
print(model_dir(argparse.Namespace(model='$model', dtype='$dtype', workdir='$W')), 'written in', round(time.time() - t, 1), 's')
" > "$OUT/write.log" 2>&1; echo "write rc=$?" >> "$OUT/write.log") &
  CKPT_WRITER=$!
}

ckpt_wait() {
  wait "$CKPT_WRITER"; tail -n 5 "$OUT/write.log"
  grep -q "write rc=0" "$OUT/write.log" || rm -rf "$CKPT_DIR"
}

gpu_env() {
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
  export PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-}
  OUT=${OUT:-/tmp/hwkv-tp-out}; mkdir -p "$OUT"
}

gpu_header() {
  echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"; date -u
  nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv,noheader
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
}
