import asyncio
import json
from pathlib import Path

import pytest

from hwkv.model.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a tokenizer and a chat template (tokenizer_config.json)."""
    return write_tiny_model(tmp_path_factory.mktemp("serving") / "tiny", seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def tiny_model_no_template(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model, its tokenizer_config.json without a chat template."""
    import shutil

    d = tmp_path_factory.mktemp("serving-nt") / "tiny"
    shutil.copytree(tiny_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(lp.shutdown_asyncgens())
    lp.close()


@pytest.fixture(scope="module")
def arun(loop):
    """``arun(coro, timeout=60)``: run ``coro`` on the module's loop, failing (not hanging) after ``timeout`` s."""
    return lambda coro, timeout=60.0: loop.run_until_complete(asyncio.wait_for(coro, timeout))
