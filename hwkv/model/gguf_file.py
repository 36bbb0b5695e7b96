"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer, chat template and weights.

``Engine(model="model.gguf")`` (or a directory holding one ``.gguf`` and no ``config.json``) loads
through here. The metadata becomes an HF-style config dict validated by
:meth:`ModelConfig.from_dict` (errors name the file); the vocabulary and merges become a
``tokenizers`` byte-level BPE; tensors are renamed to HF names, dequantised with the ``gguf``
package's own ``gguf.quants`` (llama.cpp's reference code) one at a time, and copied into the
model's parameters in the engine dtype, so the host never holds more than the memory-mapped file
plus one dequantised tensor.

llama.cpp's converter permutes the rows of Llama's q/k projections (its RoPE rotates adjacent
pairs, HF's rotates halves); they are permuted back here. Only the metadata is parsed by our own
reader: ``gguf.GGUFReader`` builds a numpy view per vocabulary string (~10 s for a 49k vocabulary
on a busy host); the format's constants, block sizes and dequantisation all come from ``gguf``.
"""

from __future__ import annotations

import functools
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hwkv.model.fields import ModelLoadError

# GGUF ``general.architecture`` -> the HF architecture serving it; ``permuted``: llama.cpp permuted q/k.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}
# Dequantised by gguf.quants; the first eight are round-trip tested (gguf can write them), the
# K-quants come from the same library code.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# tokenizer.ggml.pre -> how text is split before BPE, as llama.cpp's LLAMA_VOCAB_PRE_TYPE_* regexes:
# "gpt2" (the GPT-2 regex), "digits" (each digit alone, then GPT-2), or a regex of its own (Llama 3's
# also ignores merges for a piece that is a whole vocabulary entry, as llama.cpp and HF do).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": "gpt2", "gpt-2": "gpt2", "smollm": "digits", "starcoder": "digits", "refact": "digits",
                  "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "qwen2": _QWEN2,
                  "deepseek-r1-qwen": _QWEN2}

# GGUF tensor names (llama.cpp's) -> HF names; hwkv.testing.gguf_models writes GGUF files from the inverse
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias", "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


def hf_name(name: str) -> str | None:
    """The HF tensor name of a GGUF tensor name, ``None`` for names we do not know."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}"
    return None


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``.gguf`` of a directory without a
    ``config.json`` (an HF directory wins). ``None`` when ``path`` is not a GGUF checkpoint."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return path
        with open(path, "rb") as f:
            return path if f.read(4) == b"GGUF" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ModelLoadError(f"{path}: holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                             "pass the one to load as the model path")
    return files[0] if files else None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions innermost first)
    qtype: str              # gguf.GGMLQuantizationType name
    offset: int             # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: ``meta`` (key -> value) and ``tensors`` (name -> :class:`TensorInfo`),
    the data memory-mapped. Malformed files raise :class:`ModelLoadError` naming the file."""

    def __init__(self, path: str | Path):
        try:
            import gguf
        except ImportError:
            raise ModelLoadError(f"{path}: loading GGUF checkpoints needs the gguf package "
                                 "(pip install 'hwkv[gguf]')") from None

        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{self.path}: cannot be read ({e})") from None
        self._pos = 0
        try:
            magic, version = self._read("<4sI")
            if magic != b"GGUF":
                raise ModelLoadError(f"{self.path}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
            if version not in (2, 3):
                hint = " (a big-endian file?)" if version > 0xFFFF else ""
                raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (allowed: 2, 3){hint}")
            n_tensors, n_kv = self._read("<QQ")
            self.meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                self.meta[key] = self._value(self._read("<I")[0])
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._read("<I")
                dims = self._read(f"<{n_dims}Q")
                qtype, offset = self._read("<IQ")
                infos.append((name, dims, qtype, offset))
        except (struct.error, UnicodeDecodeError, MemoryError, OverflowError) as e:
            raise ModelLoadError(f"{self.path}: truncated or malformed GGUF header ({e})") from None
        align = self.meta.get("general.alignment", 32)
        start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, offset in infos:
            try:
                qname = gguf.GGMLQuantizationType(qtype).name
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                qname, block, size = f"type {qtype}", 1, 0
            numel = int(np.prod(dims)) if dims else 1
            nbytes = numel // block * size
            if size and (dims[0] % block or start + offset + nbytes > len(self._map)):
                raise ModelLoadError(f"{self.path}: tensor {name!r} ({qname}, shape {tuple(reversed(dims))}) "
                                     "lies outside the file or does not fill whole blocks (truncated file?)")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qname, start + offset,
                                            nbytes)

    def _read(self, fmt: str) -> tuple[Any, ...]:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._read("<Q")
        s = self._map[self._pos:self._pos + n]
        if len(s) != n:
            raise struct.error("string runs past the end of the file")
        self._pos += n
        return s.decode("utf-8")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            itype, count = self._read("<IQ")
            if itype == _STRING:
                return [self._string() for _ in range(count)]
            if itype in _NP:
                arr = np.frombuffer(self._map, dtype=_NP[itype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(itype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise struct.error(f"unknown metadata value type {vtype}")
        return self._read(_SCALARS[vtype])[0]

    def raw(self, info: TensorInfo) -> np.ndarray:
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The tensor dequantised: float32 for quantised types, its own dtype for F32/F16/BF16."""
        import gguf
        from gguf import quants

        if info.qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{self.path}: tensor {info.name!r} has type {info.qtype}, which is not supported "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        raw = self.raw(info)
        if info.qtype in ("F32", "F16", "BF16"):
            dt = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[info.qtype]
            t = torch.from_numpy(raw.view(dt).reshape(info.shape).copy())  # the mapping is read-only
            return t.view(torch.bfloat16) if info.qtype == "BF16" else t
        rows = raw.reshape(-1, raw.size // (int(np.prod(info.shape[:-1])) or 1))
        out = quants.dequantize(rows, gguf.GGMLQuantizationType[info.qtype])
        return torch.from_numpy(out.reshape(info.shape))

    def close(self) -> None:
        self._map.close()

    # --- what the loader needs ----------------------------------------------------------------

    def _key(self, key: str, default: Any = ..., kind: type | tuple[type, ...] = int) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            if default is ...:
                raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full!r}")
            return default
        v = self.meta[full]
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise ModelLoadError(f"{self.path}: GGUF metadata {full} = {v!r} is not allowed "
                                 f"(allowed: {'an integer' if kind is int else 'a number'})")
        return v

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def architecture(self) -> tuple[str, bool]:
        """``(HF architecture, q/k permuted)``; unsupported architectures and split files are refused."""
        if self.meta.get("split.count", 1) > 1:
            raise ModelLoadError(f"{self.path}: a split GGUF ({self.meta['split.count']} parts) is not supported; "
                                 "merge it into one file first (llama.cpp's gguf-split --merge)")
        if self.arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})")
        return ARCHITECTURES[self.arch]

    def config_dict(self) -> dict[str, Any]:
        """The metadata as an HF ``config.json`` dict (validated by ``ModelConfig.from_dict``)."""
        arch, _ = self.architecture()
        heads = self._key("attention.head_count")
        kv = self._key("attention.head_count_kv", heads, (int, list))
        if isinstance(kv, list):  # per-layer head counts (e.g. hybrid models)
            if len(set(kv)) != 1:
                raise ModelLoadError(f"{self.path}: per-layer attention.head_count_kv {kv[:8]} is not supported "
                                     "(allowed: the same count in every layer)")
            kv = kv[0]
        hidden = self._key("embedding_length")
        head_dim = self._key("attention.key_length", hidden // heads if heads else 0)
        rot = self._key("rope.dimension_count", head_dim)
        if rot != head_dim:
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.rope.dimension_count = {rot} is not allowed "
                                 f"(allowed: the head size {head_dim}; partial RoPE is not supported)")
        if "rope_freqs.weight" in self.tensors:
            raise ModelLoadError(f"{self.path}: tensor 'rope_freqs.weight' (per-dimension RoPE factors, e.g. Llama "
                                 "3.1 scaling) is not supported")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        vocab = self._key("vocab_size", len(tokens) if isinstance(tokens, list) else None)
        if vocab is None and "token_embd.weight" in self.tensors:
            vocab = self.tensors["token_embd.weight"].shape[0]
        cfg: dict[str, Any] = {
            "architectures": [arch], "model_type": self.arch, "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": self._key("feed_forward_length"),
            "num_hidden_layers": self._key("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": vocab,
            "rms_norm_eps": self._key("attention.layer_norm_rms_epsilon", 1e-6, (int, float)),
            "max_position_embeddings": self._key("context_length", 2048),
            "rope_theta": self._key("rope.freq_base", 10000.0, (int, float)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensors,
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.eos_token_ids() or None,
        }
        floats = {t.qtype for t in self.tensors.values() if len(t.shape) > 1}
        if len(floats) == 1 and floats <= {"F32", "F16", "BF16"}:  # unquantised: keep its dtype as the default
            cfg["dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[floats.pop()]
        scaling = self._key("rope.scaling.type", "none", str)
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self._key("rope.scaling.factor", kind=(int, float))}
        elif scaling == "yarn":
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": self._key("rope.scaling.factor", kind=(int, float))}
            orig = self._key("rope.scaling.original_context_length", None)
            if orig is not None:
                cfg["rope_scaling"]["original_max_position_embeddings"] = orig
        elif scaling != "none":
            raise ModelLoadError(f"{self.path}: GGUF metadata {self.arch}.rope.scaling.type = {scaling!r} is not "
                                 "supported (allowed: none, linear, yarn)")
        window = self._key("attention.sliding_window", None)
        if window:
            cfg["sliding_window"] = window
            cfg["use_sliding_window"] = True
        return cfg

    def eos_token_ids(self) -> list[int]:
        ids = [self.meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id")]
        return list(dict.fromkeys(i for i in ids if isinstance(i, int)))

    def tokenizer(self) -> tuple[Any, dict[str, Any]]:
        """The vocabulary (byte-level BPE only) as a ``tokenizers.Tokenizer`` and the special tokens and
        chat template: what :class:`hwkv.model.tokenizer.Tokenizer` wraps."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer

        kind = self.meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"{self.path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', "
                                 "byte-level BPE; SentencePiece 'llama' and others are not converted)")
        pre = self.meta.get("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelLoadError(f"{self.path}: GGUF tokenizer.ggml.pre = {pre!r} is not supported "
                                 f"(supported: {', '.join(PRE_TOKENIZERS)})")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        merges = self.meta.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
        types = self.meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ModelLoadError(f"{self.path}: malformed merge {m!r} in tokenizer.ggml.merges")
            pairs.append((a, b))
        split = PRE_TOKENIZERS[pre]
        tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs, fuse_unk=False,
                                     ignore_merges=split == _LLAMA3))
        level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
        if split == "digits":
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), level])
        elif split == "gpt2":
            tok.pre_tokenizer = level
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"), level])
        tok.decoder = decoders.ByteLevel()
        # Control (3) and user-defined (4) tokens are matched whole in the input, as llama.cpp does;
        # control tokens are special (skipped when decoding with skip_special_tokens).
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == 3])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])

        def name(key: str) -> str | None:
            i = self.meta.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        bos = name("tokenizer.ggml.bos_token_id")
        if self.meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
        template = self.meta.get("tokenizer.chat_template")
        return tok, {"bos_token": bos, "eos_token": name("tokenizer.ggml.eos_token_id"),
                     "pad_token": name("tokenizer.ggml.padding_token_id"), "chat_template": template}

    def weights(self, num_heads: int, num_kv_heads: int,
                slices: dict[str, Any] | None = None) -> Iterator[tuple[Path, str, torch.Tensor]]:
        """``(file, HF name, tensor)`` of every tensor, dequantised, Llama's q/k rows un-permuted.
        ``slices`` as :func:`hwkv.model.loader.iter_weights` (applied after dequantisation).
        Unknown names are passed through as ``gguf:<name>`` so the loader reports them."""
        _, permuted = self.architecture()
        for info in self.tensors.values():
            name = hf_name(info.name)
            if name is None:
                yield self.path, f"gguf:{info.name}", torch.empty(0)
                continue
            if slices is not None and name in slices and slices[name] is None:
                continue
            t = self.tensor(info)
            if permuted and (".q_proj." in name or ".k_proj." in name):
                t = unpermute(t, num_heads if ".q_proj." in name else num_kv_heads)
            if slices is not None and (sl := slices.get(name)) is not None:
                t = t.narrow(sl[0], sl[1], sl[2])
            yield self.path, name, t


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """A parsed :class:`GGUFFile`, shared by the config, tokenizer and weight loading of one
    model (parsed once; re-parsed when the file changes)."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e})") from None
    return _open_cached(str(p), st.st_mtime_ns, st.st_size)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` of q/k rows (``(n_head, 2, d/2) -> (n_head, d/2, 2)``
    per head): back to HF's rotate-half order."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (HF -> GGUF order), for writing test files."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, d, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
