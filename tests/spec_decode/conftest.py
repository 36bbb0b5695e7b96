import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only add contention on a small shared CPU (10-20x slower).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from hwkv.testing.tiny_models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("spec") / "target", vocab_size=512,
                                max_position_embeddings=512))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> str:
    """A 1-layer model of the target's vocabulary (different weights: low acceptance)."""
    from hwkv.testing.tiny_models import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("spec") / "draft", vocab_size=512, num_layers=1, seed=1,
                                max_position_embeddings=512, tokenizer=False))
