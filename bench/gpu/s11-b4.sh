# usage (repository root, one GPU): OUT=<dir> bash bench/gpu/s11-b4.sh   (<= 400 s)
# session 11, batch 4 (#36 fp8 decode): bench/gpu/s11-b3.sh over the Gluon kernel with each block's V pages copied
# into a slot of their own (batch 3: 2x V sectors), at these variants.
G="HWKV_CUDA_FP8G=1+HWKV_CUDA_FP8G_CONFIG"
V1B="default;bt_ahead=1,num_stages=4;$G=stages=3;$G=stages=2;$G=stages=4;$G=stages=5;$G=stages=3,split_target=7"
V1B="$V1B;$G=stages=3,split_target=16;$G=stages=2,split_target=-12"
V1B=$V1B V8B="default;$G=stages=3;$G=stages=2;$G=stages=4" exec bash bench/gpu/s11-b3.sh
