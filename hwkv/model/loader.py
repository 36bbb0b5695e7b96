"""Load a local Hugging Face model directory: config, safetensors weights, tokenizer, generation config.

Weights are read tensor by tensor with ``safetensors.safe_open`` (memory-mapped) and copied straight
into preallocated parameters on the backend's device, converting dtype on the way; no second full
copy of the model is ever held.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hwkv.model.config import ModelConfig, ModelLoadError, parse_dtype, read_json
from hwkv.model.gguf_file import find_gguf, open_gguf
from hwkv.model.llama import LlamaForCausalLM
from hwkv.model.registry import family_of
from hwkv.model.tokenizer import Tokenizer
from hwkv.parallel.sharding import check_tp, checkpoint_slices

_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


@dataclass
class GenerationConfig:
    """``generation_config.json``: stop ids (falling back to config.json / the tokenizer) and the
    checkpoint's default sampling values (``defaults``, only keys present in the file)."""

    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str | Path, config: ModelConfig, tokenizer: Tokenizer | None = None) -> GenerationConfig:
        file = Path(path) / "generation_config.json"
        raw = read_json(file) if file.is_file() else {}
        eos = raw.get("eos_token_id")
        if eos is None:
            ids = list(config.eos_token_ids)
        else:
            ids = [eos] if isinstance(eos, int) else list(eos)
            if not all(isinstance(i, int) for i in ids):
                raise ModelLoadError(f"{file}: eos_token_id must be an int or a list of ints, got {eos!r}")
        if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            ids = [tokenizer.eos_token_id]
        bos = raw.get("bos_token_id", config.bos_token_id)
        return cls(
            eos_token_ids=ids,
            bos_token_id=bos if isinstance(bos, int) else None,
            pad_token_id=raw.get("pad_token_id") if isinstance(raw.get("pad_token_id"), int) else None,
            defaults={k: raw[k] for k in _DEFAULT_KEYS if raw.get(k) is not None},
        )


def resolve_dtype(
    requested: str | torch.dtype | None, config: ModelConfig, supported: tuple[torch.dtype, ...] | None = None
) -> torch.dtype:
    """Explicit dtype if the backend supports it; for ``None``/``"auto"`` the checkpoint's dtype when
    supported, else float32, else the backend's first dtype."""
    dtype = parse_dtype(requested)
    names = ", ".join(str(d).removeprefix("torch.") for d in supported or ())
    if dtype is not None:
        if supported and dtype not in supported:
            name = str(dtype).removeprefix("torch.")
            raise ValueError(f"dtype {name} is not supported by the backend (allowed: {names})")
        return dtype
    for cand in (config.dtype, torch.float32):
        if cand is not None and (not supported or cand in supported):
            return cand
    return supported[0]  # type: ignore[index]


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors`` or the shards named by
    ``model.safetensors.index.json`` (every shard must exist)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} not found")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(p.name for p in path.glob("*.safetensors"))
    if others:
        return [path / n for n in others]
    bins = sorted(p.name for p in path.glob("*.bin"))
    hint = f" (found {', '.join(bins)}: .bin checkpoints are not supported, convert to safetensors)" if bins else ""
    raise ModelLoadError(f"{single}: file not found and no model.safetensors.index.json{hint}")


def iter_weights(files: list[Path], slices: dict[str, Any] | None = None) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """``(file, name, tensor)`` of every checkpoint tensor. ``slices`` (tensor parallelism,
    :func:`hwkv.parallel.sharding.checkpoint_slices`): ``name -> (dim, start, length)`` reads only
    that slice, ``name -> None`` skips the tensor; other names are read whole."""
    from safetensors import SafetensorError, safe_open

    # Host tensors (memory-mapped) on every device: load_weights copies each into its parameter,
    # one host->device copy (safetensors' own device loading also goes through the host).
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    if slices is None or name not in slices:
                        yield f, name, st.get_tensor(name)
                    elif (sl := slices[name]) is not None:
                        dim, start, length = sl
                        index = (slice(None),) * dim + (slice(start, start + length),)
                        yield f, name, st.get_slice(name)[index]
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: not a valid safetensors file ({e})") from None


def load_weights(model: LlamaForCausalLM, path: str | Path) -> None:
    """Fill every parameter of ``model`` from the checkpoint at ``path`` (an HF directory or a GGUF
    checkpoint, dequantised on the way).

    Warns (``RuntimeWarning``) naming every tensor that holds NaN or inf values."""
    gguf = find_gguf(path)
    files = weight_files(path) if gguf is None else [gguf]
    slots = model.weight_slots()
    loaded: set[str] = set()
    slices = None
    if getattr(model, "tp", None) is not None:
        slices = checkpoint_slices(slots, model.full_config, model.tp)
        skipped = {n for n, sl in slices.items() if sl is None}  # row-parallel biases off rank 0
        for n in skipped:
            slots[n].zero_()
        loaded |= skipped
    sums: list[tuple[Path, str, torch.Tensor]] = []
    if gguf is None:
        tensors = iter_weights(files, slices)
    else:
        cfg = getattr(model, "full_config", None) or model.config
        tensors = open_gguf(gguf).weights(cfg.num_heads, cfg.num_kv_heads, slices)
    for file, name, tensor in tensors:
        try:
            got = model.load_weights([(name, tensor)])
            loaded |= got
            sums += [(file, n, _float_sum(slots[n])) for n in got]
        except KeyError:
            what = "" if gguf else " (quantized or non-HF checkpoints are not supported)"
            raise ModelLoadError(
                f"{file}: unexpected tensor {name.removeprefix('gguf:')!r} for {model.config.architecture}{what}"
            ) from None
        except ValueError as e:
            raise ModelLoadError(f"{file}: {e}") from None
    _warn_non_finite(path, sums, slots)
    missing = sorted(set(slots) - loaded)
    if missing:
        hint = " (tie_word_embeddings is false in config.json)" if "lm_head.weight" in missing else ""
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{Path(path)}: checkpoint lacks {len(missing)} tensors: {shown}{hint}")


def _float_sum(t: torch.Tensor) -> torch.Tensor:
    """The tensor's sum in its own dtype (no converted copy; 20x faster on the host than a float32
    sum of a bf16 tensor), computed on the device without a sync. NaN/inf propagate into it; a
    float16 sum may also overflow, which ``_warn_non_finite`` tells apart by counting."""
    return t.sum().float()


def _warn_non_finite(path: str | Path, sums: list[tuple[Path, str, torch.Tensor]],
                     slots: dict[str, torch.Tensor]) -> None:
    if not sums:
        return
    finite = torch.isfinite(torch.stack([s for *_, s in sums])).tolist()  # the one host sync
    bad = []
    for (file, name, _), ok in zip(sums, finite):
        t = slots[name]
        n = 0 if ok else int((~torch.isfinite(t)).sum())
        if n:  # (a sum can overflow on finite values; only real NaN/inf are reported)
            bad.append(f"{name!r} in {file.name} ({n} of {t.numel()} values)")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        warnings.warn(f"{Path(path)}: checkpoint tensors hold NaN or inf values, outputs will be garbage: {shown}",
                      RuntimeWarning, stacklevel=3)


def load_model(
    path: str | Path,
    backend: Any,
    dtype: str | torch.dtype | None = None,
    max_model_len: int | None = None,
    load_tokenizer: bool = True,
    tp: Any = None,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None, GenerationConfig]:
    """``(model, config, tokenizer, generation_config)`` for the HF directory ``path``, or a GGUF
    checkpoint (a ``.gguf`` file, or a directory holding one and no config.json).

    ``backend`` is a :class:`~hwkv.interfaces.Backend` (or its registered name); the model lives on
    its device and uses its attention. ``max_model_len`` sizes the RoPE table (default: the
    config's, capped at a sliding window). The model is in eval mode; call it under
    ``torch.inference_mode()``.

    ``tp`` (a :class:`hwkv.parallel.sharding.TPShard`): build and load only this rank's shard; the
    returned config is the checkpoint's, ``model.config`` the per-rank one.
    """
    if isinstance(backend, str):
        from hwkv.plugins import get_backend

        backend = get_backend(backend)
    path = Path(path)
    config = ModelConfig.from_dir(path)
    if max_model_len is not None:
        config.check_max_model_len(max_model_len)
    caps = getattr(backend, "capabilities", None)
    torch_dtype = resolve_dtype(dtype, config, getattr(caps, "dtypes", None))
    tokenizer = Tokenizer.from_dir(path) if load_tokenizer else None
    gen = GenerationConfig.from_dir(path, config, tokenizer)
    device = backend.device.torch_device
    family = family_of(config.architecture)
    kw = {}
    if tp is not None:
        check_tp(config, tp.size)
        kw["tp"] = tp
    model = family.model_class(config, backend.attention, device, torch_dtype, max_model_len or config.max_model_len,
                               **kw)
    load_weights(model, path)
    return model.eval(), config, tokenizer, gen
