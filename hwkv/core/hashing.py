"""Chained sha256 block hashes for the prefix cache, as in vLLM's automatic
prefix caching.

``H_i = sha256(H_{i-1} || tokens_i || extra_i)`` with ``H_{-1} = ROOT_HASH``:

* ``tokens_i`` — the block's ``block_size`` token ids as little-endian int32 (stable across hosts, so
  hashes can key a shared/remote KV store; never Python ``hash()`` or pickle).
* ``extra_i`` — empty for a plain request, else a 32-byte digest of the request's extra keys:
  ``lora_id`` and ``mm_hashes`` on every block; ``cache_salt`` on block 0 only (the chain carries it
  to every later block, so differently salted requests never share a single block).
* ``Request.mm_hashes`` carries no positions, so the rule is conservative: every block of a request
  with multimodal inputs carries all of its mm hashes (never shares a block across different images).

Only full blocks are hashed. A hasher is incremental: it returns hashes only for blocks that became
full since ``request.block_hashes`` was last extended (prompt blocks and decode-filled blocks alike).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache

from hwkv.core.request import BlockHasher, Request

BlockHash = bytes
ROOT_HASH: BlockHash = hashlib.sha256(b"hwkv/prefix-cache/root/v1").digest()
_NO_EXTRA = (b"", b"")


@lru_cache(maxsize=256)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}i")


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return _packer(len(token_ids)).pack(*token_ids)
    except struct.error as e:
        raise ValueError(f"token_ids must be ints in int32 range, got an invalid one ({e})") from None


def extra_keys(
    cache_salt: str | None = None, lora_id: int | None = None, mm_hashes: Sequence[str] = ()
) -> tuple[bytes, bytes]:
    """(extra bytes for block 0, extra bytes for every later block); ``(b"", b"")`` for a plain request."""
    if cache_salt is None and lora_id is None and not mm_hashes:
        return _NO_EXTRA
    common = b""
    if lora_id is not None:
        if not isinstance(lora_id, int) or isinstance(lora_id, bool):
            raise ValueError(f"lora_id must be an int or None, got {lora_id!r}")
        common += b"lora\0" + struct.pack("<q", lora_id)
    for mm in mm_hashes:
        mm_bytes = str(mm).encode()
        common += b"mm\0" + struct.pack("<I", len(mm_bytes)) + mm_bytes
    rest = hashlib.sha256(b"hwkv-extra\0" + common).digest() if common else b""
    if cache_salt is None:
        return rest, rest
    salt = str(cache_salt).encode()
    first = hashlib.sha256(b"hwkv-extra\0salt\0" + struct.pack("<I", len(salt)) + salt + common).digest()
    return first, rest


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """One link of the chain: ``sha256(parent || int32le(token_ids) || extra)``."""
    return hashlib.sha256(parent + _encode_tokens(token_ids) + extra).digest()


def _hash_chain(
    parent: BlockHash, token_ids: Sequence[int], block_size: int, first_is_block0: bool, extras: tuple[bytes, bytes]
) -> list[BlockHash]:
    # Hot path: one struct pack for all new tokens, then one sha256 call per block on a byte slice.
    buf = _encode_tokens(token_ids)
    nb = 4 * block_size
    sha = hashlib.sha256
    out: list[BlockHash] = []
    append = out.append
    h, pos = parent, 0
    first_extra, extra = extras
    if first_is_block0 and first_extra:
        h = sha(h + buf[:nb] + first_extra).digest()
        append(h)
        pos = nb
    if extra:
        for i in range(pos, len(buf), nb):
            h = sha(h + buf[i : i + nb] + extra).digest()
            append(h)
    else:
        for i in range(pos, len(buf), nb):
            h = sha(h + buf[i : i + nb]).digest()
            append(h)
    return out


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    lora_id: int | None = None,
    mm_hashes: Sequence[str] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` (same values a request's hasher produces)."""
    _check_block_size(block_size)
    n = len(token_ids) // block_size * block_size
    return _hash_chain(ROOT_HASH, token_ids[:n], block_size, True, extra_keys(cache_salt, lora_id, mm_hashes))


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def make_block_hasher(block_size: int) -> BlockHasher:
    """A ``Request -> list[bytes]`` hasher: hashes of blocks that became full since
    ``request.block_hashes`` was last extended (the caller extends it). ``hasher.block_size`` is set."""
    _check_block_size(block_size)

    def block_hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        tokens = request.all_token_ids
        end = len(tokens) // block_size
        if end <= start:  # decode fast path: no block filled up
            return []
        parent = request.block_hashes[-1] if start else ROOT_HASH
        extras = extra_keys(request.cache_salt, request.lora_id, request.mm_hashes)
        return _hash_chain(parent, tokens[start * block_size : end * block_size], block_size, start == 0, extras)

    block_hasher.block_size = block_size  # type: ignore[attr-defined]
    return block_hasher
