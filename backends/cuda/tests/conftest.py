"""Run the Triton kernels in interpreter mode on CPU-only machines. Triton reads TRITON_INTERPRET
when a kernel is decorated, and hwkv_cuda imports its kernels on first use, so setting it here is
early enough."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent):  # naive reference; the package when not pip-installed
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
