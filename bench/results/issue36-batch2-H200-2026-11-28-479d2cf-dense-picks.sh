export HWKV_CUDA_DENSE_CONFIG_3072X2048=block_n=8,block_k=2048,num_warps=8,num_stages=3,preload=0  # qkv: 6.85 -> 5.94 us
export HWKV_CUDA_DENSE_CONFIG_2048X2048=block_n=4,block_k=2048,num_warps=4,num_stages=1,preload=1  # o_proj: 3.55 -> 3.41 us
