"""Moved to :mod:`hwkv.spec_decode.tiny_heads`: package code uses it; this name stays for tests."""

from hwkv.spec_decode.tiny_heads import *  # noqa: F403
