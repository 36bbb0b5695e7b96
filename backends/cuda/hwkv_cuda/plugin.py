"""pluggy entry point (group ``hwkv.backends``): registers the ``cuda`` backend (imported lazily) and
its attention benchmark (``hwkv bench attention``)."""

from hwkv.interfaces.backend import API_VERSION, BackendSpec
from hwkv.plugins import BenchSpec, hookimpl


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cuda",
            api_version=API_VERSION,
            factory="hwkv_cuda.backend:CudaBackend",
            description="NVIDIA GPUs: Triton unified paged attention (GQA, split-KV), torch.cuda device, "
                        "Mooncake transfer (rdma when RDMA devices exist, else tcp via pinned host buffers)",
        )
    ]


@hookimpl
def hwkv_benches() -> list[BenchSpec]:
    return [BenchSpec("attention", "hwkv_cuda.bench.attention",
                      "CUDA paged attention kernels vs torch SDPA / FlexAttention"),
            BenchSpec("allreduce", "hwkv_cuda.bench.allreduce",
                      "tensor-parallel all-reduce paths (one-shot push, symmetric-memory one/two-shot) vs NCCL, "
                      "µs per call by size, eager and in a CUDA graph")]
