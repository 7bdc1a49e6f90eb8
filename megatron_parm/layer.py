"""ParmMoELayer: Megatron-Core's MoELayer with Parm's dispatchers selectable by name."""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_parm import schedules
from megatron_parm.comm.collectives import gather_replicated, keep_shard, start_all_reduce
from megatron_parm.dispatchers import build_dispatcher
from megatron_parm.layout_rules import shared_expert_overlap_problem

# With a Parm dispatcher, ParmMoELayer.forward is its own copy of MoELayer.forward of this
# Megatron-Core version (sha256 of that method's dedented source): Megatron's routing,
# shared experts, the six dispatcher phases and MoE-layer recompute in the same order, plus
# what MoELayer cannot do (below). tests/unit/test_layer.py fails when the installed
# MoELayer.forward differs: compare the two, follow the change here, then update both values.
UPSTREAM_FORWARD_VERSION = "0.16.1"
UPSTREAM_FORWARD_SHA256 = "678e4125b86598ea173e17a2a4421605d1d8e068ca9e2d37ea8415c89de17e41"
# MoELayer's fwd_execution_map when the whole layer runs (partial CUDA graphs shorten it).
FULL_EXECUTION_MAP = ["route", "expert_compute", "postprocess"]


class ParmMoELayer(MoELayer):
    """A drop-in MoELayer (same constructor) that also accepts Parm's dispatchers.

    config.moe_token_dispatcher_type picks the dispatcher from the schedule catalog
    (megatron_parm/schedules.py): Megatron's own (``allgather``, ``alltoall``: the layer is
    then exactly MoELayer), or one of the project's (``ds_baseline``, ``parm_s1``, ``parm_s2``,
    ``parm``, ...), whose layout rules are checked here. With a non-native dispatcher and
    TP > 1 without sequence parallelism, the input is replicated over TP: the layer routes
    only this rank's sequence shard and restores the full output with one AG [TP], so no TP
    rank repeats another's work.

    Why the layer keeps its own forward rather than MoELayer's: MoELayer.forward refuses TP > 1
    without sequence parallelism in training (the shard-and-gather above replaces that), and a
    pipelined schedule fuses dispatch, experts and combine into one call. Upstream branches the
    copy does not follow are refused, not dropped: partial CUDA-graph capture
    (``intermediate_tensors``, a shortened ``fwd_execution_map``) and the fp8 / fp4 MoE-layer
    recompute through Transformer Engine's checkpoint.
    """

    def __init__(self, config: TransformerConfig, submodules: Optional[MoESubmodules] = None,
                 layer_number: Optional[int] = None, pg_collection=None):
        name = config.moe_token_dispatcher_type
        schedule = schedules.get(name)
        if schedule.kind == schedules.NATIVE:
            super().__init__(config, submodules, layer_number, pg_collection)
            return
        # MoELayer builds its dispatcher from the config: let it build the cheapest native
        # one from a shadow config, then put ours and the real config in place.
        shadow = copy.copy(config)
        shadow.moe_token_dispatcher_type = "allgather"
        super().__init__(shadow, submodules, layer_number, pg_collection)
        for module in self.modules():
            if getattr(module, "config", None) is shadow:
                module.config = config
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        schedule.check_layout(pg_collection.tp.size(), pg_collection.ep.size(),
                              pg_collection.expt_tp.size(), config.sequence_parallel)
        self.token_dispatcher = build_dispatcher(name, self.num_local_experts,
                                                 self.local_expert_indices, config, pg_collection)
        self.token_dispatcher.layer_number = layer_number
        if pg_collection.tp.size() > 1 and not config.sequence_parallel:
            # The replicated input is routed shard by shard (forward), so each TP rank's router
            # grads hold only its shard's part, and without sequence parallelism Megatron's
            # finalize_model_grads sums nothing over TP: sum them here, before they accumulate,
            # so that every TP rank holds its replica's grads, as with sequence parallelism.
            tp_group = pg_collection.tp
            for param in self.router.parameters():
                param.register_hook(lambda grad: start_all_reduce(grad, tp_group, "tp").wait())
        if self.use_shared_expert and self.shared_expert_overlap:
            problem = shared_expert_overlap_problem(pg_collection.tp.size(),
                                                    config.sequence_parallel)
            if problem:
                raise ValueError(problem)
            self.token_dispatcher.set_shared_experts(self.shared_experts)
        if self.moe_layer_recompute and (config.fp8 or config.fp4):
            raise ValueError("--recompute-modules moe with fp8 / fp4 is not supported with "
                             f"--moe-token-dispatcher-type {name}")
        # Megatron-Core's combined 1F1B runs the combine node (which restores a replicated
        # output) on its communication stream: its AG [TP] gets a group of its own there.
        self._gather_group = None
        if self.replicated_input and config.overlap_moe_expert_parallel_comm:
            from megatron_parm.parallel import twin_group

            self._gather_group = twin_group(self.attn_tp_group)
        self._node_shard = None  # (layer input, its TP shard) of the nodes' last route call
        self._forward_sharded = False  # forward runs the steps (on_shard)

    def set_layer_number(self, layer_number: int):
        super().set_layer_number(layer_number)
        if self.uses_parm_dispatcher:
            self.token_dispatcher.layer_number = layer_number

    @property
    def uses_parm_dispatcher(self) -> bool:
        return not schedules.is_native(self.config.moe_token_dispatcher_type)

    @property
    def replicated_input(self) -> bool:
        """The layer input is replicated over TP (TP > 1 without sequence parallelism) and a
        Parm dispatcher routes this rank's shard of it."""
        return (self.uses_parm_dispatcher and self.attn_tp_group.size() > 1
                and not self.config.sequence_parallel)

    # -- the steps Megatron-Core's combined 1F1B nodes call one by one ---------------------
    # (its attention node: shared_experts_compute, route, preprocess; its combine node:
    # combine, postprocess), with the layer's input as it comes: a replicated one is sharded
    # and its output gathered here, as forward does.

    @contextlib.contextmanager
    def on_shard(self):
        """Inside, forward runs route, preprocess and postprocess on the shard it made."""
        self._forward_sharded = True
        try:
            yield
        finally:
            self._forward_sharded = False

    def _node_path(self) -> bool:
        return self.replicated_input and not self._forward_sharded

    def _shard(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self._node_path():
            return hidden_states
        if self._node_shard is None or self._node_shard[0] is not hidden_states:
            self._node_shard = (hidden_states, keep_shard(hidden_states, self.attn_tp_group, "tp"))
        return self._node_shard[1]

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return super().route(self._shard(hidden_states), padding_mask)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor,
                   routing_map: torch.Tensor):
        hidden_states, self._node_shard = self._shard(hidden_states), None
        return super().preprocess(hidden_states, probs, routing_map)

    def postprocess(self, output: torch.Tensor, shared_expert_output: Optional[torch.Tensor]):
        if not self._node_path():
            return super().postprocess(output, shared_expert_output)
        output = gather_replicated(super().postprocess(output, None),
                                   self._gather_group or self.attn_tp_group, "tp")
        return output if shared_expert_output is None else output + shared_expert_output

    # -- forward --------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        if not self.uses_parm_dispatcher:
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        if intermediate_tensors is not None or self.fwd_execution_map != FULL_EXECUTION_MAP:
            raise ValueError("partial CUDA-graph capture of the MoE layer is not supported "
                             f"with --moe-token-dispatcher-type {self.config.moe_token_dispatcher_type}")
        replicated = self.replicated_input
        shared_whole = None
        if replicated and self.use_shared_expert:
            # The shared experts take the replicated input whole, as in Megatron's dense MLP;
            # their output joins the routed experts' once that is gathered again.
            shared_whole = self.shared_experts_compute(hidden_states)
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        if replicated:
            # Keep this rank's shard (backward: AG), as sequence parallelism would.
            hidden_states = keep_shard(hidden_states, self.attn_tp_group, "tp")
            if padding_mask is not None:
                rows = hidden_states.shape[0]
                start = self.attn_tp_group.rank() * rows
                padding_mask = padding_mask[start : start + rows]

        def moe(hidden_states, padding_mask):
            with self.on_shard():
                return steps(hidden_states, padding_mask)

        def steps(hidden_states, padding_mask):
            shared_output = None if replicated else self.shared_experts_compute(hidden_states)
            probs, routing_map = self.route(hidden_states, padding_mask)
            hidden_states, probs = self.preprocess(hidden_states, probs, routing_map)
            if self.token_dispatcher.pipelined:
                # The one place the layer takes a pipelined schedule's fused call (the
                # catalog's ``pipelined``); MoELayer's dispatch, routed_experts_compute and
                # combine stay the six phases, for callers that run them one by one.
                output = self.token_dispatcher.dispatch_compute_combine(hidden_states, probs,
                                                                        self.experts)
                mlp_bias = None
            else:
                dispatched, probs = self.dispatch(hidden_states, probs)
                output, mlp_bias = self.routed_experts_compute(dispatched, probs)
                output = self.combine(output)
            return self.postprocess(output, shared_output), mlp_bias

        if self.moe_layer_recompute:
            output, mlp_bias = tensor_parallel.checkpoint(moe, False, hidden_states, padding_mask)
        else:
            output, mlp_bias = moe(hidden_states, padding_mask)
        if replicated:
            # One AG [TP] restores the replicated output (backward: keep this rank's shard).
            output = gather_replicated(output, self.attn_tp_group, "tp")
            if shared_whole is not None:
                output = output + shared_whole
        return output, mlp_bias
