"""Engine level: a tiny random-weight Llama served end to end, greedy tokens identical to the reference.

The model's head size and dtype are chosen inside the backend's Capabilities (float32 when declared);
the block size is the backend's default. The reference engine runs the same model in the same dtype.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec

pytestmark = [pytest.mark.capability("engine"), pytest.mark.timeout_s(600)]
VOCAB, HEADS, KV_HEADS, LAYERS = 512, 4, 2, 2
POOL_TARGET = 512 << 20  # KV pool bytes the memory-sized engine check asks for
HALF_LOGIT_MARGIN = 0.02  # relative logit margin for backends without float32 (see TinySetup.agree)


class TinySetup:
    def __init__(self, path: str, dtype: torch.dtype, block_size: int, reasons: list[str]):
        self.path, self.dtype, self.block_size, self.reasons = path, dtype, block_size, reasons
        self._ref: dict[Any, list[list[int]]] = {}
        self._model: Any = None

    def prompts(self, lengths: list[int], seed: int, shared_prefix: int = 0) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        prefix = torch.randint(3, VOCAB, (shared_prefix,), generator=g).tolist()
        return [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]

    def agree(self, check: Any, got: list[list[int]], prompts: list[list[int]], max_tokens: int, what: str) -> None:
        """The backend's greedy tokens agree with the reference.

        In float32: identical to the reference engine's tokens. A backend without float32 cannot be
        held to identity with any reference — near-ties flip under half rounding — so each of its
        tokens is scored by the float32 reference on the backend's own prefix (teacher forcing): it
        must be the reference's argmax up to a logit margin covering half-precision rounding.
        """
        if self.dtype == torch.float32:
            check.same_tokens(got, self.reference(prompts, max_tokens), what)
            return
        worst = 0.0
        for i, (prompt, toks) in enumerate(zip(prompts, got)):
            logits = self._teacher_forced_logits(prompt + toks, len(prompt))
            best = logits.max(-1).values
            gap = best - logits[torch.arange(len(toks)), torch.tensor(toks)]
            worst = max(worst, float(gap.max()))
            bad = (gap > HALF_LOGIT_MARGIN * best.abs().clamp_min(1.0)).nonzero()
            if bad.numel():
                j = int(bad[0])
                check.rec.update(worst, worst, f"argmax up to {HALF_LOGIT_MARGIN:g} relative logit margin")
                raise AssertionError(
                    f"{what}: sequence {i} token {j} is {toks[j]}, whose float32 reference logit is "
                    f"{float(gap[j]):.4g} below the argmax {int(logits[j].argmax())} (allowed: "
                    f"{HALF_LOGIT_MARGIN:g} x max(1, |max logit|))"
                )
        check.rec.update(worst, worst, f"argmax up to {HALF_LOGIT_MARGIN:g} relative logit margin")

    def _teacher_forced_logits(self, ids: list[int], n_prompt: int) -> torch.Tensor:
        """float32 reference logits predicting ``ids[n_prompt:]`` from their prefixes (one prefill)."""
        from hwkv.interfaces import AttentionMetadata, KVCache
        from hwkv.model import load_model
        from hwkv.plugins import get_backend

        if self._model is None:
            self._model = load_model(self.path, get_backend("cpu"), dtype=torch.float32, load_tokenizer=False)[0]
        model, bs, n = self._model, 16, len(ids)
        nblocks = -(-n // bs)
        cache = KVCache.allocate(model.kv_cache_spec(nblocks, bs), get_backend("cpu").attention.kv_layout)
        meta = AttentionMetadata.build([n], [n], [list(range(nblocks))], bs)
        with torch.inference_mode():
            return model.forward(torch.tensor(ids), torch.arange(n), cache, meta,
                                 torch.arange(n_prompt - 1, n - 1)).float()

    def reference(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """The reference engine's greedy tokens (default configuration), cached per input."""
        key = (tuple(map(tuple, prompts)), max_tokens)
        if key not in self._ref:
            self._ref[key] = generate("cpu", self, prompts, max_tokens, block_size=self.block_size)[0]
        return self._ref[key]


def generate(backend: Any, setup: TinySetup, prompts: list[list[int]], max_tokens: int,
             engine: Any = None, **kwargs: Any) -> tuple[list[list[int]], dict[str, Any]]:
    from hwkv import Engine, SamplingParams

    kwargs.setdefault("num_kv_blocks", 64)  # sized for the test; the default fills device memory
    kwargs.setdefault("max_num_seqs", 8)
    eng = engine or Engine(setup.path, backend=backend, dtype=setup.dtype, seed=0, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = eng.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [max_tokens] * len(prompts), "every request must run to max_tokens"
    return [list(o.token_ids) for o in outs], eng.stats()


@pytest.fixture(scope="session")
def tiny(backend, tmp_path_factory) -> TinySetup:
    from hwkv.model.tiny import write_tiny_model

    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else min(caps.head_sizes)
    dtype = torch.float32 if torch.float32 in caps.dtypes else caps.dtypes[0]
    bs = caps.default_block_size
    spec = KVCacheSpec(LAYERS, 1, bs, KV_HEADS, head, dtype)
    reasons = caps.validate(spec, num_heads=HEADS, layout=backend.attention.kv_layout)
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(path, "llama", hidden_size=64, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                     head_dim=head, vocab_size=VOCAB, seed=0, dtype=dtype, max_position_embeddings=1024)
    return TinySetup(str(path), dtype, bs, reasons)


@pytest.fixture
def setup(tiny: TinySetup) -> TinySetup:
    if tiny.reasons:
        not_supported(tiny.reasons)
    return tiny


def test_greedy_matches_reference(engine_backend, check, setup):
    """Concurrent ragged prompts (prefill and decode in the same steps) match token for token."""
    bs = setup.block_size
    prompts = setup.prompts([5, bs + 1, 2 * bs + 7, 3], seed=1)
    got, _ = generate(engine_backend, setup, prompts, 12)
    setup.agree(check, got, prompts, 12, "greedy tokens vs reference")


def test_prefix_cache_identity(engine_backend, check, setup):
    """Prefix caching on (second pass served from cache) == off == reference."""
    bs = setup.block_size
    prompts = setup.prompts([3, bs + 2, 9], seed=2, shared_prefix=2 * bs + 5)
    from hwkv import Engine

    eng = Engine(setup.path, backend=engine_backend, dtype=setup.dtype, seed=0, enable_prefix_caching=True,
                 num_kv_blocks=64, max_num_seqs=8)
    first, _ = generate(engine_backend, setup, prompts, 8, engine=eng)
    second, stats = generate(engine_backend, setup, prompts, 8, engine=eng)
    assert stats["prefix_cache_hits"] > 0, f"the second pass must hit the prefix cache: {stats}"
    off, _ = generate(engine_backend, setup, prompts, 8, enable_prefix_caching=False)
    setup.agree(check, first, prompts, 8, "prefix cache on, first pass vs reference")
    setup.agree(check, second, prompts, 8, "prefix cache on, cached pass vs reference")
    setup.agree(check, off, prompts, 8, "prefix cache off vs reference")


def test_chunked_prefill_identity(engine_backend, check, setup):
    """Prompts prefilled in chunks of a few tokens (a chunk on a cached prefix) == one-shot reference."""
    bs = setup.block_size
    prompts = setup.prompts([3 * bs + 5, 2 * bs - 3, 6], seed=3)
    budget = max(8, bs // 2 + 3)  # chunks that end inside a block
    got, stats = generate(engine_backend, setup, prompts, 8, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=budget // 2 + 1, enable_prefix_caching=False)
    assert stats["num_steps"] > (3 * bs + 5) // budget, f"prefill was not chunked: {stats}"
    setup.agree(check, got, prompts, 8, "chunked prefill vs reference")


def test_preemption_identity(engine_backend, check, setup):
    """A KV pool too small for the batch forces preemption by recompute; tokens still match."""
    bs = setup.block_size
    prompts = setup.prompts([bs + 4, bs + 3, bs + 5], seed=4)
    got, stats = generate(engine_backend, setup, prompts, bs + 4, num_kv_blocks=5, enable_prefix_caching=False)
    assert stats["num_preemptions"] > 0, f"the small pool must force preemption: {stats}"
    setup.agree(check, got, prompts, bs + 4, "preempted run vs reference")


@pytest.mark.serial  # sizes a pool from device-wide free memory
def test_pool_sized_from_memory(engine_backend, check, setup):
    """With no ``num_kv_blocks`` the engine sizes its KV pool from ``Device.memory_info``: a
    ``memory_fraction`` chosen to leave 512 MiB gives a pool of about 512 MiB (a quarter to twice that,
    one retry: other allocations, other processes and a VM's free-page reporting move free memory
    too; the cap of max_num_seqs full-length requests is 4x the target), and the engine still matches
    the reference."""
    from hwkv import Engine

    seen = []
    for _ in range(2):
        free, total = engine_backend.device.memory_info()
        target = min(POOL_TARGET, free // 4)
        fraction = 1.0 - (free - target) / total
        # enough sequences that the pool is not capped at max_num_seqs full-length requests
        eng = Engine(setup.path, backend=engine_backend, dtype=setup.dtype, seed=0, memory_fraction=fraction,
                     max_num_seqs=1024, enable_prefix_caching=False, enforce_eager=True)
        spec = eng.kv_cache.spec
        pool = spec.num_blocks * spec.bytes_per_block
        seen.append((fraction, free, total, spec.num_blocks, pool))
        if 0.25 * target <= pool <= 2 * target:
            break
        eng = None  # free this pool before the retry
    else:
        raise AssertionError(
            f"memory_fraction chosen from memory_info() to leave ~{target >> 20} MiB for the KV pool; the engine "
            f"sized (fraction, free, total, blocks, pool bytes) = {seen}"
        )
    prompts = setup.prompts([setup.block_size + 3, 6], seed=5)
    got, _ = generate(engine_backend, setup, prompts, 6, engine=eng)
    setup.agree(check, got, prompts, 6, "engine with a memory-sized pool vs reference")


# Extension point: engine features (block copies through the engine's offload path, KV connectors,
# speculative decoding, ...) each get an identity check here as they land: run the feature on the
# backend under test and the same prompts on the reference, and compare with ``setup.agree``. Gate a
# check only by what the backend declares — ``not_supported(caps.validate(...))`` or a reason
# computed from ``engine_backend.capabilities`` — never by catching the feature's own errors.
