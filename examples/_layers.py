"""The transformer pieces the example drafts are built from: random weights, seeded, nothing downloaded.

One decoder layer in the usual Llama shape: RMSNorm, grouped-query attention with rotary positions over
a KV cache that the layer writes itself, SwiGLU MLP. The cache is a module buffer: torch.compile marks
tensor attributes of modules as static inputs, which is what lets a CUDA graph capture the in-place
cache writes (a mutated input that is not static makes Inductor skip CUDA graphs).

Attention takes the rope positions, the cache slots to write and the attention mask separately, so a
chain (slot = position, causal mask) and a tree (several nodes per depth, each seeing only its own
ancestors) use the same layer.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class Config:
    dim: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    vocab: int
    cache_len: int  # KV cache length: the prefix plus every slot a draft writes
    rope_base: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# "reference" is the size the project's GPU numbers are quoted at (a Llama-3-8B-shaped layer and vocabulary).
SIZES = {
    "tiny": Config(dim=64, n_heads=4, n_kv_heads=2, intermediate=128, vocab=512, cache_len=64),
    "reference": Config(dim=4096, n_heads=32, n_kv_heads=8, intermediate=14336, vocab=128256, cache_len=2048),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rope_table(cfg: Config) -> torch.Tensor:
    """cos and sin for every position a cache slot can hold: [cache_len, head_dim // 2, 2]."""
    inv_freq = 1.0 / cfg.rope_base ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.cache_len).float(), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of x [B, T, H, head_dim] by the angles whose cos and sin are [T, 1, head_dim // 2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    rotated = torch.stack(
        [pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1
    )
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Config, batch: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.register_buffer("rope", _rope_table(cfg), persistent=False)
        # Random contents stand in for the prefix this layer has already seen; a draft writes behind it.
        cache_shape = (batch, cfg.n_kv_heads, cfg.cache_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.randn(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.randn(cache_shape), persistent=False)

    def forward(
        self, x: torch.Tensor, rope_pos: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T, dim]; rope_pos and write_slots [T] (int64); mask [B or 1, 1, T, cache_len] (bool)."""
        batch, length, _ = x.shape
        cos, sin = self.rope[rope_pos, None].unbind(-1)
        q = _apply_rope(self.wq(x).view(batch, length, self.n_heads, self.head_dim), cos, sin)
        k, v = self.wkv(x).view(batch, length, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k = _apply_rope(k, cos, sin)
        self.k_cache.index_copy_(2, write_slots, k.transpose(1, 2))
        self.v_cache.index_copy_(2, write_slots, v.transpose(1, 2))
        group = self.n_heads // self.n_kv_heads
        keys = self.k_cache.repeat_interleave(group, dim=1)
        values = self.v_cache.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(cfg.dim, 2 * cfg.intermediate, bias=False)
        self.w_down = nn.Linear(cfg.intermediate, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, batch: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg, batch)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), MLP(cfg)

    def forward(
        self, x: torch.Tensor, rope_pos: torch.Tensor, write_slots: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), rope_pos, write_slots, mask)
        return h + self.mlp(self.mlp_norm(h))


def causal_mask(cache_len: int, pos: torch.Tensor) -> torch.Tensor:
    """[1, 1, 1, cache_len]: the prefix up to and including `pos` (a one-element int64 tensor)."""
    return (torch.arange(cache_len, device=pos.device) <= pos).view(1, 1, 1, -1)
