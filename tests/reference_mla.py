"""A plain single-process multi-latent attention (DeepSeek-V2/V3's MLA): the ground truth
tests/unit/test_mla.py and tests/distributed/modern_moe_worker.py check Megatron-Core's
MLASelfAttention (with megatron_parm.attention.MLADotProductAttention) against.

No process groups, no Megatron, DeepSeek's formulas with Megatron-Core's names:

    q        x q_proj^T, or q_up(norm(x q_down^T)) with a query latent (q_lora_rank)
    latent   x kv_down^T = [c (kv_lora_rank), k_pe (pos)]; kv = norm(c) kv_up^T
    heads    q = [q_nope (dk), q_pe (pos)] per head, kv = [k_nope (dk), v (dv)] per head
    rope     plain rotary (rope_type rope) on q_pe and on k_pe, one k_pe shared by every head;
             DeepSeek's checkpoints pair channels (0, 1), (2, 3), ...: de-interleaved first
    scores   [q_nope, q_pe] . [k_nope, k_pe] x softmax_scale, causal, softmax
    output   (probabilities v, heads side by side) proj^T

The norms are RMSNorms (with --qk-layernorm; identities without). Notation: s sequence, b
micro-batch, h hidden, n heads, dk qk_head_dim, pos qk_pos_emb_head_dim, dv v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class MLAShape:
    hidden: int
    heads: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    qk_layernorm: bool = True
    eps: float = 1e-6
    rotary_base: float = 10000.0

    @property
    def softmax_scale(self) -> float:
        return (self.qk_head_dim + self.qk_pos_emb_head_dim) ** -0.5

    def weight_shapes(self) -> Dict[str, tuple]:
        """Megatron-Core's parameter names (in MLASelfAttention) and their whole shapes."""
        n, h, pos = self.heads, self.hidden, self.qk_pos_emb_head_dim
        q_out = n * (self.qk_head_dim + pos)
        shapes = {"linear_kv_down_proj.weight": (self.kv_lora_rank + pos, h),
                  "linear_kv_up_proj.weight": (n * (self.qk_head_dim + self.v_head_dim),
                                               self.kv_lora_rank),
                  "linear_proj.weight": (h, n * self.v_head_dim)}
        if self.q_lora_rank is None:
            shapes["linear_q_proj.weight"] = (q_out, h)
        else:
            shapes["linear_q_down_proj.weight"] = (self.q_lora_rank, h)
            shapes["linear_q_up_proj.weight"] = (q_out, self.q_lora_rank)
        if self.qk_layernorm:
            shapes["kv_layernorm.weight"] = (self.kv_lora_rank,)
            if self.q_lora_rank is not None:
                shapes["q_layernorm.weight"] = (self.q_lora_rank,)
        return shapes


def random_weights(shape: MLAShape, generator: torch.Generator) -> Dict[str, torch.Tensor]:
    weights = {}
    for name, size in shape.weight_shapes().items():
        if name.endswith("layernorm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(*size, generator=generator)
        else:
            weights[name] = torch.randn(*size, generator=generator) * size[-1] ** -0.5
    return weights


def _rms_norm(x, weight, eps):
    if weight is None:
        return x
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(t, base: float):
    """t [s, b, heads, pos], DeepSeek's interleaved pairs: de-interleave, then rotate halves."""
    s, pos = t.shape[0], t.shape[-1]
    t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    inv_freq = 1.0 / base ** (torch.arange(0, pos, 2, dtype=torch.float32) / pos)
    angles = torch.arange(s, dtype=torch.float32)[:, None] * inv_freq  # [s, pos / 2]
    cos, sin = (torch.cat([f, f], dim=-1)[:, None, None, :] for f in (angles.cos(),
                                                                      angles.sin()))
    rotated = torch.cat([-t[..., pos // 2:], t[..., :pos // 2]], dim=-1)
    return t * cos + rotated * sin


def mla_forward(x: torch.Tensor, weights: Dict[str, torch.Tensor], shape: MLAShape
                ) -> torch.Tensor:
    """x [s, b, h] -> [s, b, h]: causal multi-latent self-attention."""
    s, b, _ = x.shape
    n, dk, pos, dv = shape.heads, shape.qk_head_dim, shape.qk_pos_emb_head_dim, shape.v_head_dim
    if shape.q_lora_rank is None:
        q = x @ weights["linear_q_proj.weight"].t()
    else:
        latent = _rms_norm(x @ weights["linear_q_down_proj.weight"].t(),
                           weights.get("q_layernorm.weight"), shape.eps)
        q = latent @ weights["linear_q_up_proj.weight"].t()
    q_nope, q_pe = q.view(s, b, n, dk + pos).split([dk, pos], dim=-1)
    compressed, k_pe = (x @ weights["linear_kv_down_proj.weight"].t()).split(
        [shape.kv_lora_rank, pos], dim=-1)
    kv = _rms_norm(compressed, weights.get("kv_layernorm.weight"), shape.eps) \
        @ weights["linear_kv_up_proj.weight"].t()
    k_nope, v = kv.view(s, b, n, dk + dv).split([dk, dv], dim=-1)
    query = torch.cat([q_nope, _rope(q_pe, shape.rotary_base)], dim=-1)
    k_pe = _rope(k_pe.view(s, b, 1, pos), shape.rotary_base).expand(s, b, n, pos)
    key = torch.cat([k_nope, k_pe], dim=-1)
    context = attention(query, key, v, shape.softmax_scale)
    return context @ weights["linear_proj.weight"].t()


def attention(query, key, value, scale: float, mask: Optional[torch.Tensor] = None):
    """query, key [s, b, n, dk], value [s, b, n, dv] -> [s, b, n dv]; mask [b or 1, 1, s, s]
    True where a query must not see a key (default: the causal mask)."""
    s, b, n, dv = value.shape
    scores = torch.einsum("sbnd,tbnd->bnst", query, key) * scale
    if mask is None:
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bnst,tbnd->sbnd", probs, value).reshape(s, b, n * dv)
