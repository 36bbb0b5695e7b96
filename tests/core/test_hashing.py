import hashlib
import struct

import pytest

from hwkv.core.hashing import ROOT_HASH, extra_keys, hash_block_tokens, hash_token_blocks, make_block_hasher
from hwkv.core.request import Request

BS = 16


def manual_chain(tokens, bs, first_extra=b"", extra=b""):
    h, out = ROOT_HASH, []
    for i in range(len(tokens) // bs):
        blk = struct.pack(f"<{bs}i", *tokens[i * bs : (i + 1) * bs])
        h = hashlib.sha256(h + blk + (first_extra if i == 0 else extra)).digest()
        out.append(h)
    return out


def test_chain_matches_spec_encoding():
    toks = list(range(100, 150))
    assert hash_token_blocks(toks, BS) == manual_chain(toks, BS)
    assert len(hash_token_blocks(toks, BS)) == 3  # only full blocks
    assert hash_block_tokens(ROOT_HASH, toks[:BS]) == manual_chain(toks, BS)[0]


def test_stable_golden_value():
    # Hashes key remote KV stores: they must never change across hosts or versions.
    assert hashlib.sha256(b"hwkv/prefix-cache/root/v1").digest() == ROOT_HASH
    assert hash_token_blocks(list(range(16)), 16)[0].hex() == manual_chain(list(range(16)), 16)[0].hex()
    golden = "5ef611403f2d6c970e02f67d2f2bc4928be84d6c8e1f8eecd2f9be9566659dbd"
    assert hash_token_blocks(list(range(16)), 16)[0].hex() == golden


def test_chained_same_block_different_prefix():
    a = hash_token_blocks([1] * 16 + [7] * 16, BS)
    b = hash_token_blocks([2] * 16 + [7] * 16, BS)
    assert a[1] != b[1]  # identical block content, different parent


def test_incremental_hasher_prompt_and_decode():
    hasher = make_block_hasher(BS)
    assert hasher.block_size == BS
    req = Request("r", list(range(20)), block_hasher=hasher)
    assert len(req.block_hashes) == 1
    for t in range(20, 70):
        req.append_output_token_ids(t)
        assert len(req.block_hashes) == (t + 1) // BS
    req.append_output_token_ids([70, 71])
    assert req.block_hashes == hash_token_blocks(list(range(72)), BS)
    assert hasher(req) == []  # nothing new


def test_cache_salt_changes_every_block():
    toks = list(range(64))
    plain = hash_token_blocks(toks, BS)
    s1 = hash_token_blocks(toks, BS, cache_salt="tenant-a")
    s1b = hash_token_blocks(toks, BS, cache_salt="tenant-a")
    s2 = hash_token_blocks(toks, BS, cache_salt="tenant-b")
    assert s1 == s1b
    assert not set(plain) & set(s1) and not set(s1) & set(s2)
    # salt is mixed into block 0 only: later blocks differ only through the chain
    first, rest = extra_keys(cache_salt="tenant-a")
    assert rest == b"" and len(first) == 32
    assert s1 == manual_chain(toks, BS, first_extra=first)


def test_lora_and_mm_keys_apply_to_every_block():
    toks = list(range(48))
    base = hash_token_blocks(toks, BS)
    lora1 = hash_token_blocks(toks, BS, lora_id=1)
    lora2 = hash_token_blocks(toks, BS, lora_id=2)
    mm = hash_token_blocks(toks, BS, mm_hashes=["img-a"])
    mm2 = hash_token_blocks(toks, BS, mm_hashes=["img-b"])
    assert len({*base, *lora1, *lora2, *mm, *mm2}) == 15
    first, rest = extra_keys(lora_id=1)
    assert first == rest and lora1 == manual_chain(toks, BS, first, rest)
    # salt + lora: block 0 carries both
    f, r = extra_keys(cache_salt="s", lora_id=1)
    assert r == rest and f != first


def test_hasher_uses_request_extra_keys():
    h = make_block_hasher(BS)
    toks = list(range(40))
    r = Request("r", toks, block_hasher=h, cache_salt="x", lora_id=3, mm_hashes=["m"])
    assert r.block_hashes == hash_token_blocks(toks, BS, cache_salt="x", lora_id=3, mm_hashes=["m"])
    r.append_output_token_ids(list(range(40, 48)))
    assert r.block_hashes == hash_token_blocks(list(range(48)), BS, cache_salt="x", lora_id=3, mm_hashes=["m"])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        make_block_hasher(bad)


def test_bad_tokens_and_lora():
    with pytest.raises(ValueError, match="token_ids"):
        hash_token_blocks([2**31] + [0] * 15, BS)
    with pytest.raises(ValueError, match="lora_id"):
        hash_token_blocks([0] * 16, BS, lora_id="a")
