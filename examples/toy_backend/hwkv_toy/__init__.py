"""hwkv-toy: an example vendor backend, certified by the hwkv conformance suite."""

__version__ = "0.1.0"
