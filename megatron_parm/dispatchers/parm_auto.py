"""Parm's automatic dispatcher: the performance model picks S1 or S2 (and S2's chunks)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron.core import utils

from megatron_parm.dispatchers.base import ParmTokenDispatcher
from megatron_parm.dispatchers.parm_s1 import ParmS1TokenDispatcher
from megatron_parm.dispatchers.parm_s2 import ParmS2TokenDispatcher
from megatron_parm.perf_model import LayerShape, Layout, choose_schedule, load_profile

logger = logging.getLogger(__name__)

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "profiles"
# Used with a warning where no --parm-profile is given: the estimate for the machine kind.
DEFAULT_PROFILES = {"cuda": "nvlink_ib_estimate.yaml", "cpu": "emulated_pcie.yaml"}


def default_profile_path() -> Path:
    return PROFILE_DIR / DEFAULT_PROFILES["cuda" if torch.cuda.is_available() else "cpu"]


class ParmAutoTokenDispatcher(ParmTokenDispatcher):
    """parm: per layer, the performance model predicts S1 and S2(c) and the faster one runs.

    Workflow: at the first dispatch of a token count n (known only then), build the layer's
    shape (n, M, F, E, k, capacity, dtype) and layout (t, e, s, nodes from LOCAL_WORLD_SIZE),
    ask ``choose_schedule`` with the profile of --parm-profile (or the default estimate, with
    a warning), check that every rank chose the same, log the choice once, and from then on
    run that schedule's workflow (see ParmS1TokenDispatcher and ParmS2TokenDispatcher).
    The inputs of the choice are the same on every rank, so the choice is too.
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.s1 = ParmS1TokenDispatcher(num_local_experts, local_expert_indices, config, pg_collection)
        self.s2 = ParmS2TokenDispatcher(num_local_experts, local_expert_indices, config, pg_collection)
        self.active: ParmTokenDispatcher = self.s1
        self.layer_number: Optional[int] = None
        self.choices: Dict[int, object] = {}  # tokens per rank -> perf_model.Choice
        self.profile = self._load_profile(getattr(config, "parm_profile", None))
        self.attn_tp_size = utils.get_pg_size(self.attn_tp_group)
        self.etp_size = utils.get_pg_size(self.etp_group)

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
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world
        if world % per_node:
            per_node = world
        return Layout(tp=self.attn_tp_size, ep=self.ep_size, etp=self.etp_size,
                      nodes=world // per_node, ranks_per_node=per_node)

    def _choose(self, num_tokens: int, dtype: torch.dtype) -> None:
        self._last_tokens = num_tokens
        if num_tokens in self.choices:
            choice = self.choices[num_tokens]
        else:
            cfg = self.config
            shape = LayerShape(
                num_tokens=num_tokens, hidden_size=cfg.hidden_size,
                ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size,
                num_experts=self.num_experts, topk=self.topk,
                capacity_factor=cfg.moe_expert_capacity_factor, pad_to_capacity=self.drop_and_pad,
                dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
                gated_linear_unit=bool(cfg.gated_linear_unit))
            candidates = sorted({2, 4, 8, int(getattr(cfg, "parm_num_chunks", 4))} - {1})
            choice = choose_schedule(shape, self._layout(), self.profile, chunk_candidates=tuple(candidates))
            self._check_agreement(choice)
            self.choices[num_tokens] = choice
            if dist.get_rank() == 0:
                logger.info("parm: layer %s, %d tokens per rank: %s", self.layer_number, num_tokens,
                            choice.describe())
        if choice.dispatcher == "parm_s2":
            self.s2.num_chunks = choice.num_chunks
            self.active = self.s2
        else:
            self.active = self.s1

    def _check_agreement(self, choice) -> None:
        code = torch.tensor([choice.num_chunks if choice.dispatcher == "parm_s2" else 1], dtype=torch.long)
        low, high = code.clone(), code.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if low.item() != high.item():
            raise RuntimeError("parm: ranks chose different schedules; the performance model's "
                               "inputs (profile, shapes, LOCAL_WORLD_SIZE) must be the same on all ranks")

    # -- the six phases (and S2's pipeline) of the chosen schedule ------------------------

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self._choose(hidden_states.numel() // hidden_states.shape[-1], hidden_states.dtype)
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
        return self.s2.dispatch_compute_combine(rows, row_probs, expert_fn)
