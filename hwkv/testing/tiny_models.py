"""Moved to :mod:`hwkv.model.tiny`: package code uses it; this name stays for tests."""

from hwkv.model.tiny import *  # noqa: F403
