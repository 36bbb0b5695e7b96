# serve (#37): structured-output cost at batch 64 on one H200 (cuda:0), <= 120 s. Results are written as they finish.
# 1. hwkv bench structured --mask-only on the GPU host: llguidance alone, matchers of their own (the engine's since
#    9d28d74) vs deep copies of one (sharing its lexer lock), 1 thread and the executor on 4/8/16/default threads.
# 2. hwkv bench structured, SmolLM2-135M's shape (random weights, synthetic 49k tokenizer), batch 64, 128 + 128:
#    free vs records (own matchers, 8 threads) and its A/Bs: +shared (copies), +t4, +t16, +gil (0.1 ms), +inline.
# 3. the sampler's bitmask apply on the device (apply_token_bitmask, 64 rows, 49k and 128k vocab) vs an argmax.
# 4. --mask-only on the 1B shape's 128k vocabulary (4/8/16 threads), then the 1B shape's engine run if time is left.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-118}
t0=$(date +%s); say() { echo "[serve] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null); $(python3 -c 'import hwkv, llguidance, os; print(hwkv.__file__, llguidance.__version__, len(os.sched_getaffinity(0)), "cores")' 2>&1 | tail -n 2)"
nvidia-smi -L 2>&1 | head -n 2
W=/dev/shm/hwkv-serve-models
say "1: python3 -m hwkv bench structured --mask-only 64 --model smollm2-135m --batch 64 --schemas records --thread-counts 4,8,16,0"
timeout -k 2 20 python3 -m hwkv bench structured --mask-only 64 --model smollm2-135m --batch 64 --schemas records \
  --thread-counts 4,8,16,0 --out-dir "$OUT" 2>&1 | tail -n 30
say "1 rc=${PIPESTATUS[0]}"
say "2 (limit $(( $(left) - 12 ))s): python3 -m hwkv bench structured --model smollm2-135m --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records,records+shared,records+t4,records+t16,records+gil,records+inline --gil-switch-ms 0.1 --repeat 1"
timeout -k 2 $(( $(left) - 12 )) python3 -m hwkv bench structured --model smollm2-135m --backend cuda --batch 64 \
  --input-len 128 --output-len 128 --schemas records,records+shared,records+t4,records+t16,records+gil,records+inline \
  --gil-switch-ms 0.1 --repeat 1 --workdir $W --out-dir "$OUT" 2>&1 | tail -n 30
say "2 rc=${PIPESTATUS[0]}"
say "3: apply_token_bitmask on the device"
timeout -k 2 $(( $(left) > 15 ? 15 : $(left) )) python3 - <<'PY' 2>&1 | tail -n 8
import json, os, torch
from hwkv.model.sampler import apply_token_bitmask
dev = torch.device("cuda:0"); res = {}
for V in (49152, 128256):
    x = torch.randn(64, V, device=dev); m = torch.randint(-2**31, 2**31 - 1, (64, (V + 31) // 32), dtype=torch.int32, device=dev)
    for name, f in (("apply_token_bitmask", lambda: apply_token_bitmask(x, m)), ("argmax", lambda: x.argmax(-1)),
                    ("apply+argmax", lambda: apply_token_bitmask(x, m).argmax(-1))):
        for _ in range(20): f()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record()
        for _ in range(200): f()
        b.record(); torch.cuda.synchronize()
        res[f"{name} [64, {V}]"] = round(a.elapsed_time(b) / 200 * 1e3, 2)
print("device us per call:", res)
json.dump({"device": torch.cuda.get_device_name(0), "us_per_call": res}, open(os.environ["OUT"] + "/bitmask-apply-us.json", "w"), indent=1)
PY
if [ "$(left)" -gt 12 ]; then
  say "4: python3 -m hwkv bench structured --mask-only 48 --model llama-1b --batch 64 --schemas records --thread-counts 4,8,16"
  timeout -k 2 $(left) python3 -m hwkv bench structured --mask-only 48 --model llama-1b --batch 64 --schemas records \
    --thread-counts 4,8,16 --out-dir "$OUT" 2>&1 | grep -v "per row" | tail -n 12
  say "4 rc=${PIPESTATUS[0]}"
fi
say done
