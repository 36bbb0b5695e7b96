# serve (#37), an extra slot if the budget allows: one H200 (cuda:0), <= LIMIT s (default 98).
# The structured-output cost with UNSEEDED requests (one shared draw per step instead of two launches per request,
# so the mask's worker has less host work beside it than in serve-final.sh's seeded runs), batch 64, 128 + 128:
# 1. the SmolLM2-135M shape (random weights, synthetic 49k tokenizer): free vs records, 2 rounds;
# 2. the Llama-3.2-1B shape (synthetic 128k tokenizer): free vs records, 1 round, if time is left.
set -u
export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-98}
t0=$(date +%s); say() { echo "[serve] $(date -u +%T) +$(( $(date +%s) - t0 ))s $*"; }
left() { echo $(( LIMIT - ($(date +%s) - t0) )); }
say "commit $(cat COMMIT 2>/dev/null) $(git rev-parse --short HEAD 2>/dev/null); $(python3 -c 'import hwkv, llguidance, os; print(hwkv.__file__, llguidance.__version__, len(os.sched_getaffinity(0)), "cores")' 2>&1 | tail -n 2)"
W=/dev/shm/hwkv-serve-models
say "1 (limit $(( $(left) > 55 ? 55 : $(left) ))s): python3 -m hwkv bench structured --model smollm2-135m --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records --repeat 2 --unseeded"
timeout -k 2 $(( $(left) > 55 ? 55 : $(left) )) python3 -m hwkv bench structured --model smollm2-135m --backend cuda \
  --batch 64 --input-len 128 --output-len 128 --schemas records --repeat 2 --unseeded --workdir $W --out-dir "$OUT" 2>&1 | tail -n 10
say "1 rc=${PIPESTATUS[0]}"
if [ "$(left)" -gt 40 ]; then
  say "2 (limit $(left)s): python3 -m hwkv bench structured --model llama-1b --backend cuda --batch 64 --input-len 128 --output-len 128 --schemas records --repeat 1 --unseeded"
  timeout -k 2 $(left) python3 -m hwkv bench structured --model llama-1b --backend cuda --batch 64 --input-len 128 \
    --output-len 128 --schemas records --repeat 1 --unseeded --workdir $W --out-dir "$OUT" 2>&1 | tail -n 8
  say "2 rc=${PIPESTATUS[0]}"
fi
say done
