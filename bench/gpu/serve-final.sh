# serve (#37), batch 3: one H200 (cuda:0), <= LIMIT s (default 118). Results are written as they finish.
# 1. hwkv bench structured on the Llama-3.2-1B shape (random weights, synthetic 128,256-token tokenizer), batch 64,
#    128 + 128: free vs records (main's defaults: own matchers, 8 mask threads, rows in place, the sampler's bitmask
#    by shifts), records+t16 and records+gil (a 0.2 ms GIL switch interval while constrained requests run);
#    not measured since 80e5a4c (-78% then).
# 2. the sampler's bitmask apply on the device: shifts (main's default off the CPU) vs the byte table, vs an argmax.
# 3. the SmolLM2-135M shape: free vs records and records+gil, 2 rounds, if time is left.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-118}
t0=$(date +%s); say() { echo "[serve] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null); $(python3 -c 'import hwkv, llguidance, os; print(hwkv.__file__, llguidance.__version__, len(os.sched_getaffinity(0)), "cores")' 2>&1 | tail -n 2)"
nvidia-smi -L 2>&1 | head -n 2
W=/dev/shm/hwkv-serve-models
say "1 (limit $(( $(left) - 8 ))s): python3 -m hwkv bench structured --model llama-1b --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records,records+t16,records+gil --gil-switch-ms 0.2 --repeat 1"
timeout -k 2 $(( $(left) - 8 )) python3 -m hwkv bench structured --model llama-1b --backend cuda --batch 64 \
  --input-len 128 --output-len 128 --schemas records,records+t16,records+gil --gil-switch-ms 0.2 --repeat 1 --workdir $W \
  --out-dir "$OUT" 2>&1 | tail -n 20
say "1 rc=${PIPESTATUS[0]}"
say "2: apply_token_bitmask on the device (shifts vs table)"
timeout -k 2 $(( $(left) > 12 ? 12 : $(left) )) python3 - <<'PY' 2>&1 | tail -n 8
import json, os, torch
from hwkv.model.sampler import _apply_bitmask_by_bits, _apply_bitmask_by_table
dev = torch.device("cuda:0"); res = {}
for V in (49152, 128256):
    x = torch.randn(64, V, device=dev); m = torch.randint(-2**31, 2**31 - 1, (64, (V + 31) // 32), dtype=torch.int32, device=dev)
    assert torch.equal(_apply_bitmask_by_bits(x, m), _apply_bitmask_by_table(x, m))
    for name, f in (("shifts", lambda: _apply_bitmask_by_bits(x, m)), ("table", lambda: _apply_bitmask_by_table(x, m)),
                    ("argmax", lambda: x.argmax(-1))):
        for _ in range(20): f()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record()
        for _ in range(200): f()
        b.record(); torch.cuda.synchronize()
        res[f"{name} [64, {V}]"] = round(a.elapsed_time(b) / 200 * 1e3, 2)
print("device us per call (shifts and table give equal logits):", res)
json.dump({"device": torch.cuda.get_device_name(0), "us_per_call": res}, open(os.environ["OUT"] + "/bitmask-apply-us.json", "w"), indent=1)
PY
if [ "$(left)" -gt 45 ]; then
  say "3 (limit $(left)s): python3 -m hwkv bench structured --model smollm2-135m --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records,records+gil --gil-switch-ms 0.2 --repeat 2"
  timeout -k 2 $(left) python3 -m hwkv bench structured --model smollm2-135m --backend cuda --batch 64 --input-len 128 \
    --output-len 128 --schemas records,records+gil --gil-switch-ms 0.2 --repeat 2 --workdir $W --out-dir "$OUT" 2>&1 | tail -n 12
  say "3 rc=${PIPESTATUS[0]}"
fi
say done
