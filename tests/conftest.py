"""Fixtures for every test under tests/."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only add contention on a small shared CPU (10-20x slower).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
