"""Parm's automatic dispatcher: the performance model picks a candidate schedule (and chunks)."""

from __future__ import annotations

import logging
import warnings
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import utils

from megatron_parm import schedules
from megatron_parm.comm.accounting import ranks_per_node
from megatron_parm.dispatchers.base import ParmTokenDispatcher
from megatron_parm.perf_model import Choice, LayerShape, Layout, choose_schedule, load_profile
from megatron_parm.perf_model.profile import resolve_profile
from megatron_parm.platform import device

logger = logging.getLogger(__name__)

# Used with a warning where no --parm-profile is given: the shipped estimate for the machine kind.
DEFAULT_PROFILES = {"cuda": "nvlink_ib_estimate", "cpu": "emulated_pcie"}


def default_profile_path() -> str:
    return resolve_profile(DEFAULT_PROFILES["cuda" if device.is_cuda() else "cpu"])


class ParmAutoTokenDispatcher(ParmTokenDispatcher):
    """parm: per layer, the performance model predicts every candidate schedule of the
    catalog (parm_s1, parm_s2 at several chunk counts, ...) and the fastest one runs.

    Workflow: at the first dispatch of a token count n (known only then), build the layer's
    shape (n, M, F, E, k, capacity, dtype) and layout (t, e, s, nodes from
    --parm-ranks-per-node or LOCAL_WORLD_SIZE),
    ask ``choose_schedule`` with the profile of --parm-profile (or the default estimate, with
    a warning) for the schedule and, for a chunked one, its forward and backward chunk
    counts; check that every rank chose the same, log the choice once, and from then on run
    that schedule's workflow (see its dispatcher's docstring).
    The inputs of the choice are the same on every rank, so the choice is too.
    Where the EP and ESP groups both have one rank (e.g. world size 1) there is nothing to
    overlap or deduplicate: it runs the first unchunked candidate (parm_s1, which then only
    permutes, computes and unpermutes) without asking the model or the other ranks.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        from megatron_parm.dispatchers import dispatcher_class

        self.attn_tp_size = utils.get_pg_size(self.attn_tp_group)
        self.etp_size = utils.get_pg_size(self.etp_group)
        runnable = schedules.supported_candidates(self.attn_tp_size, self.ep_size, self.etp_size,
                                                  bool(config.sequence_parallel))
        # One dispatcher per candidate schedule that can run this layout.
        self.schedules: Dict[str, ParmTokenDispatcher] = {
            s.name: dispatcher_class(s.name)(num_local_experts, local_expert_indices, config,
                                             pg_collection)
            for s in runnable}
        self.active: ParmTokenDispatcher = next(iter(self.schedules.values()))
        # Nothing to hide: every group this dispatcher communicates on has one rank.
        self.nothing_to_hide = self.ep_size == 1 and self.etp_size == 1
        self.sequential = next((s.name for s in runnable if not s.chunked), None)
        self.layer_number: Optional[int] = None
        self.choices: Dict[int, object] = {}  # tokens per rank -> perf_model.Choice
        self.profile = self._load_profile(getattr(config, "parm_profile", None))

    @staticmethod
    def _load_profile(path: Optional[str]):
        if path:
            return load_profile(path)  # a bad or missing file is an error naming path and field
        default = default_profile_path()
        warnings.warn(f"--parm-profile not given: the automatic dispatcher uses the default "
                      f"profile {default} (estimates; run tools/calibrate.py for your cluster)")
        return load_profile(default)

    @property
    def pipelined(self) -> bool:
        return self.active.pipelined

    @property
    def choice(self):
        """The latest perf_model.Choice (schedule, predicted times), or None before the first call."""
        return self.choices[self._last_tokens] if self.choices else None

    def _layout(self) -> Layout:
        world = dist.get_world_size()
        per_node = ranks_per_node(world, getattr(self.config, "parm_ranks_per_node", None))
        return Layout(tp=self.attn_tp_size, ep=self.ep_size, etp=self.etp_size,
                      nodes=world // per_node, ranks_per_node=per_node)

    def _choose(self, num_tokens: int, dtype: torch.dtype, where: torch.device) -> None:
        self._last_tokens = num_tokens
        if num_tokens in self.choices:
            choice = self.choices[num_tokens]
        elif self.nothing_to_hide and self.sequential:
            choice = Choice(self.sequential, {}, {}, reason="every EP and ESP group has one rank: "
                                                            "nothing to overlap")
            self.choices[num_tokens] = choice
        else:
            cfg = self.config
            shape = LayerShape(
                num_tokens=num_tokens, hidden_size=cfg.hidden_size,
                ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                num_experts=self.num_experts, topk=self.topk,
                capacity_factor=cfg.moe_expert_capacity_factor, pad_to_capacity=self.drop_and_pad,
                dtype_bytes=dtype.itemsize,
                gated_linear_unit=bool(cfg.gated_linear_unit))
            requested = getattr(cfg, "parm_num_chunks", None)
            requested_bwd = getattr(cfg, "parm_bwd_num_chunks", None)
            extra = ()
            if (requested or 0) > 1 or (requested_bwd or 0) > 1:  # the flags' pair is tried too
                pair = (requested or requested_bwd, requested_bwd or requested)
                extra = (pair,) if min(pair) > 1 else ()
            choice = choose_schedule(shape, self._layout(), self.profile,
                                     sequence_parallel=bool(cfg.sequence_parallel),
                                     extra_chunks=extra)
            self._check_agreement(choice, where)
            self.choices[num_tokens] = choice
            if dist.get_rank() == 0:
                logger.info("parm: layer %s, %d tokens per rank: %s", self.layer_number, num_tokens,
                            choice.describe())
        self.active = self.schedules[choice.dispatcher]
        if self.active.pipelined:
            self.active.num_chunks, self.active.bwd_num_chunks = choice.num_chunks, choice.bwd_num_chunks

    def _check_agreement(self, choice, where: torch.device) -> None:
        """Once per token count: every rank chose the same (on ``where``, the rows' device,
        as NCCL needs; the comparison below is a host sync, paid on the first call only)."""
        # The choice as three integers: the schedule's place in the catalog, and its chunks.
        code = torch.tensor([list(self.schedules).index(choice.dispatcher), choice.num_chunks,
                             choice.bwd_num_chunks], dtype=torch.long, device=where)
        low, high = code.clone(), code.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError("parm: ranks chose different schedules; the performance model's "
                               "inputs (profile, shapes, ranks per node) must be the same on all ranks")

    # -- the six phases (and S2's pipeline) of the chosen schedule ------------------------

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._choose(hidden_states.numel() // hidden_states.shape[-1], hidden_states.dtype,
                     hidden_states.device)
        return self.active.dispatch_preprocess(hidden_states, routing_map, probs)

    def token_dispatch(self, hidden_states, probs):
        return self.active.token_dispatch(hidden_states, probs)

    def dispatch_postprocess(self, hidden_states, probs):
        return self.active.dispatch_postprocess(hidden_states, probs)

    def combine_preprocess(self, hidden_states):
        return self.active.combine_preprocess(hidden_states)

    def token_combine(self, hidden_states):
        return self.active.token_combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return self.active.combine_postprocess(hidden_states)

    def dispatch_compute_combine(self, rows, row_probs, expert_fn):
        return self.active.dispatch_compute_combine(rows, row_probs, expert_fn)
