"""Engine-level scheduling behaviour: admission limits, policies, priorities (tiny CPU model)."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", max_position_embeddings=256))


def greedy(n: int, **kw) -> hwkv.SamplingParams:
    return hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _no_leak(e: hwkv.Engine) -> None:
    assert not e.has_unfinished() and not e.scheduler.requests
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks


def test_request_larger_than_the_pool_is_refused_at_add_request(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=4, block_size=8)  # 32 tokens; max_model_len capped to 32
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_tokens \(20\) = 40 exceeds the whole KV "
                                         r"cache pool of 4 blocks x 8 tokens = 32 tokens"):
        e.add_request("big", list(range(3, 23)), greedy(20))
    with pytest.raises(ValueError, match="32 tokens"):
        e.generate([list(range(3, 10)), list(range(3, 40))], greedy(4), use_tqdm=False)
    assert not e.scheduler.requests and not e.has_unfinished()  # nothing registered
    (out,) = e.generate([list(range(3, 23))], greedy(12), use_tqdm=False)  # 32 tokens fit exactly
    assert len(out.token_ids) == 12
    _no_leak(e)
