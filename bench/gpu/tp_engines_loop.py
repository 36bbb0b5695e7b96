"""Several tensor-parallel engines in one process on the GPU, one after another: a tiny bf16 model at tp=2
built, used, closed, ``--engines`` times; prints each close's time and the tokens. A hang dumps every thread's
stack (faulthandler) after ``--dump-after`` seconds and exits. Usage (both GPUs visible):
    python bench/gpu/tp_engines_loop.py --engines 2 [--dump-after 45]
"""

import argparse
import faulthandler
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--engines", type=int, default=2)
p.add_argument("--dump-after", type=float, default=45.0)
a = p.parse_args()
faulthandler.dump_traceback_later(a.dump_after, exit=True)

from hwkv import Engine, SamplingParams  # noqa: E402
from hwkv.model.tiny import write_tiny_model  # noqa: E402

path = str(write_tiny_model(tempfile.mkdtemp(), hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1000,
                            tokenizer=False))
sp = SamplingParams(max_tokens=12, temperature=0.0)
ref = None
for i in range(a.engines):
    t0 = time.perf_counter()
    e = Engine(path, backend="cuda", dtype="bfloat16", tensor_parallel_size=2, block_size=16, num_kv_blocks=64,
               max_model_len=128)
    toks = e.generate([[5, 6, 7, 8]], sp, use_tqdm=False)[0].token_ids
    ref = ref or toks
    t1 = time.perf_counter()
    e.close()
    print(f"engine {i}: up+generate {t1 - t0:.1f} s, close {time.perf_counter() - t1:.2f} s, same tokens "
          f"{toks == ref}", flush=True)
    del e
print(f"{a.engines} engines in one process: ok", flush=True)
sys.exit(0)
