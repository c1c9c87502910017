"""Inference forward for a tinylm (Qwen2-architecture) checkpoint, with a slot-based KV cache.

Why not ``Qwen2ForCausalLM`` with its own cache: batching sequences of different lengths through
Hugging Face caches means rebuilding padded caches every step through an API that changes
between transformers releases. This module reads the same weights and does the same arithmetic
(RMSNorm, rotary embeddings, grouped-query attention with q/k/v biases, SiLU-gated MLP, tied or
untied head; checked against ``Qwen2ForCausalLM`` in the tests) but owns its cache:

- the cache is one preallocated tensor per layer, ``[slots, kv_heads, max_len, head_dim]``;
  each running sequence holds a slot, and its token at position ``p`` lives at index ``p``;
- ``forward`` takes any mix of chunks, a prefill (a whole prompt) or a decode step (one token),
  and runs them as **one** forward: projections and MLPs on the packed ``[tokens, hidden]``
  matrix, attention on a padded ``[chunks, max_chunk_len]`` view with a per-chunk causal mask
  over that chunk's slot;
- everything is fp32 on CPU. Not thread-safe: one scheduler thread owns a runtime.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tinylm.errors import ConfigError

__all__ = ["Chunk", "ModelShape", "TinyLMRuntime", "read_checkpoint"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers a forward needs, read from ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, source: str) -> ModelShape:
        if config.get("model_type") != "qwen2":
            raise ConfigError(
                f"{source}: model_type must be 'qwen2', got {config.get('model_type')!r}"
            )
        rope = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
        if (rope.get("rope_type") or "default") != "default" or config.get("rope_scaling"):
            raise ConfigError(f"{source}: only default rotary embeddings are supported")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(config["max_position_embeddings"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as exc:
            raise ConfigError(f"{source}: missing key {exc.args[0]!r}") from exc


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens of one sequence to run this step.

    ``tokens`` go to positions ``start .. start + len(tokens) - 1`` of ``slot``; positions below
    ``start`` must already be in the cache. ``logits_from`` asks for logits at chunk positions
    ``logits_from ..`` the end (prompt logprobs need them); by default only the last position's
    are returned.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    logits_from: int | None = None


@dataclass(frozen=True, slots=True)
class _Layer:
    input_norm: torch.Tensor
    q_w: torch.Tensor
    q_b: torch.Tensor
    k_w: torch.Tensor
    k_b: torch.Tensor
    v_w: torch.Tensor
    v_b: torch.Tensor
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_w: torch.Tensor
    up_w: torch.Tensor
    down_w: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TinyLMRuntime:
    """Batched fp32 forward over a slot KV cache (see the module docstring)."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        shape: ModelShape,
        *,
        max_slots: int,
        max_len: int | None = None,
    ) -> None:
        if max_slots < 1:
            raise ConfigError(f"max_slots must be at least 1, got {max_slots}")
        self.shape = shape
        self.max_slots = max_slots
        self.max_len = min(max_len or shape.max_position_embeddings, shape.max_position_embeddings)

        self._bind(weights)
        cache_shape = (max_slots, shape.num_kv_heads, self.max_len, shape.head_dim)
        self._k_cache = [torch.zeros(cache_shape) for _ in range(shape.num_layers)]
        self._v_cache = [torch.zeros(cache_shape) for _ in range(shape.num_layers)]
        dim = shape.head_dim
        self._inv_freq = 1.0 / (
            shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )

    def _bind(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take the tensors a forward reads from ``weights`` (HF Qwen2 names), as fp32.

        Every tensor is read before any attribute is set, so a checkpoint missing one leaves
        the weights already bound whole.
        """
        shape = self.shape

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ConfigError(f"tinylm checkpoint has no tensor {name!r}")
            return weights[name].detach().to(torch.float32).contiguous()

        embed = w("model.embed_tokens.weight")
        head = embed if shape.tie_word_embeddings else w("lm_head.weight")
        final_norm = w("model.norm.weight")
        layers: list[_Layer] = []
        for i in range(shape.num_layers):
            p = f"model.layers.{i}."
            layers.append(
                _Layer(
                    input_norm=w(p + "input_layernorm.weight"),
                    q_w=w(p + "self_attn.q_proj.weight"),
                    q_b=w(p + "self_attn.q_proj.bias"),
                    k_w=w(p + "self_attn.k_proj.weight"),
                    k_b=w(p + "self_attn.k_proj.bias"),
                    v_w=w(p + "self_attn.v_proj.weight"),
                    v_b=w(p + "self_attn.v_proj.bias"),
                    o_w=w(p + "self_attn.o_proj.weight"),
                    post_norm=w(p + "post_attention_layernorm.weight"),
                    gate_w=w(p + "mlp.gate_proj.weight"),
                    up_w=w(p + "mlp.up_proj.weight"),
                    down_w=w(p + "mlp.down_proj.weight"),
                )
            )
        for name, t in (("model.embed_tokens.weight", embed), ("lm_head.weight", head)):
            if t.shape != (shape.vocab_size, shape.hidden_size):
                raise ConfigError(
                    f"tinylm checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected "
                    f"{(shape.vocab_size, shape.hidden_size)}"
                )
        self._embed, self._head, self._final_norm, self._layers = embed, head, final_norm, layers

    def replace_weights(self, weights: Mapping[str, torch.Tensor], shape: ModelShape) -> None:
        """Serve ``weights`` from the next forward on (``/update_weights_from_disk``).

        The architecture must be the one loaded (the KV cache and every slot depend on it);
        ``ConfigError`` names what differs, and a failed update leaves the old weights whole.
        Not thread-safe: the scheduler thread calls it between two forwards.
        """
        if shape != self.shape:
            diff = {
                f: (getattr(self.shape, f), getattr(shape, f))
                for f in ModelShape.__dataclass_fields__
                if getattr(self.shape, f) != getattr(shape, f)
            }
            raise ConfigError(
                "new weights have another architecture than the served model "
                f"(field: (served, new)): {diff}"
            )
        self._bind(weights)

    @classmethod
    def load(
        cls, model_dir: str | Path, *, max_slots: int, max_len: int | None = None
    ) -> TinyLMRuntime:
        """Read ``config.json`` and ``model.safetensors`` from a Hugging Face model folder."""
        root = Path(model_dir)
        weights, shape = read_checkpoint(root)
        return cls(weights, shape, max_slots=max_slots, max_len=max_len)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self._inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Run ``chunks`` as one forward; per chunk, logits ``[rows, vocab]`` (see ``Chunk``)."""
        if not chunks:
            return []
        s = self.shape
        lengths = [len(c.tokens) for c in chunks]
        for c, n in zip(chunks, lengths, strict=True):
            if n == 0:
                raise ValueError(f"empty chunk for slot {c.slot}")
            if not 0 <= c.slot < self.max_slots:
                raise ValueError(f"slot {c.slot} outside 0..{self.max_slots - 1}")
            if c.logits_from is not None and not 0 <= c.logits_from < n:
                raise ValueError(f"slot {c.slot}: logits_from {c.logits_from} outside the chunk")
            if c.start < 0 or c.start + n > self.max_len:
                raise ValueError(
                    f"slot {c.slot}: positions {c.start}..{c.start + n - 1} outside the "
                    f"{self.max_len}-token context"
                )
        batch, q_len = len(chunks), max(lengths)
        k_len = max(c.start + n for c, n in zip(chunks, lengths, strict=True))

        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long)
        row = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
        col = torch.tensor([i for n in lengths for i in range(n)], dtype=torch.long)
        starts = torch.tensor([c.start for c in chunks], dtype=torch.long)
        slots = torch.tensor([c.slot for c in chunks], dtype=torch.long)
        positions = starts[row] + col
        tok_slot = slots[row]
        cos, sin = self._rope(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]

        # Query i of chunk b sees cache positions 0 .. start_b + i. Padded query rows (i past the
        # chunk's end) get a harmless non-empty mask so softmax never sees an all-masked row.
        q_pos = starts[:, None] + torch.arange(q_len)[None, :]
        mask = torch.arange(k_len)[None, None, :] <= q_pos[:, :, None]
        mask = mask[:, None, :, :]

        x = self._embed[ids]
        tokens = x.shape[0]
        for layer, k_cache, v_cache in zip(self._layers, self._k_cache, self._v_cache, strict=True):
            h = _rms_norm(x, layer.input_norm, s.rms_norm_eps)
            q = F.linear(h, layer.q_w, layer.q_b).view(tokens, s.num_heads, s.head_dim)
            k = F.linear(h, layer.k_w, layer.k_b).view(tokens, s.num_kv_heads, s.head_dim)
            v = F.linear(h, layer.v_w, layer.v_b).view(tokens, s.num_kv_heads, s.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache[tok_slot, :, positions] = k
            v_cache[tok_slot, :, positions] = v

            q_pad = q.new_zeros(batch, q_len, s.num_heads, s.head_dim)
            q_pad[row, col] = q
            keys = k_cache[slots, :, :k_len]
            values = v_cache[slots, :, :k_len]
            attn = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
            )
            attn = attn.transpose(1, 2)[row, col].reshape(tokens, s.num_heads * s.head_dim)
            x = x + F.linear(attn, layer.o_w)

            h = _rms_norm(x, layer.post_norm, s.rms_norm_eps)
            x = x + F.linear(
                F.silu(F.linear(h, layer.gate_w)) * F.linear(h, layer.up_w), layer.down_w
            )

        picked: list[torch.Tensor] = []
        end = 0
        for c, n in zip(chunks, lengths, strict=True):
            end += n
            first = end - 1 if c.logits_from is None else end - n + c.logits_from
            picked.append(x[first:end])
        hidden = _rms_norm(torch.cat(picked), self._final_norm, s.rms_norm_eps)
        logits = F.linear(hidden, self._head)
        return list(torch.split(logits, [p.shape[0] for p in picked]))


def read_checkpoint(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], ModelShape]:
    """The tensors of ``model.safetensors`` and the shape of ``config.json`` in an HF folder."""
    from safetensors.torch import load_file

    root = Path(model_dir)
    config_path, weights_path = root / "config.json", root / "model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ConfigError(f"{root}: not a tinylm model folder (missing {path.name})")
    shape = ModelShape.from_config(json.loads(config_path.read_text()), source=str(config_path))
    return load_file(str(weights_path)), shape
