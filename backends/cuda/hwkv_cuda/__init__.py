"""hwkv-cuda: the NVIDIA backend of hwkv (Triton paged attention, torch.cuda device, Mooncake transfer).

Importing this package needs neither a GPU nor Triton; kernels are imported on first use."""

__version__ = "0.1.0"
