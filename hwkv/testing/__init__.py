"""Helpers for tests and local experiments (tiny models, a real mooncake_master). Nothing here is
imported by the library itself."""
