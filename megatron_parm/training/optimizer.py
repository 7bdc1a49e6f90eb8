"""The optimizer, as Megatron-LM's training builds it from its flags: Megatron-Core 0.16.1's
get_megatron_optimizer does the work (a dense and an expert optimizer, chained; fp32 main
parameters with --bf16 / --fp16; sharded with --use-distributed-optimizer).

    optimizer_config(args)      Megatron-Core's OptimizerConfig for the flags
    build_optimizer(args, model)     the optimizer of the model chunks (in Megatron's DDP)

What the flags choose (the flags are declared in megatron_parm.settings.optimizer):
  --optimizer adam             Adam with decoupled weight decay (torch's AdamW here; Apex's or
                               Transformer Engine's FusedAdam where installed), --adam-beta1,
                               --adam-beta2, --adam-eps;
  --optimizer sgd              SGD with --sgd-momentum (torch's; the fused one where installed);
  weight decay                 none on 1-D parameters and biases (the layernorms), and with
                               --apply-wd-to-qk-layernorm on the query and key layernorms too;
  --decoupled-lr               the input embedding's and output layer's parameter group gets its
                               own peak (and --decoupled-min-lr minimum) learning rate, which
                               the schedule (training/schedule.py) follows per group.
Megatron-Core's Muon (--optimizer muon / dist_muon) needs a package that does not install here:
settings refuses it.
"""

from __future__ import annotations

from megatron.core.optimizer import (
    OptimizerConfig,
    get_megatron_optimizer,
    get_standard_config_overrides,
)

from megatron_parm.training import mixed_precision


def optimizer_config(args) -> OptimizerConfig:
    """The OptimizerConfig Megatron-LM's training builds from the same flags."""
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay, apply_wd_to_qk_layernorm=args.apply_wd_to_qk_layernorm,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        barrier_with_L1_time=args.barrier_with_L1_time,
        **mixed_precision.optimizer_fields(args))


def build_optimizer(args, model):
    """Megatron-Core's optimizer of MODEL (this rank's chunks, each in Megatron's DDP), with
    Megatron-LM's parameter groups: no weight decay on 1-D parameters and biases (unless
    --apply-wd-to-qk-layernorm), --decoupled-lr's own group."""
    config = optimizer_config(args)
    return get_megatron_optimizer(config, model,
                                  config_overrides=get_standard_config_overrides(config))
