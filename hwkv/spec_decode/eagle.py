"""EAGLE proposer: a one-layer draft head over the target's hidden states (vLLM's ``eagle`` method,
EAGLE-1 checkpoints as SafeAILab publishes them and vLLM's ``EagleLlamaForCausalLM`` loads them).

Head: ``g = layer(fc(concat(embed(x_{p+1}), h_p)))``, draft logits ``= lm_head(g)``, where ``h_p`` is
the target's final (normed) hidden state at position ``p`` and ``x_{p+1}`` the token after it.
Checkpoint names: ``fc.weight`` ``[H, 2H]`` (``fc.bias`` optional), ``layers.0.self_attn.{q,k,v,o}_proj``,
``layers.0.mlp.{gate,up,down}_proj``, ``layers.0.post_attention_layernorm``; optional
``layers.0.input_layernorm`` (EAGLE-1 has none on its only layer), ``embed_tokens`` and ``norm``
(absent: the target's embedding / no final norm) and ``lm_head`` (absent: the target's). A
``model.`` prefix on names is accepted. ``config.json`` is a Llama config (any ``architectures``).

Per step, for every request in the batch (prefill chunks included) the head consumes the pairs
``(x_{p+1}, h_p)`` of the positions the target verified this step, writing its own KV at ``p`` (its
paged cache is indexed by the target's block ids); a request that sampled then drafts ``k`` tokens
autoregressively, feeding back its own output state. The head's KV at the positions of its drafts is
recomputed from the target's states in the next step, so it never goes stale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hwkv.engine.inputs import build_batch
from hwkv.engine.kv_alloc import check_backend
from hwkv.engine.spec_config import ProposerTarget, SpeculativeConfig
from hwkv.model.config import ModelConfig
from hwkv.model.layers import Linear
from hwkv.model.loader import ModelLoadError, iter_weights, weight_files
from hwkv.spec_decode.eagle3 import is_eagle3, load_eagle3_head
from hwkv.spec_decode.head_body import headless_llama
from hwkv.spec_decode.proposer import Proposer, RunnerView
from hwkv.spec_decode.state_graphs import HeadGraphRunner


class EagleHead(nn.Module):
    def __init__(self, config: Any, backend: Any, device: torch.device, dtype: torch.dtype, max_positions: int,
                 fc_bias: bool, has_input_norm: bool, has_norm: bool):
        super().__init__()

        self.inner = headless_llama(config, backend, device, dtype, max_positions)
        h = config.hidden_size
        self.fc = Linear(2 * h, h, fc_bias, device, dtype)
        self.has_input_norm, self.has_norm = has_input_norm, has_norm
        self.embed: torch.Tensor | None = None  # set by bind(): own or the target's
        self.lm_head: torch.Tensor | None = None

    @property
    def config(self) -> Any:
        return self.inner.config

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
                attn_metadata: Any, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Output states ``[T, H]`` of the pairs ``(input_ids[t], hidden[t])`` at ``positions[t]``."""
        x = self.fc(torch.cat([F.embedding(input_ids, self.embed), hidden.to(self.fc.weight.dtype)], -1))
        out = None
        for i, layer in enumerate(self.inner.model.layers):
            if out is None:
                a = layer.input_layernorm(x) if self.has_input_norm else x
            else:
                a, x = layer.input_layernorm(out, x)
            out = layer.self_attn(a, positions, self.inner.rotary_emb, kv_cache.layer(i), attn_metadata, slot_mapping)
            a, x = layer.post_attention_layernorm(out, x)
            out = layer.mlp(a)
        return x + out

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        if self.has_norm:
            g = self.inner.model.norm(g)
        return F.linear(g, self.lm_head).float()

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the target's vocabulary

    def target_states(self, target: Any, h: torch.Tensor) -> torch.Tensor:
        return target.model.norm(h)  # the final normed states (what the target's lm_head reads)


def read_head(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(config.json, tensors by name without a 'model.' prefix)`` of the head at ``path``."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"EAGLE head {path}: config.json not found")
    tensors = {name.removeprefix("model."): t for _, name, t in iter_weights(weight_files(path))}
    if "fc.weight" not in tensors:
        raise ModelLoadError(f"EAGLE head {path}: no 'fc.weight' tensor (is this an EAGLE head? "
                             f"found {sorted(tensors)[:6]}...)")
    return json.loads(cfg_path.read_text()), tensors


def load_eagle_head(path: str, raw: dict[str, Any], tensors: dict[str, torch.Tensor], backend: Any,
                    dtype: torch.dtype, max_positions: int) -> tuple[EagleHead, dict]:
    """The EAGLE-1 head at ``path`` and its own optional tensors (``embed``, ``lm_head``) by name."""
    raw = dict(raw, architectures=["LlamaForCausalLM"])  # EAGLE-1 heads are Llama layers whatever their name
    config = ModelConfig.from_dict(raw, source=str(Path(path) / "config.json"))
    tensors = dict(tensors)
    device = backend.device.torch_device
    head = EagleHead(config, backend, device, dtype, max_positions, "fc.bias" in tensors,
                     "layers.0.input_layernorm.weight" in tensors, "norm.weight" in tensors)
    slots = head.inner.weight_slots()
    own: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        head.fc.weight.copy_(_shaped(tensors.pop("fc.weight"), head.fc.weight, "fc.weight", path))
        if head.fc.bias is not None:
            head.fc.bias.copy_(_shaped(tensors.pop("fc.bias"), head.fc.bias, "fc.bias", path))
        for name, t in tensors.items():
            if name in ("embed_tokens.weight", "lm_head.weight"):
                own[name] = t
                continue
            key = "model." + name
            if key not in slots:
                raise ModelLoadError(f"EAGLE head {path}: unexpected tensor {name!r}")
            slots[key].copy_(_shaped(t, slots[key], name, path))
    optional = {"model.layers.0.input_layernorm.weight", "model.norm.weight"}  # EAGLE-1 has neither
    need = [n for n in slots if n not in optional]
    missing = [n for n in need if n.removeprefix("model.") not in tensors]
    if missing:
        raise ModelLoadError(f"EAGLE head {path}: checkpoint lacks {missing[:4]}")
    return head.eval(), own


def _shaped(t: torch.Tensor, dst: torch.Tensor, name: str, path: str) -> torch.Tensor:
    if tuple(t.shape) != tuple(dst.shape):
        raise ModelLoadError(f"EAGLE head {path}: {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
    return t


class EagleProposer(Proposer):
    needs_hidden = True

    def __init__(self, head: EagleHead | Any, backend: Any, k: int, eagle3: bool = False):
        self.head, self.backend, self.k = head, backend, k
        # EAGLE-3 reads states inside the target's layers: the fused decode ops would skip them
        self.needs_plain_forward = eagle3
        self.kv_cache: Any = None
        self.graphs: Any = None  # the head's one-token draft steps (enable_graphs), where the target has graphs
        self.num_graph_steps = 0

    @classmethod
    def load(cls, cfg: SpeculativeConfig, on: ProposerTarget) -> EagleProposer:
        target, tc = on.model, on.model.config
        raw, tensors = read_head(cfg.model)
        v3 = is_eagle3(cfg.model, tensors)
        if v3 != (cfg.method == "eagle3"):
            kind, other = ("an EAGLE-3", "eagle3") if v3 else ("an EAGLE-1", "eagle")
            raise ValueError(f"speculative_config: {cfg.model} is {kind} head (allowed: method {other!r} for it)")
        if raw.get("hidden_size") != tc.hidden_size:
            raise ValueError(f"EAGLE head {cfg.model} has hidden_size {raw.get('hidden_size')}, the target "
                             f"{tc.hidden_size} (allowed: a head trained for this target)")
        if v3:
            head, own = load_eagle3_head(cfg.model, raw, tensors, on.backend, target)
        else:
            head, own = load_eagle_head(cfg.model, raw, tensors, on.backend, target.dtype, tc.max_model_len)
        dev = target.lm_head_weight.device
        head.embed = own["embed_tokens.weight"].to(dev, target.dtype) if "embed_tokens.weight" in own \
            else target.model.embed_tokens.weight
        head.lm_head = own["lm_head.weight"].to(dev, target.dtype) if "lm_head.weight" in own else target.lm_head_weight
        draft_vocab = head.lm_head.shape[0]
        if "d2t" in own:
            if tuple(own["d2t"].shape) != (draft_vocab,):
                raise ValueError(f"EAGLE head {cfg.model}: d2t has shape {tuple(own['d2t'].shape)}, the head's "
                                 f"lm_head has {draft_vocab} rows")
            head.d2t = own["d2t"].to(dev, torch.long)
        elif draft_vocab != tc.vocab_size:
            raise ValueError(f"EAGLE head {cfg.model}: lm_head has {draft_vocab} rows and no d2t maps them to the "
                             f"target's {tc.vocab_size} (allowed: a d2t tensor, or the target's vocabulary)")
        for name, w in (("embed_tokens", head.embed), ("lm_head", head.lm_head)):
            if w.shape[1] != tc.hidden_size or (name == "embed_tokens" and w.shape[0] != tc.vocab_size):
                raise ValueError(f"EAGLE head {cfg.model}: {name} has shape {tuple(w.shape)}, which does not fit the "
                                 f"target (vocab {tc.vocab_size}, hidden {tc.hidden_size})")
        return cls(head, on.backend, cfg.num_speculative_tokens, eagle3=v3)

    def target_states(self, target: Any, h: torch.Tensor) -> torch.Tensor:
        return self.head.target_states(target, h)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.head.inner.kv_cache_spec(1, block_size).bytes_per_block

    def allocate(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if self.head.config.max_model_len < max_model_len:
            raise ValueError(f"EAGLE head's max length {self.head.config.max_model_len} is shorter than the "
                             f"engine's max_model_len {max_model_len} (allowed: lower max_model_len)")
        check_backend(self.backend, self.head.inner, block_size)
        spec = self.head.inner.kv_cache_spec(num_blocks, block_size)
        self.kv_cache = self.backend.device.allocate_kv_cache(spec, self.backend.attention.kv_layout)
        for t in self.kv_cache.tensors:  # positions it never wrote (prefix-cache hits) read as zeros
            t.zero_()

    def enable_graphs(self, runner: RunnerView, max_batch: int, use_graphs: bool = True) -> None:
        """Serve the head's one-token draft steps (every draft after the first) from captured graphs,
        bucketed like the target's (``use_graphs=False``: the same path run eagerly)."""
        self.graphs = HeadGraphRunner(self.head, self.kv_cache, runner.meta_builder, runner.dev, runner.block_size,
                                      max_batch, runner.max_model_len, use_graphs)
        self.graphs.capture()  # its own pool, as a draft model's graphs

    @torch.inference_mode()
    def propose_with_hidden(self, runner: RunnerView, states: list[Any], batch: Any, hidden: torch.Tensor,
                            valid: np.ndarray, sample_rows: np.ndarray, caps: list[int]) -> list[list[int]]:
        """Consume this step's verified pairs of every row, then draft for the rows in ``sample_rows``.

        ``hidden``: the target's normed final states ``[T, H]`` of ``batch``'s tokens; ``valid[i]``:
        how many leading query tokens of row ``i`` were verified (accepted drafts included)."""
        ctx = batch.positions[batch.query_start_loc[:-1].astype(np.int64)] if len(states) else np.zeros(0, np.int64)
        slots = np.fromiter((st.slot for st in states), dtype=np.int64, count=len(states))
        ntok = np.fromiter((st.num_tokens for st in states), dtype=np.int64, count=len(states))
        n = np.minimum(valid, ntok - 1 - ctx)  # pairs need the token after p
        rows = np.flatnonzero(n > 0)
        out: list[list[int]] = [[] for _ in sample_rows]
        if not len(rows):
            return out
        src = np.concatenate([batch.query_start_loc[i] + np.arange(n[i]) for i in rows])
        to_dev = lambda a: runner.dev.to_device(torch.from_numpy(np.asarray(a, dtype=np.int64)))  # noqa: E731
        h = hidden.index_select(0, to_dev(src))
        g = self._forward(runner, slots[rows], ctx[rows], n[rows], h)  # [len(rows)] last output states
        pos_in = {int(r): j for j, r in enumerate(rows)}
        live = [(j, int(i), caps[j]) for j, i in enumerate(sample_rows) if caps[j] > 0 and int(i) in pos_in]
        if not live:
            return out
        g = g.index_select(0, to_dev([pos_in[i] for _, i, _ in live]))
        s_slots = slots[[i for _, i, _ in live]]
        s_ntok = ntok[[i for _, i, _ in live]]
        cap = np.array([c for _, _, c in live])
        drafts = [self.head.to_target(self.head.logits(g).argmax(-1))]  # on the device: fed back without a read
        for j in range(1, int(cap.max())):  # pair (draft j, own state) at position num_tokens - 2 + j
            keep = np.flatnonzero(cap > j)
            kt = None if len(keep) == len(cap) else to_dev(keep)
            g_in, feed = (g, drafts[-1]) if kt is None else (g.index_select(0, kt), drafts[-1].index_select(0, kt))
            gk = self._forward(runner, s_slots[keep], s_ntok[keep] + j - 2, np.ones(len(keep), np.int64), g_in,
                               feed=feed)
            g = gk if kt is None else g.index_copy(0, kt, gk)
            nxt = self.head.to_target(self.head.logits(gk).argmax(-1))
            drafts.append(nxt if kt is None else torch.zeros_like(drafts[0]).index_copy(0, kt, nxt))
        d = torch.stack(drafts, 1).cpu().numpy()  # the one host read of the drafts
        for r, (j, _, c) in enumerate(live):
            out[j] = d[r, :c].tolist()
        return out

    def _forward(self, runner: RunnerView, slots: np.ndarray, ctx: np.ndarray, qlen: np.ndarray,
                 hidden: torch.Tensor, feed: torch.Tensor | None = None) -> torch.Tensor:
        """Head states at the last of each row's pairs ``(x_{p+1}, h_p)``, ``p`` in ``[ctx, ctx + qlen)``;
        ``feed`` (one pair per row): the rows' tokens ``x_{p+1}`` on the device (the token table is not read)."""
        # pairs take the token after each position: the token table seen one column to the left
        batch = build_batch(runner.token_ids[:, 1:], runner.block_table, slots, ctx, qlen, ctx + qlen,
                            runner.block_size)
        if feed is not None and self.graphs is not None and batch.pure_decode:
            g = self.graphs.run(batch, self.graphs.feeder(feed, hidden))
            if g is not None:
                self.num_graph_steps += 1
                return g
        inp = runner.device_inputs(batch)
        if feed is not None:
            inp.input_ids.copy_(feed)
        g = self.head(inp.input_ids, hidden, inp.positions, self.kv_cache, inp.attn_metadata, inp.slot_mapping)
        return g.index_select(0, inp.logits_indices)
