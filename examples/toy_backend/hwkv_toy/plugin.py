"""Entry point `toy` (group `hwkv.backends`): tells hwkv which backends this package provides.

Only a record is returned; hwkv imports the factory lazily when the backend is used.
"""

from hwkv.interfaces import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="toy",
            api_version=API_VERSION,
            factory="hwkv_toy.backend:ToyBackend",
            description="toy vendor backend: separate K/V caches, split-KV attention with log-sum-exp merge",
        )
    ]
