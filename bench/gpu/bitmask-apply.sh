#!/bin/bash
# usage (one GPU, repository root): OUT=<dir> bash bench/gpu/bitmask-apply.sh   (~10 s)
# #37: main's apply_token_bitmask (bytes, eight shifts) vs the int32 32-shift form the H200 runs measured, vs an argmax
export PYTHONPATH=$PWD:${PYTHONPATH:-}; echo "commit $(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)"
timeout -k 2 25 python3 - <<'PY'
import json, os, torch
from hwkv.model.sampler import apply_token_bitmask
dev = torch.device("cuda:0"); res = {}; s32 = torch.arange(32, dtype=torch.int32, device=dev)
def int32_shifts(x, m):
    return torch.where(((m.unsqueeze(-1) >> s32) & 1).view(m.shape[0], -1)[:, : x.shape[1]].bool(), x, float("-inf"))
for V in (49152, 128256):
    x = torch.randn(64, V, device=dev); m = torch.randint(-2**31, 2**31 - 1, (64, (V + 31) // 32), dtype=torch.int32, device=dev)
    assert torch.equal(apply_token_bitmask(x, m), int32_shifts(x, m))
    for name, f in (("bytes (main)", lambda: apply_token_bitmask(x, m)), ("int32 shifts (before)", lambda: int32_shifts(x, m)),
                    ("argmax", lambda: x.argmax(-1))):
        for _ in range(20): f()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record()
        for _ in range(200): f()
        b.record(); torch.cuda.synchronize()
        res[f"{name} [64, {V}]"] = round(a.elapsed_time(b) / 200 * 1e3, 2)
print("device us per call (equal logits):", res)
json.dump({"device": torch.cuda.get_device_name(0), "us_per_call": res}, open(os.environ["OUT"] + "/bitmask-apply-us.json", "w"), indent=1)
PY
echo "rc=$?"
