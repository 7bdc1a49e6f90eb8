"""The routers' losses in the log, as Megatron-LM's track_moe_metrics reports them: the losses
Megatron-Core's routers track per layer (before their coefficients), reduced over the ranks,
averaged over the MoE layers for the iteration line and TensorBoard, and per layer with
--moe-per-layer-logging.

    router_loss_names(args)     the tracker's names for these flags (load_balancing_loss, ...)
    RouterLosses(args)
      .take(steps, microbatches) {name: [each layer's value per iteration since the last take]};
                                clears the tracker. Collective
      .scalars(per_layer, per_layer_logging)   TensorBoard's values: '<name>' (the mean over the
                                MoE layers) and 'moe/<name>_layer_<i>' (i: the layer's index
                                from 0, dense layers 0)
    console_name(name)          'load balancing loss': the name in the iteration line
"""

from __future__ import annotations

from typing import Dict, List

import torch

from megatron_parm import device
from megatron_parm.training import mtp
from megatron_parm.training.flops import moe_layer_pattern

# The router's logged losses per --moe-router-load-balancing-type (Megatron-Core's tracker
# names), and the z-loss's.
BALANCING_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                        "global_aux_loss": "global_load_balancing_loss"}
Z_LOSS_NAME = "z_loss"


def router_loss_names(args) -> list:
    """The names Megatron-Core's routers track their losses under for these flags (one per
    --moe-router-load-balancing-type given, in Megatron-LM's order)."""
    if not args.num_experts:
        return []
    types = args.moe_router_load_balancing_type
    types = types if isinstance(types, list) else [types]
    names = [name for kind, name in BALANCING_LOSS_NAMES.items() if kind in types]
    return names + ([Z_LOSS_NAME] if args.moe_z_loss_coeff else [])


def console_name(name: str) -> str:
    return name.replace("_", " ")


def reduced_layer_values(name: str, num_layers: int) -> torch.Tensor:
    """One tracked loss per layer [num_layers], summed over the micro-batches since the tracker
    was last cleared, reduced as Megatron-LM does: summed over the router's reduce group (the
    TP ranks that share the token counts), averaged over the others. Collective over every
    rank (a stage without an MoE layer takes part with zeros)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    # A layer's values are on the ranks of its pipeline stage only.
    ranks_per_stage = (torch.distributed.get_world_size()
                       // parallel_state.get_pipeline_model_parallel_world_size())
    entry = get_moe_layer_wise_logging_tracker().get(name)
    if entry is None:
        values = torch.zeros(num_layers, device=device.current())
    else:
        values = entry["values"].detach().float().clone()  # on the device: NCCL reduces it
        entry["values"].zero_()
        if entry.get("reduce_group") is not None:
            torch.distributed.all_reduce(values, group=entry["reduce_group"])
    torch.distributed.all_reduce(values)
    return device.to_host(values) / ranks_per_stage


class RouterLosses:
    """The tracked router losses of one training run (see the module docstring)."""

    def __init__(self, args):
        self.names = router_loss_names(args)
        # Megatron-Core's routers track the MTP layers' MoE layers after the transformer
        # layers'; Megatron-LM's mean counts every MTP layer as an MoE layer.
        self.num_layers = mtp.model_layers(args)
        self.num_moe_layers = max(sum(moe_layer_pattern(args)) + (args.mtp_num_layers or 0), 1)

    def take(self, num_steps: int, num_microbatches: int) -> Dict[str, List[float]]:
        """Each tracked loss per layer, per iteration: its mean over the NUM_MICROBATCHES
        micro-batches of the NUM_STEPS iterations since the last take. Collective."""
        scale = 1.0 / max(num_microbatches, 1)
        return {name: (reduced_layer_values(name, self.num_layers) * scale).tolist()
                for name in self.names}

    def means(self, per_layer: Dict[str, List[float]]) -> Dict[str, float]:
        """Each loss's mean over the MoE layers (Megatron-LM divides by their number)."""
        return {name: sum(values) / self.num_moe_layers for name, values in per_layer.items()}

    def scalars(self, per_layer: Dict[str, List[float]], per_layer_logging: bool) -> dict:
        values = dict(self.means(per_layer))
        if per_layer_logging:
            for name, layers in per_layer.items():
                values.update({f"moe/{name}_layer_{index}": value
                               for index, value in enumerate(layers)})
        return values
