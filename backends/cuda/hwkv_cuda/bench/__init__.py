"""CUDA-only benchmarks, registered as ``hwkv bench <name>`` through the plugin's ``hwkv_benches`` hook."""
