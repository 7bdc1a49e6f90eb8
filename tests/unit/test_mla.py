"""Multi-latent attention on Megatron-Core's local spec, in one process (world size 1):

* megatron_parm.attention.MLADotProductAttention (key and value heads of their own widths)
  against a plain attention (tests/reference_mla.py), outputs and gradients, with the causal
  and a padding mask; against Megatron-Core's DotProductAttention where the widths are equal
  (bitwise: the same computation);
* Megatron-Core's MLASelfAttention built from this project's layer spec (the swapped core
  attention) against the plain MLA, outputs and the gradients of the input and every weight,
  with and without a query latent;
* the specs swap the core attention of MLA layers only.

Tensor and sequence parallelism: tests/distributed/modern_moe_worker.py (its MLA records).
"""

from __future__ import annotations

import pytest
import torch

from reference_mla import MLAShape, attention, mla_forward, random_weights

S, B, HEADS, DK, DV = 8, 2, 4, 12, 8
SHAPES = {"no query latent": MLAShape(hidden=32, heads=4, kv_lora_rank=16, qk_head_dim=8,
                                      qk_pos_emb_head_dim=4, v_head_dim=8),
          "query latent": MLAShape(hidden=32, heads=4, kv_lora_rank=16, qk_head_dim=8,
                                   qk_pos_emb_head_dim=4, v_head_dim=6, q_lora_rank=12)}
TIGHT = dict(rtol=1e-5, atol=1e-6)  # fp32: the order of the sums differs, nothing else


def mla_config(shape: MLAShape, **extra):
    from megatron_parm.config import ParmMLATransformerConfig

    fields = dict(
        num_layers=1, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        q_lora_rank=shape.q_lora_rank, kv_lora_rank=shape.kv_lora_rank,
        qk_head_dim=shape.qk_head_dim, qk_pos_emb_head_dim=shape.qk_pos_emb_head_dim,
        v_head_dim=shape.v_head_dim, rope_type="rope", rotary_base=shape.rotary_base,
        normalization="RMSNorm", layernorm_epsilon=shape.eps, qk_layernorm=shape.qk_layernorm,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, transformer_impl="local")
    return ParmMLATransformerConfig(**{**fields, **extra})


def core_attention(cls, k_channels, v_channels, widths=True):
    """CLS (the project's or Megatron's) for heads of these widths; widths: hand them to it as
    MLASelfAttention does (Megatron's takes none, and sizes its output by --kv-channels)."""
    from megatron.core.transformer.enums import AttnMaskType

    shape = MLAShape(hidden=32, heads=HEADS, kv_lora_rank=16, qk_head_dim=k_channels - 4,
                     qk_pos_emb_head_dim=4, v_head_dim=v_channels)
    extra = dict(k_channels=k_channels, v_channels=v_channels) if widths else {}
    return cls(mla_config(shape, kv_channels=v_channels), layer_number=1,
               attn_mask_type=AttnMaskType.causal, attention_type="self",
               softmax_scale=0.3, **extra)


def qkv(dk, dv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, HEADS, width, generator=gen).requires_grad_()
            for width in (dk, dk, dv)]


def run(module, tensors, mask=None):
    out = module(*tensors, mask)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
    return [out.detach()] + [t.grad for t in tensors]


@pytest.mark.parametrize("masked", ["causal", "padding"])
def test_core_attention_matches_a_plain_attention(megatron_world, masked):
    from megatron_parm.attention import MLADotProductAttention

    module = core_attention(MLADotProductAttention, DK, DV)
    mask = None
    if masked == "padding":  # the second sample's last 3 keys are padding, and causal
        mask = torch.ones(S, S, dtype=torch.bool).triu(1).repeat(B, 1, 1, 1)
        mask[1, :, :, S - 3:] = True
    ours = run(module, qkv(DK, DV), mask)
    reference = qkv(DK, DV)
    out = attention(*reference, 0.3, mask)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out).sin())
    assert ours[0].shape == (S, B, HEADS * DV)
    for mine, theirs in zip(ours, [out.detach()] + [t.grad for t in reference]):
        torch.testing.assert_close(mine, theirs, **TIGHT)


def test_core_attention_is_megatrons_local_one_where_the_widths_agree(megatron_world):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_parm.attention import MLADotProductAttention

    ours = run(core_attention(MLADotProductAttention, DV, DV),
               qkv(DV, DV))
    megatron = run(core_attention(DotProductAttention, DV, DV, widths=False), qkv(DV, DV))
    for mine, theirs in zip(ours, megatron):
        assert torch.equal(mine, theirs)


def build_mla(shape: MLAShape, weights):
    from megatron.core.transformer.spec_utils import build_module

    from megatron_parm.specs import get_gpt_layer_parm_spec

    spec = get_gpt_layer_parm_spec(multi_latent_attention=True, normalization="RMSNorm",
                                   qk_layernorm=shape.qk_layernorm)
    module = build_module(spec.submodules.self_attention, config=mla_config(shape),
                          layer_number=1)
    params = dict(module.named_parameters())
    assert set(params) == set(weights), (sorted(params), sorted(weights))
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    return module, params


@pytest.mark.parametrize("name", list(SHAPES))
def test_megatron_mla_with_the_project_core_attention_matches_a_plain_mla(megatron_world, name):
    shape = SHAPES[name]
    gen = torch.Generator().manual_seed(5)
    weights = random_weights(shape, gen)
    x = torch.randn(S, B, shape.hidden, generator=gen)
    dy = torch.randn(S, B, shape.hidden, generator=gen)

    module, params = build_mla(shape, weights)
    ours_x = x.clone().requires_grad_()
    out, bias = module(ours_x, None)
    assert bias is None
    out.backward(dy)

    leaves = {key: value.clone().requires_grad_() for key, value in weights.items()}
    ref_x = x.clone().requires_grad_()
    ref = mla_forward(ref_x, leaves, shape)
    ref.backward(dy)
    torch.testing.assert_close(out.detach(), ref.detach(), **TIGHT)
    torch.testing.assert_close(ours_x.grad, ref_x.grad, **TIGHT)
    for key, leaf in leaves.items():
        torch.testing.assert_close(params[key].grad, leaf.grad, **TIGHT, msg=key)


def test_only_mla_layers_get_the_project_core_attention(megatron_world):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_parm.attention import MLADotProductAttention
    from megatron_parm.specs import gpt_block_spec, get_gpt_layer_parm_spec

    def core(spec):
        return spec.submodules.self_attention.submodules.core_attention

    assert core(get_gpt_layer_parm_spec(num_experts=4)) is DotProductAttention
    assert core(get_gpt_layer_parm_spec(num_experts=4, multi_latent_attention=True)) \
        is MLADotProductAttention
    config = mla_config(SHAPES["query latent"], num_moe_experts=4, moe_layer_freq=[0, 1],
                        num_layers=2)
    block = gpt_block_spec(config)
    assert [core(spec) for spec in block.layer_specs] == [MLADotProductAttention] * 2
