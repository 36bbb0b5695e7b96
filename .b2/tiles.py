p='backends/cuda/hwkv_cuda/decode_ops.py'
s=open(p).read()
old='''M1_TILES: dict[tuple[int, int], tuple[int, int, int, int, int]] = {  # (N, K): block_n, block_k, warps, stages, preload'''
new='''M1_TILES: dict[tuple[int, int], tuple[int, ...]] = {  # (N, K): block_n, block_k, warps, stages, preload[, evict]'''
assert old in s; s=s.replace(old,new)
old='''    (3072, 2048): (8, 2048, 8, 3, 0), (2048, 2048): (4, 2048, 4, 1, 1),
}'''
new='''    (3072, 2048): (8, 2048, 8, 3, 0), (2048, 2048): (4, 2048, 4, 1, 1),
    # gate_up, down and the LM head from this session's H200 sweep (dense_probe --model llama-1b --quick --evict;
    # bench/results/issue36-b1-batch1-H200-2026-11-29-e784792.md): down's first K tile before the PDL wait 12.26 ->
    # 10.35 µs, gate_up on 8 warps with evict-first weights 20.73 -> 19.64, the head 4 x 1024 preloaded 139.9 ->
    # 131.5; in the engine's batch-1 step: B2_RESULT
    (16384, 2048): (4, 2048, 8, 3, 0, 1), (2048, 8192): (4, 2048, 8, 3, 2), (128256, 2048): (4, 1024, 4, 1, 1),
}'''
assert old in s; s=s.replace(old,new)
open(p,'w').write(s)
