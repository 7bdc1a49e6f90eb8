"""Multi-token prediction (--mtp-num-layers, training/mtp.py) on the DeepSeek-V2-Lite-like tiny
model in one process, built as the trainer builds it: the losses Megatron-Core's MTP block
tracks (Megatron-LM's 'mtp_k loss') against a plain reference of what the block computes, and
the gradients of a training step against those of the language-model loss plus
--mtp-loss-scaling-factor / d times the reference's losses.

The reference, for depth k = 1..d (h_0: the decoder's output after its final norm):
    x_k = roll(tokens, -k) (the k-th next token; the last k positions 0)
    u_k = [rmsnorm(E[x_k]; enorm_k) ; rmsnorm(h_{k-1}; hnorm_k)] W_eh_k^T
    h_k = rmsnorm(layer_k(u_k); final_norm_k)      layer_k: the MTP layer's transformer layer
    loss_k = sum(mask_k * CE(h_k W_out^T, roll(labels, -k))) / sum(mask_k),
             mask_k = roll(loss_mask, -k) with the last k positions 0
written out with torch's functions on the model's weights; layer_k is the model's own
transformer layer (attention and MoE are checked elsewhere), called with the attention mask
and rotary embedding the block gives it. Also: the log's 'mtp_k loss' values, and the stages
--pipeline-model-parallel-layout builds (its MTP layers with the last transformer layers or in
a stage of their own).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
DEPTHS, FACTOR, VOCAB = 2, 0.3, 512
FLAGS = ["--config", str(REPO / "configs/deepseek_v2_lite_tiny_moe.yaml"),
         "--mtp-num-layers", str(DEPTHS), "--mtp-loss-scaling-factor", str(FACTOR),
         "--micro-batch-size", "2", "--seq-length", "32",
         # no aux loss: the reference calls the MTP layers' MoE layers a second time
         "--moe-router-load-balancing-type", "none"]


def build():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from megatron_parm.training import model as model_module
    from megatron_parm.training.arguments import parse_args

    args = parse_args(FLAGS, world_size=1, reads_data=False)
    model_parallel_cuda_manual_seed(1234)
    get_moe_layer_wise_logging_tracker().clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return args, model_module.build_model(args, VOCAB)


def batch(args):
    generator = torch.Generator().manual_seed(7)
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, VOCAB, (b, s + 1), generator=generator)
    loss_mask = (torch.rand(b, s, generator=generator) > 0.2).float()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=loss_mask,
                position_ids=torch.arange(s).expand(b, s))


def rms_norm(x, norm):
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def shifted(tensor, k):
    """Megatron-Core's roll: k places left along the sequence, the last k positions 0."""
    rolled = torch.roll(tensor, -k, dims=-1)
    rolled[..., -k:] = 0
    return rolled


def reference_losses(model, data, decoder_output, layer_calls):
    """[loss_k for k = 1..d] written out (module docstring); decoder_output [s, b, h]."""
    word_embeddings = model.embedding.word_embeddings.weight
    hidden, losses = decoder_output, []
    for k, layer in enumerate(model.mtp.layers, start=1):
        embedded = F.embedding(shifted(data["tokens"], k), word_embeddings).transpose(0, 1)
        joined = torch.cat([rms_norm(embedded, layer.enorm), rms_norm(hidden, layer.hnorm)], -1)
        projected = joined @ layer.eh_proj.weight.t()
        hidden = rms_norm(layer.transformer_layer(hidden_states=projected,
                                                  **layer_calls[k - 1])[0],
                          layer.final_layernorm)
        logits = hidden @ model.output_layer.weight.t()  # [s, b, V], untied output
        tokens_ce = F.cross_entropy(logits.transpose(0, 1).reshape(-1, logits.shape[-1]).float(),
                                    shifted(data["labels"], k).reshape(-1), reduction="none")
        mask = shifted(data["loss_mask"], k).reshape(-1)
        losses.append((tokens_ce * mask).sum() / mask.sum())
    return losses


def run(model, data, mtp_gradient_scale: float):
    """The model's forward and backward of the masked-mean language-model loss (its MTP losses
    joining the gradient at mtp_gradient_scale, Megatron's MTPLossAutoScaler); returns (the
    lm loss, the decoder's output, the kwargs of each MTP transformer layer's call)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    MTPLossAutoScaler.set_loss_scale(torch.tensor(mtp_gradient_scale))
    captured, calls = {}, []
    hooks = [model.decoder.register_forward_hook(
        lambda module, inputs, output: captured.setdefault("decoder", output))]
    for layer in model.mtp.layers:
        hooks.append(layer.transformer_layer.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(
                {key: kwargs[key] for key in ("attention_mask", "rotary_pos_emb")}),
            with_kwargs=True))
    try:
        losses_bs = model(data["tokens"], data["position_ids"], None, labels=data["labels"],
                          loss_mask=data["loss_mask"])
    finally:
        for hook in hooks:
            hook.remove()
    mask = data["loss_mask"]
    return (losses_bs * mask).sum() / mask.sum(), captured["decoder"], calls


def test_mtp_losses_and_gradients_match_the_plain_reference(megatron_world):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from megatron_parm.training.mtp import MtpLosses

    args, model = build()
    model.train()
    data = batch(args)
    assert len(model.mtp.layers) == DEPTHS
    assert model.mtp.layers[0].transformer_layer.layer_number == args.num_layers + 1

    # Megatron's step: the MTP losses join the gradient through the autoscaler
    logged = MtpLosses(DEPTHS)  # clears the tracker
    lm_loss, _, _ = run(model, data, mtp_gradient_scale=1.0)
    lm_loss.backward()
    tracked = MTPLossLoggingHelper.tracker["values"].clone()
    # the log's values, as Megatron-LM's track_mtp_metrics takes them (2 micro-batches: halved)
    assert logged.take(num_microbatches=2) == {f"mtp_{k + 1} loss": value / 2
                                               for k, value in enumerate(tracked.tolist())}
    assert not MTPLossLoggingHelper.tracker["values"].any()  # taken: reset
    megatron_grads = {name: p.grad.clone() for name, p in model.named_parameters()
                      if p.grad is not None}
    model.zero_grad()

    # the reference: the same forward with the autoscaler's gradient off, the MTP losses
    # written out and added to the language-model loss
    lm_again, decoder_output, calls = run(model, data, mtp_gradient_scale=0.0)
    references = reference_losses(model, data, decoder_output, calls)
    torch.testing.assert_close(lm_again, lm_loss, rtol=0, atol=0)
    torch.testing.assert_close(tracked, torch.stack(references).detach(), rtol=1e-5, atol=1e-6)
    (lm_again + FACTOR / DEPTHS * sum(references)).backward()
    reference_grads = {name: p.grad for name, p in model.named_parameters()
                       if p.grad is not None}
    assert set(reference_grads) == set(megatron_grads)
    assert any(name.startswith("mtp.layers.1.eh_proj") for name in megatron_grads)
    for name, grad in megatron_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # the MTP loss changed the gradients: without it they would be the lm loss's alone
    model.zero_grad()
    lm_only, _, _ = run(model, data, mtp_gradient_scale=0.0)
    lm_only.backward()
    word = "embedding.word_embeddings.weight"
    assert not torch.allclose(model.get_parameter(word).grad, megatron_grads[word], atol=1e-6)
    MTPLossLoggingHelper.tracker.clear()


# (layout, pp, --num-layers, --mtp-num-layers): the MTP layers with the last transformer layers,
# and in a stage of their own (Megatron-Core's mtp_standalone), on the DeepSeek-like model
# (layer 1 dense, 2-3 MoE)
STAGE_LAYOUTS = [("Et|t|t|mL", 2, 3, 1), ("Et|tt|mm|L", 4, 3, 2), ("Ettt|mL", 2, 3, 1)]


@pytest.mark.parametrize("layout,pp,num_layers,mtp_layers", STAGE_LAYOUTS,
                         ids=[case[0] for case in STAGE_LAYOUTS])
def test_layout_builds_the_stages_megatron_core_places(megatron_world, layout, pp, num_layers,
                                                       mtp_layers):
    """--pipeline-model-parallel-layout: on each (pipeline rank, virtual stage) the trainer's
    specs (specs.gpt_block_spec, mtp.block_spec) build the transformer and MTP layers of the
    layout's stage (layout_rules.pipeline_layout, itself checked against Megatron-Core's
    parser in test_training_args.py), with Megatron-Core's layer numbers and embedding / loss
    stages; a stage of MTP layers alone builds them of the model's last layer's kind (MoE)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import get_mtp_layer_offset

    from megatron_parm.layout_rules import pipeline_layout
    from megatron_parm.specs import gpt_block_spec
    from megatron_parm.training import mtp
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.model import build_config, expert_module_name

    args = parse_args(["--config", str(REPO / "configs/deepseek_v2_lite_tiny_moe.yaml"),
                       "--mtp-num-layers", str(mtp_layers), "--pipeline-model-parallel-size",
                       str(pp), "--pipeline-model-parallel-layout", layout,
                       "--global-batch-size", "16"], world_size=pp, reads_data=False)
    stages = pipeline_layout(layout, pp, num_layers, mtp_layers)
    vpp = len(stages[0])
    assert args.virtual_pipeline_model_parallel_size == (vpp if vpp > 1 else None)
    config = build_config(args)
    assert config.mtp_standalone == any("m" in stage and rank != pp - 1
                                        for rank, chunks in enumerate(stages) for stage in chunks)
    expert = expert_module_name(config)
    whole = gpt_block_spec(mtp.unpipelined(config), expert).layer_specs
    built = []
    try:
        parallel_state.set_pipeline_model_parallel_world_size(pp)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(args.
                                                                      virtual_pipeline_model_parallel_size)
        for rank in range(pp):
            parallel_state.set_pipeline_model_parallel_rank(rank)
            for chunk in range(vpp):
                vp_stage = chunk if vpp > 1 else None
                decoder = gpt_block_spec(config, expert, vp_stage)
                block = mtp.block_spec(config, decoder,
                                       lambda c: gpt_block_spec(c, expert), vp_stage)
                stage = stages[rank][chunk]
                assert len(decoder.layer_specs) == stage.count("t"), (rank, chunk)
                assert (0 if block is None else len(block.layer_specs)) == stage.count("m")
                assert parallel_state.is_pipeline_first_stage(False, vp_stage) == ("E" in stage)
                assert parallel_state.is_pipeline_last_stage(False, vp_stage) == ("L" in stage)
                built.append(("t" * len(decoder.layer_specs), decoder.layer_specs))
                if block is not None:
                    assert get_mtp_layer_offset(config, vp_stage) == 0
                    # the MTP layer's transformer layer: the whole model's last layer's spec
                    layer = block.layer_specs[0].submodules.transformer_layer
                    assert layer.submodules.mlp.module is whole[-1].submodules.mlp.module
    finally:
        parallel_state.set_pipeline_model_parallel_world_size(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    # the stages in the layout's order hold the model's layers in order, each once
    order = [built[rank * vpp + chunk] for chunk in range(vpp) for rank in range(pp)]
    assert [spec.submodules.mlp.module for _, specs in order for spec in specs] == \
        [spec.submodules.mlp.module for spec in whole]
