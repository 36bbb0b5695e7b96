"""Engine stats count prompt and generated tokens exactly, chunked or not."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams


@pytest.mark.parametrize("budget", [64, 4])  # one-shot prefill; chunks of 4 ending in a 1-token chunk
def test_prompt_and_generation_token_counts(tmp_path, budget):
    d = str(write_tiny_model(tmp_path / "m", max_position_embeddings=256))
    e = hwkv.Engine(d, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=budget)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]
    e.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    st = e.stats()
    assert st["prompt_tokens"] == 9 + 3
    assert st["generation_tokens"] == 2 * 6
