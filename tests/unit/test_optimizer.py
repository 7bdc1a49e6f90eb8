"""--optimizer adam and sgd (training/optimizer.py) on the tiny GPT MoE model in one process,
built as the trainer builds it (Megatron's DDP, Megatron-Core's optimizer, the schedule): each
parameter's update is the one its optimizer's formula gives for the gradients set, with
Megatron-LM's parameter groups (no weight decay on 1-D parameters unless
--apply-wd-to-qk-layernorm takes the query/key layernorms in; --decoupled-lr's own learning
rate on the embedding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
LR, DECOUPLED_LR, WD, EPS = 0.01, 0.05, 0.1, 1e-8
FLAGS = ["--config", str(REPO / "configs/gpt2_tiny_moe.yaml"), "--lr", str(LR),
         "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--clip-grad", "0",
         "--weight-decay", str(WD), "--qk-layernorm", "--adam-eps", str(EPS)]


def build(flags):
    from megatron_parm.training.arguments import parse_args
    from megatron_parm.training.trainer import build_model_and_optimizer

    args = parse_args(FLAGS + flags, world_size=1, reads_data=False)
    model, optimizer, _ = build_model_and_optimizer(args, vocab_size=128)
    return [(name, param) for chunk in model for name, param in chunk.named_parameters()], \
        optimizer


def step(params, optimizer, seed):
    """One optimizer step on seeded gradients: (parameters before, gradients)."""
    generator = torch.Generator().manual_seed(seed)
    before, grads = {}, {}
    for name, param in params:
        grads[name] = torch.randn(param.shape, generator=generator)
        param.main_grad.copy_(grads[name])
        before[name] = param.detach().clone()
    optimizer.step()
    return before, grads


def decays(name, param, qk_layernorm: bool) -> bool:
    qk = ".q_layernorm." in name or ".k_layernorm." in name
    return param.dim() > 1 or (qk_layernorm and qk)


def lr_of(name, decoupled: bool) -> float:
    return DECOUPLED_LR if decoupled and "word_embeddings" in name else LR


@pytest.mark.parametrize("flags, qk_decay, decoupled", [
    ([], False, False),
    (["--apply-wd-to-qk-layernorm", "--decoupled-lr", str(DECOUPLED_LR)], True, True),
])
def test_adam_steps_as_adamw(megatron_world, flags, qk_decay, decoupled):
    params, optimizer = build(["--optimizer", "adam"] + flags)
    before, grads = step(params, optimizer, seed=1)
    assert any(".q_layernorm." in name for name, _ in params)
    for name, param in params:
        lr, wd = lr_of(name, decoupled), WD if decays(name, param, qk_decay) else 0.0
        # the first step of AdamW: bias-corrected moments g and g^2, decay decoupled
        expected = before[name] * (1 - lr * wd) - lr * grads[name] / (grads[name].abs() + EPS)
        torch.testing.assert_close(param.detach(), expected, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("flags, qk_decay", [
    ([], False),
    # Megatron-LM's deprecated spelling of --apply-wd-to-qk-layernorm
    (["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"], True),
])
def test_sgd_steps_with_momentum(megatron_world, flags, qk_decay):
    momentum = 0.8
    params, optimizer = build(["--optimizer", "sgd", "--sgd-momentum", str(momentum)] + flags)
    first, grads1 = step(params, optimizer, seed=1)
    second, grads2 = step(params, optimizer, seed=2)
    for name, param in params:
        wd = WD if decays(name, param, qk_decay) else 0.0
        buffer = grads1[name] + wd * first[name]  # weight decay is part of SGD's gradient
        torch.testing.assert_close(second[name], first[name] - LR * buffer, rtol=1e-5,
                                   atol=1e-7, msg=name)
        buffer = momentum * buffer + grads2[name] + wd * second[name]
        torch.testing.assert_close(param.detach(), second[name] - LR * buffer, rtol=1e-5,
                                   atol=1e-7, msg=name)
