"""Moved to :mod:`hwkv.reference.graphs`: package code uses it; this name stays for tests."""

from hwkv.reference.graphs import *  # noqa: F403
