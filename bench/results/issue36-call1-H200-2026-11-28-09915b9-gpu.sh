# #36: the public defaults at main (no engine argument): 1B offline + batch-1, then 8B offline 128 x 512/128
set -u; export PYTHONPATH=$PWD:$PWD/backends/cuda:${PYTHONPATH:-} PYTHONUNBUFFERED=1
echo "commit $(cat COMMIT)"; date -u
timeout -k 2 75 python3 -m hwkv bench defaults --model llama-1b --workdir /dev/shm/hwkv-def --out "$OUT/defaults-llama-1b.json"; echo "rc=$?"
timeout -k 2 150 python3 -m hwkv bench defaults --model llama-8b --workdir /dev/shm/hwkv-models --num-requests 128 --input-len 512 --output-len 128 --b1-tokens 0 --out "$OUT/defaults-llama-8b.json"; echo "rc=$?"
