"""What Parm's dispatchers share: groups, local permutation and the routing plan.

Notation (as in docs/design.md):
    M: hidden size           n: tokens this rank routes (its sequence-parallel shard)
    E: experts               L: local experts (E / e)     k: top-k
    t: attention TP size     e: EP size                    s: ETP (ESP) size
    C: expert capacity (capacity factor f, padded to capacity)
    R: rows this rank dispatches = sum over experts of its routed rows

Group names used for byte accounting: "tp" (attention TP), "ep", "expt_tp" (ESP), and for
routing metadata "tp_ep_counts" / "ep_counts" (E integers per rank) and "tp_routing"
(ds_baseline's routing map, one byte per token and expert).

Devices: rows, probs and everything that indexes them live on the rows' device; the routing
counts are gathered there too (NCCL only moves device tensors) and brought to the host in one
copy per layer call (``_exchange_counts``): the one host synchronisation a dispatcher makes
itself, since the collectives need split sizes on the host, as Megatron's alltoall does.
From then on the plan (RoutingPlan, split sizes, chunk sizes, tokens per expert) is host
data, and index tensors built from it are copied to the rows' device without a host wait.
Megatron's ``permute`` (shared with alltoall) adds the synchronisation of its masked_select.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron.core import utils
from megatron.core.transformer.moe.moe_utils import get_capacity, permute, sort_chunks_by_idxs, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from megatron_parm.comm.collectives import all_to_all, start_all_gather
from megatron_parm.dispatchers import row_order
from megatron_parm import device as devices
from megatron_parm.device import HOST


@dataclass
class RoutingPlan:
    """Row counts of one dispatch, all on the host.

    counts[j][q][x]: rows the rank at (EP index j, ESP index q) sends to expert x.
    The ranks of this dispatch's EP group share one ESP index; ``me_ep``/``me_etp`` are
    this rank's indices. After the A2A [EP] and the AG [ESP] a rank holds, for its L local
    experts, blocks ordered [q][j][local expert] (``local_counts``).
    """

    counts: torch.Tensor  # [e, s, E] int64
    me_ep: int
    me_etp: int
    num_local_experts: int

    @property
    def ep_size(self) -> int:
        return self.counts.shape[0]

    @property
    def etp_size(self) -> int:
        return self.counts.shape[1]

    def mine(self) -> torch.Tensor:
        """[E] rows this rank sends to each expert (its permuted rows, in expert order)."""
        return self.counts[self.me_ep, self.me_etp]

    def local_counts(self) -> torch.Tensor:
        """[s, e, L]: rows ESP peer q's EP peer j sends to each local expert (gathered order)."""
        lo = self.me_ep * self.num_local_experts
        return self.counts[:, :, lo : lo + self.num_local_experts].transpose(0, 1)

    def a2a_input_splits(self) -> List[int]:
        """Rows this rank sends to each EP peer (its experts are contiguous)."""
        return self.mine().view(self.ep_size, self.num_local_experts).sum(dim=1).tolist()

    def a2a_output_splits(self) -> List[int]:
        """Rows this rank receives from each EP peer (same ESP index)."""
        return self.local_counts()[self.me_etp].sum(dim=1).tolist()

    def etp_split_sizes(self) -> List[int]:
        """Rows each ESP peer holds after its A2A (the AG/RS split sizes)."""
        return self.local_counts().sum(dim=(1, 2)).tolist()

    def gathered_chunk_sizes(self) -> torch.Tensor:
        """Rows after AG(ESP), as blocks ordered [q][j][local expert]."""
        return self.local_counts().reshape(-1)

    def tokens_per_local_expert(self) -> torch.Tensor:
        """[L] rows per local expert, on the host as Megatron's experts take them (SequentialMLP
        and TEGroupedMLP read them as a list; grouped_gemm's gmm needs its batch sizes on the CPU)."""
        return self.local_counts().sum(dim=(0, 1))

    def expert_order(self) -> Optional[torch.Tensor]:
        """Gather index that sorts the gathered rows [q][j][x] into [x][q][j] for the
        experts (host), or None where that order is already expert-major."""
        local = self.local_counts()
        if local.shape[2] == 1 or local.shape[0] * local.shape[1] == 1:
            return None
        starts = row_order.block_starts(local)
        return row_order.ranges(starts.permute(2, 0, 1), local.permute(2, 0, 1))


def sort_order(num_sources: int, num_local_experts: int) -> tuple:
    """Chunk orders that turn [source][local expert] into [local expert][source] and back
    (host tensors: Megatron's sort_chunks_by_idxs reads them as lists)."""
    idx = torch.arange(num_sources * num_local_experts, device=HOST)
    to_expert_major = idx.reshape(num_sources, num_local_experts).T.ravel()
    to_source_major = idx.reshape(num_local_experts, num_sources).T.ravel()
    return to_expert_major, to_source_major


def sort_by_local_expert(rows: torch.Tensor, probs: Optional[torch.Tensor], chunk_sizes: torch.Tensor,
                         num_local_experts: int):
    """[source][local expert] row chunks -> [local expert][source] (no reordering for one
    expert or one source). The rows come out contiguous: grouped GEMMs (grouped_gemm, TE)
    require it."""
    num_sources = chunk_sizes.numel() // num_local_experts
    if num_local_experts == 1 or num_sources == 1:
        return rows.contiguous(), probs
    order, _ = sort_order(num_sources, num_local_experts)
    return sort_chunks_by_idxs(rows, chunk_sizes, order, probs=probs)


def unsort_by_local_expert(rows: torch.Tensor, chunk_sizes: torch.Tensor, num_local_experts: int):
    """Inverse of ``sort_by_local_expert``; chunk_sizes as given to it."""
    num_sources = chunk_sizes.numel() // num_local_experts
    if num_local_experts == 1 or num_sources == 1:
        return rows
    _, order = sort_order(num_sources, num_local_experts)
    expert_major_sizes = chunk_sizes.reshape(num_sources, num_local_experts).T.ravel()
    return sort_chunks_by_idxs(rows, expert_major_sizes, order)[0]


# Megatron-Core's six phases, in the order a layer call runs them (the experts run between
# dispatch_postprocess and combine_preprocess), and the pipelined call that stands for
# token_dispatch through token_combine.
PHASES = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
          "combine_preprocess", "token_combine", "combine_postprocess")
PIPELINED_CALL = "dispatch_compute_combine"
# phase -> the phase that must have run just before it in the same layer call
_FOLLOWS = {**dict(zip(PHASES[1:], PHASES[:-1])), PIPELINED_CALL: "dispatch_preprocess"}


def _in_order(phase: str, method):
    """``method`` with the phase order checked (see ParmTokenDispatcher). A phase that raises
    leaves the order where it was: it may be run again, or a new layer call started."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._phase_running:  # a phase calling the one it overrides (super()): checked once
            return method(self, *args, **kwargs)
        self._check_phase(phase)
        self._phase_running = True
        try:
            if self.shared_experts is not None:
                _shared_experts_step(self.shared_experts, phase, args[0])
            out = method(self, *args, **kwargs)
            if self.shared_experts is not None and phase == "combine_postprocess":
                out = out + self.shared_experts.get_output()
        except BaseException:
            self._phase_failed = True
            raise
        finally:
            self._phase_running = False
        self._last_phase = "token_combine" if phase == PIPELINED_CALL else phase
        self._phase_failed = False
        return out

    run.phase_checked = True
    return run


def _shared_experts_step(shared_experts, phase: str, tensor: torch.Tensor) -> None:
    """With --moe-shared-expert-overlap: the shared experts' step that starts as PHASE starts,
    at the points Megatron's alltoall dispatcher takes them (on a GPU each runs in the shared
    experts' stream, beside the phase's collectives): their input's gather with
    dispatch_preprocess, fc1 and the activation once the rows have arrived, fc2 and their
    output's reduction with combine_postprocess, which then adds their output."""
    if phase == "dispatch_preprocess":
        shared_experts.pre_forward_comm(tensor)
    elif phase in ("dispatch_postprocess", PIPELINED_CALL):
        shared_experts.linear_fc1_forward_and_act(tensor)
    elif phase == "combine_postprocess":
        shared_experts.linear_fc2_forward(tensor)
        shared_experts.post_forward_comm()


def _check_phases_of(cls) -> None:
    for phase in PHASES + (PIPELINED_CALL,):
        method = cls.__dict__.get(phase)
        if callable(method) and not getattr(method, "phase_checked", False):
            setattr(cls, phase, _in_order(phase, method))


class ParmTokenDispatcher(MoETokenDispatcher):
    """Base of Parm's dispatchers: groups, permutation and the counts exchange.

    Megatron's base class names the ESP group ``tp_group``; here it is ``etp_group`` and the
    attention TP group is ``attn_tp_group``, to keep the two apart.

    Phase order. Every dispatcher runs Megatron-Core's six phases separately, in the order of
    PHASES (the experts between dispatch_postprocess and combine_preprocess); a pipelined
    one (the catalog's ``pipelined``) also offers dispatch_compute_combine, which takes the
    place of token_dispatch through token_combine. The phases share this layer call's state
    (plan, sort orders, routes), so a phase run out of that order, a combine without its
    dispatch, or a new dispatch_preprocess while a call is still open would compute with
    another call's state: each raises one RuntimeError naming the phase instead. Every
    subclass's phase methods are checked (``__init_subclass__``); the check is host
    bookkeeping only, no tensor operation. A layer call abandoned by an exception inside
    one of its phases may be restarted with dispatch_preprocess.
    """

    # The catalog entry this dispatcher was built for (dispatchers.build_dispatcher); None
    # when built directly from its class.
    schedule = None
    # The phase order: the last phase that completed, whether a phase is running, whether
    # the last phase run raised.
    _last_phase: Optional[str] = None
    _phase_running = False
    _phase_failed = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _check_phases_of(cls)

    @property
    def pipelined(self) -> bool:
        """This layer call runs as one pipelined dispatch_compute_combine (ParmMoELayer asks):
        the catalog's capability of the schedule it was built for."""
        return self.schedule is not None and self.schedule.pipelined

    def _check_phase(self, phase: str) -> None:
        last = self._last_phase
        if phase == "dispatch_preprocess":
            if last is None or last == PHASES[-1] or self._phase_failed:
                return
        elif last == _FOLLOWS[phase]:
            return
        raise RuntimeError(self._phase_error(phase))

    def _phase_error(self, phase: str) -> str:
        last, name = self._last_phase, self.schedule.name if self.schedule else type(self).__name__
        order = " -> ".join(PHASES)
        if phase == "dispatch_preprocess":
            return (f"{name}: dispatch_preprocess called while the previous layer call is still "
                    f"open (its last phase was {last}): combine it first; the phases run in the "
                    f"order {order}")
        if last in (None, PHASES[-1]):
            done = "with no dispatch open (dispatch_preprocess has not run for this call)"
        else:
            done = f"after {last}"
        return (f"{name}: {phase} called {done}; it must follow {_FOLLOWS[phase]} (the phases "
                f"run in the order {order})")

    def __init__(self, num_local_experts: int, local_expert_indices: Sequence[int], config,
                 pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.attn_tp_group = pg_collection.tp
        self.etp_group = pg_collection.expt_tp
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.topk = config.moe_router_topk
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        self.ep_rank = utils.get_pg_rank(self.ep_group)
        self.etp_rank = utils.get_pg_rank(self.etp_group)
        # The layer runs as Megatron-Core's combined 1F1B nodes: token_dispatch and
        # token_combine are the communication stream's nodes (collectives only, their local
        # work in the phases around them), and a node frees the storage of its inputs once it
        # has run, so the phases after one hand on tensors of their own storage.
        self.comm_nodes = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))

    # -- local work ---------------------------------------------------------------------

    def _permute(self, tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                 num_routers: int = 1):
        """Sort (token, expert) pairs by expert; returns rows, probs, counts [E].

        counts: on the host with padding to capacity (known without looking), else on the
        rows' device (_exchange_counts brings them to the host with everyone else's).
        num_routers: how many ranks' routing decisions the map concatenates; with padding
        to capacity each of them padded to its own capacity, so the map holds that many
        capacities per expert.
        """
        num_out_tokens = None  # only padding to capacity reads it
        if self.drop_and_pad:
            routed_by_one = routing_map.size(0) // num_routers
            capacity = num_routers * get_capacity(routed_by_one * self.topk, self.num_experts,
                                                  self.config.moe_expert_capacity_factor)
            counts = torch.full((self.num_experts,), capacity, dtype=torch.long, device=HOST)
            num_out_tokens = capacity * self.num_experts
        else:
            counts = routing_map.sum(dim=0).long()
        rows, row_probs, self._sorted_indices = permute(
            tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
            drop_and_pad=self.drop_and_pad)
        self._routing_map = routing_map
        self._permuted_shape = tokens.shape
        return rows, row_probs, counts

    def _unpermute(self, rows: torch.Tensor) -> torch.Tensor:
        out = unpermute(rows, self._sorted_indices, restore_shape=self._permuted_shape,
                        routing_map=self._routing_map, drop_and_pad=self.drop_and_pad)
        self._routing_map = self._sorted_indices = None
        return out

    # -- routing counts -----------------------------------------------------------------

    def _exchange_counts(self, counts: torch.Tensor, group, name: str, num_etp: int) -> torch.Tensor:
        """Gather every rank's counts [E] over ``group`` (ordered EP-major, ESP-minor), on the
        host: the gather runs on the device, then one copy to the host (a host sync on GPUs)."""
        if self.drop_and_pad:  # every count is the capacity: nothing to exchange
            return counts.expand(self.ep_size, num_etp, -1).clone()
        gathered = start_all_gather(counts.view(1, -1), group, name).wait()
        return devices.to_host(gathered.view(self.ep_size, num_etp, self.num_experts))

    def build_plan(self, counts: torch.Tensor) -> RoutingPlan:
        """The plan of a dispatch where every ESP peer routes its own tokens (S1, S2)."""
        etp_size = utils.get_pg_size(self.etp_group)
        all_counts = self._exchange_counts(counts, self.tp_ep_group, "tp_ep_counts", etp_size)
        return RoutingPlan(all_counts, self.ep_rank, self.etp_rank, self.num_local_experts)

    # -- phases shared by the schedules ---------------------------------------------------

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        """S1/S2: permute this rank's own tokens by expert and plan the dispatch."""
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        rows, row_probs, counts = self._permute(tokens, routing_map, probs)
        self.plan = self.build_plan(counts)
        return rows, row_probs

    def _sort_for_experts(self, rows: torch.Tensor, row_probs: torch.Tensor,
                          new_storage: bool = False):
        """Rows as received ([source][local expert]) -> expert-major, with tokens per expert;
        new_storage: in tensors of their own even where the order is already expert-major."""
        self.chunk_sizes = self.plan.gathered_chunk_sizes()
        sorted_rows, sorted_probs = sort_by_local_expert(rows, row_probs, self.chunk_sizes,
                                                         self.num_local_experts)
        if new_storage and sorted_rows.untyped_storage().data_ptr() == \
                rows.untyped_storage().data_ptr():
            sorted_rows, sorted_probs = row_order.gather_new((sorted_rows, sorted_probs), None)
        return sorted_rows, self.plan.tokens_per_local_expert(), sorted_probs

    def _unsort_from_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return unsort_by_local_expert(hidden_states, self.chunk_sizes, self.num_local_experts)

    def token_combine(self, hidden_states: torch.Tensor):
        """A2A [EP] of the expert outputs back to the ranks that sent the rows."""
        return all_to_all(hidden_states, self.ep_group, "ep", self.plan.a2a_input_splits(),
                          self.plan.a2a_output_splits())

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """S1/S2: unpermute to this rank's tokens."""
        self.plan = self.chunk_sizes = None
        return self._unpermute(hidden_states).view(self.hidden_shape)


_check_phases_of(ParmTokenDispatcher)  # its own phases (subclasses: __init_subclass__)
