"""parm_hier: deduplicated, hierarchical dispatch; a token crosses the inter-node link at most
once per destination node.

Notation (as in docs/design.md): n tokens this rank routes, E experts, L local experts per EP
rank, k top-k, s the ESP size. The rank's EP group spans K nodes with g of its ranks on each
(``perf_model.layout.ep_node_blocks``): the rank at position a of node block b has EP index
j = b * g + a, and a node holds G = g * L experts. Two process groups are cut out of the EP
group: "ep_inter", the K ranks at position a of every node, and "ep_intra", the g ranks of
node b (megatron_parm.parallel.node_groups cuts them from the layer's own groups when its
first layer is built). The rank of node b at position a is the relay of the rows that the
ranks at position a of every node send to node b.

The rows that cross a node boundary are deduplicated: for each (token, destination node) one
row, tagged by the first of the token's experts on that node (its "primary" pair) and
ordered by it, so the receiver knows that expert from the counts; every further expert of
the token on that node (a "secondary" pair) travels as (probability, row index within the
message), two numbers instead of a row. Inside a node the relay sends every pair its own
row again, in S1's layout (sorted by expert, probability packed), so the experts, ESP and
combine work as S1's.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import utils

from megatron_parm.comm.collectives import all_to_all, start_all_gather
from megatron_parm.dispatchers import row_order
from megatron_parm.dispatchers.base import RoutingPlan
from megatron_parm.dispatchers.parm_s1 import ParmS1TokenDispatcher, Route
from megatron_parm.config import parm_setting
from megatron_parm.parallel import NodeGroups, node_groups
from megatron_parm import device as devices


class NodePlan:
    """Split sizes of parm_hier's two stages, from every rank's counts (host, once per call).

    counts[j][q][0][x]: pairs the rank at (EP index j, ESP index q) routes to expert x;
    counts[j][q][1][x]: its rows whose primary expert is x (one per token and node).
    ``cells(t)`` views a [e, s, 2, E] tensor of this ESP index as
    [source node b', source position a', pairs/rows, destination node b, position a, L].
    """

    def __init__(self, counts: torch.Tensor, groups: NodeGroups, me_ep: int, me_etp: int,
                 num_local_experts: int):
        self.groups, self.me_etp, self.L = groups, me_etp, num_local_experts
        self.counts = counts
        K, g, b, a = groups.nodes, groups.per_node, groups.node, groups.position
        cells = self.cells(counts)
        rows = cells[:, :, 1].sum(dim=(-1, -2))  # [b', a', b]
        pairs = cells[:, :, 0].sum(dim=(-1, -2))
        self.rows_out = rows[b, a].tolist()  # rows this rank sends to each node
        self.secondaries_out = (pairs[b, a] - rows[b, a]).tolist()
        self.rows_in = rows[:, a, b].tolist()  # rows this relay receives from each node
        self.secondaries_in = (pairs[:, a, b] - rows[:, a, b]).tolist()
        self.pairs_out = cells[:, a, 0, b].sum(dim=(0, 2)).tolist()  # relay -> each node member
        self.pairs_in = cells[:, :, 0, b, a].sum(dim=(0, 2)).tolist()  # each relay -> this rank
        # After the intra-node stage this rank holds pairs ordered [relay a''][source b'][l]:
        # S1's plan with the EP sources in that order.
        order = [bb * g + aa for aa in range(g) for bb in range(K)]
        self.member = RoutingPlan(counts[order, :, 0], me_ep, me_etp, num_local_experts)
        self.sent_rows = sum(self.rows_out)
        self.sent_secondaries = sum(self.secondaries_out)
        self.relay_rows = sum(self.rows_in)
        self.relay_secondaries = sum(self.secondaries_in)

    def cells(self, counts: torch.Tensor) -> torch.Tensor:
        g, K = self.groups.per_node, self.groups.nodes
        return counts[:, self.me_etp].reshape(K, g, 2, K, g, self.L)

    def relay_counts(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """[K, G] primary rows and secondary pairs each node sends this relay, per node expert
        (host)."""
        cells = self.cells(self.counts)[:, self.groups.position, :, self.groups.node]
        K = self.groups.nodes
        rows = cells[:, 1].reshape(K, -1)
        return rows, cells[:, 0].reshape(K, -1) - rows


class Messages:
    """Several [rows, width] tensors as one flat message per dtype for an A2A: peer p gets rows
    sent[i][p] of tensor i, the tensors of one dtype back to back (so the rows, their
    probabilities and the secondary pairs cross the link in one collective). ``pack`` gives
    each dtype's message with its send and receive sizes (elements per peer); ``unpack``
    cuts the received messages back into the tensors, received[i][p] rows from peer p."""

    def __init__(self, tensors: Sequence[torch.Tensor], sent: Sequence[Sequence[int]],
                 received: Sequence[Sequence[int]]):
        self.sent, self.received = sent, received
        self.widths = [t.shape[1] for t in tensors]
        self.groups = [[i for i, t in enumerate(tensors) if t.dtype == dtype]
                       for dtype in dict.fromkeys(t.dtype for t in tensors)]
        self.peers = len(sent[0])

    def pack(self, tensors: Sequence[torch.Tensor]):
        """[(flat message, elements to each peer, elements from each peer)] per dtype."""
        out = []
        for mine in self.groups:
            pieces = [tensors[i].split(list(self.sent[i])) for i in mine]
            flat = torch.cat([piece[p].reshape(-1) for p in range(self.peers) for piece in pieces])
            out.append((flat, [sum(self.sent[i][p] * self.widths[i] for i in mine)
                               for p in range(self.peers)],
                        [sum(self.received[i][p] * self.widths[i] for i in mine)
                         for p in range(self.peers)]))
        return out

    def unpack(self, flats: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        out: List[torch.Tensor] = [None] * len(self.widths)
        for mine, flat in zip(self.groups, flats):
            parts = flat.split([self.received[i][p] * self.widths[i]
                                for p in range(self.peers) for i in mine])
            for k, i in enumerate(mine):
                out[i] = torch.cat([parts[p * len(mine) + k].view(-1, self.widths[i])
                                    for p in range(self.peers)])
        return out


def exchange(tensors: Sequence[torch.Tensor], sent: Sequence[Sequence[int]],
             received: Sequence[Sequence[int]], group, name: str) -> List[torch.Tensor]:
    """A2A of several [rows, width] tensors, one message per dtype (``Messages``), with
    autograd through it."""
    messages = Messages(tensors, sent, received)
    return messages.unpack([all_to_all(flat, group, name, recv, send)
                            for flat, send, recv in messages.pack(tensors)])


def _packed(collective, rows: torch.Tensor, probs: torch.Tensor, *args):
    """Rows and their probs through one collective, as one message where the dtypes match
    (autograd runs through the concatenation and the slices)."""
    if rows.dtype != probs.dtype:
        return collective(rows, *args), collective(probs, *args)
    packed = collective(torch.cat([rows, probs.unsqueeze(1)], dim=1), *args)
    return packed[:, :-1], packed[:, -1]


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Ascending positions of the True entries of a flat mask holding ``count`` of them."""
    return torch.nonzero_static(mask, size=count).view(-1)


def relay_order(primaries: torch.Tensor, seconds: torch.Tensor, secondary_rows: torch.Tensor,
                num_local_experts: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """How a relay expands what it received into one row per pair: (pair_row, order).

    primaries, seconds: [K, G] rows and secondary pairs each source node sent it per node
    expert (NodePlan.relay_counts); secondary_rows: each received secondary pair's row index
    within its source node's block. The pairs, primaries first then secondaries, sorted
    [node member][source node][local expert][row] by ``order``; ``pair_row[i]`` is the
    received row of sorted pair i (so the pair rows are rows[pair_row], their probabilities
    cat(row probs, secondary probs)[order])."""
    K, G = primaries.shape
    L = num_local_experts
    num_rows, num_secondaries = int(primaries.sum()), int(seconds.sum())
    expert = torch.arange(G, device=device).repeat(K)
    source = torch.arange(K, device=device).repeat_interleave(G)
    # the host counts on the rows' device in one transfer that does not wait
    primaries, seconds, rows_per_source = row_order.to_device(
        [primaries.reshape(-1), seconds.reshape(-1), primaries.sum(dim=1)], device)

    def spread(values, counts, total):
        return torch.repeat_interleave(values, counts, output_size=total)

    first_row = rows_per_source.cumsum(0) - rows_per_source
    sec_source = spread(source, seconds, num_secondaries)
    pair_row = torch.cat([torch.arange(num_rows, device=device),
                          first_row[sec_source] + secondary_rows.long()])
    pair_expert = torch.cat([spread(expert, primaries, num_rows),
                             spread(expert, seconds, num_secondaries)])
    pair_source = torch.cat([spread(source, primaries, num_rows), sec_source])
    key = ((pair_expert // L * K + pair_source) * L + pair_expert % L) * max(num_rows, 1) + pair_row
    order = torch.argsort(key)
    return pair_row[order], order


class ParmHierTokenDispatcher(ParmS1TokenDispatcher):
    """parm_hier: S1's deduplication over TP, plus one row per (token, node) between nodes.

    Workflow (communication on the group in brackets):
    (1) dispatch_preprocess: group this rank's n tokens by destination node: one row per
        (token, node) ordered by its primary expert, the token's further experts on that node
        as (probability, row) pairs; exchange the counts (pairs and primary rows per expert)
        [ESP x EP]
    (2) token_dispatch: A2A [ep_inter] of the rows, their primary probabilities and the
        secondary pairs to the relay of each node (one message per dtype); the relay expands
        them to one row per (token, expert), sorted by node member, source and expert;
        A2A [ep_intra] of those rows with their probs
    (3) dispatch_postprocess (S1's ESP stage): AG [ESP] of the received rows; sort by local
        expert
    (4) experts
    (5) combine_preprocess (S1's ESP stage): unsort; RS [ESP] of the partial sums
    (6) token_combine: A2A [ep_intra] back to the relay, which sums each token's expert
        outputs of the node into its row; A2A [ep_inter] of those rows back to the sources
    (7) combine_postprocess: add the node partial sums of each token
    As the combined 1F1B's nodes (``comm_nodes``), (2) ends with the AG [ESP] of (3) and (6)
    begins with the RS [ESP] of (5): the collectives on the communication stream, the sort
    and unsort around them.
    Degenerate splits: an EP group inside one node has no inter-node stage (the relay is the
    rank itself: S1's data, one row per pair); one EP rank per node has no intra-node stage
    (the relay is the expert's rank; ESP AG/RS still as S1). The routing map may hold dropped
    tokens (none of their pairs travel) and, padded to capacity, pairs of probability 0
    (sent like the others, so each expert sees S1's capacity rows).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(num_local_experts, local_expert_indices, config, pg_collection)
        self.etp_size = utils.get_pg_size(self.etp_group)
        # Made here when the first layer of this layout is built, kept for the next ones.
        self.groups = node_groups(self.ep_group, self.tp_ep_group, self.etp_rank, self.etp_size,
                                  parm_setting(config, "parm_ranks_per_node"))
        # Whether a token can have several pairs on one node: the same on every rank, so all
        # of them run the secondary pairs' A2A or none does.
        self.has_secondaries = self.topk > 1 or self.drop_and_pad

    # -- (1) -------------------------------------------------------------------------------

    def _routing_counts(self, routing_map: torch.Tensor, primary: torch.Tensor) -> torch.Tensor:
        """[parts, 2, E]: pairs and primary rows per expert (one part: the whole call; the
        pipelined form counts each of its chunks)."""
        return torch.stack([routing_map.sum(dim=0), primary.sum(dim=0)]).long().unsqueeze(0)

    def _exchange(self, counts: torch.Tensor) -> NodePlan:
        """All-gather the [parts, 2, E] counts over ESP x EP; one host copy for every split
        size. ``counts_by_part`` [e, s, parts, 2, E] and ``counts`` (their sum) stay on the
        host."""
        gathered = start_all_gather(counts.reshape(1, -1), self.tp_ep_group, "tp_ep_counts").wait()
        self.counts_by_part = devices.to_host(gathered).view(
            self.ep_size, self.etp_size, -1, 2, self.num_experts)
        self.counts = self.counts_by_part.sum(dim=2)
        return NodePlan(self.counts, self.groups, self.ep_rank, self.etp_rank,
                        self.num_local_experts)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                            probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.view(-1, self.hidden_shape[-1])
        n, K = tokens.shape[0], self.groups.nodes
        by_node = routing_map.bool().view(n, K, -1)  # [n, K, G]
        first = by_node.to(torch.int32).argmax(dim=-1, keepdim=True)
        primary = torch.zeros_like(by_node).scatter_(2, first, by_node.any(dim=-1, keepdim=True))
        primary = primary.view(n, -1)
        secondary = routing_map.bool() & ~primary
        self.route = self._exchange(self._routing_counts(routing_map, primary))
        self.plan = self.route.member

        # Primary pairs in (expert, token) order: node-major, so each node's rows are a block.
        row_pos = _true_positions(primary.t().reshape(-1), self.route.sent_rows)
        row_token, row_node = row_pos % n, row_pos // n // by_node.shape[-1]
        flat_probs = probs.t().reshape(-1)
        self._row_token, self._row_node = row_token, row_node
        # Each secondary pair names its token's row by its index within the node's block.
        per_node = primary.view(n, K, -1).sum(dim=(0, 2))
        index = torch.arange(row_pos.numel(), device=row_pos.device) - (per_node.cumsum(0) - per_node)[row_node]
        row_of = torch.zeros(n * K, dtype=torch.long, device=row_pos.device)
        row_of[row_token * K + row_node] = index
        sec_pos = _true_positions(secondary.t().reshape(-1), self.route.sent_secondaries)
        sec_token, sec_node = sec_pos % n, sec_pos // n // by_node.shape[-1]
        self._secondary_rows = row_of[sec_token * K + sec_node]
        self._secondary_token, self._secondary_node = sec_token, sec_node
        # The secondary pairs' probabilities follow the rows' (token_dispatch splits them off):
        # everything with a gradient reaches token_dispatch through its arguments.
        return tokens.index_select(0, row_token), flat_probs.index_select(
            0, torch.cat([row_pos, sec_pos]))

    # -- (2) -------------------------------------------------------------------------------

    def token_dispatch(self, rows: torch.Tensor, probs: torch.Tensor):
        route, groups = self.route, self.groups
        row_probs, sec_probs = probs.split([rows.shape[0], probs.shape[0] - rows.shape[0]])
        meta_dtype = torch.promote_types(probs.dtype, torch.float32)  # row indices stay exact
        secondaries = torch.stack([sec_probs.to(meta_dtype),
                                   self._secondary_rows.to(meta_dtype)], dim=1)
        self._secondary_rows = None
        tensors, sent, received = [rows, row_probs.unsqueeze(1)], [route.rows_out] * 2, [route.rows_in] * 2
        if self.has_secondaries:
            tensors.append(secondaries)
            sent.append(route.secondaries_out)
            received.append(route.secondaries_in)
        rows, row_probs, *received_secondaries = exchange(tensors, sent, received, groups.inter,
                                                          "ep_inter")
        secondaries = received_secondaries[0] if received_secondaries else secondaries
        pair_rows, pair_probs = self._expand_at_relay(rows, row_probs.squeeze(1), secondaries)
        rows, row_probs = _packed(all_to_all, pair_rows, pair_probs, groups.intra, "ep_intra",
                                  route.pairs_in, route.pairs_out)
        if not self.comm_nodes:
            return rows, row_probs
        # The combined 1F1B's communication node holds the ESP gather too (S1's, unsorted:
        # dispatch_postprocess sorts), so that ESP's collectives run where S1's do.
        self.s1_route = Route(self, self.plan, rows.device, with_ep=False)
        return self._dispatch(self.s1_route, rows, row_probs, sort=False)

    def _expand_at_relay(self, rows: torch.Tensor, row_probs: torch.Tensor,
                         secondaries: torch.Tensor):
        """The relay's rows (one per token and node) -> one row per pair, ordered
        [node member][source node][local expert] as the intra-node A2A sends them."""
        route = self.route
        self._pair_row, order = relay_order(*route.relay_counts(), secondaries[:, 1],
                                            self.num_local_experts, rows.device)
        self._relay_rows = route.relay_rows
        pair_probs = torch.cat([row_probs, secondaries[:, 0].to(row_probs.dtype)])
        return rows.index_select(0, self._pair_row), pair_probs[order]

    # -- (6), (7) --------------------------------------------------------------------------

    def token_combine(self, hidden_states: torch.Tensor):
        if self.comm_nodes:  # RS [ESP] first (S1's, the unsort was combine_preprocess's)
            esp, self.s1_route = self.s1_route, None
            hidden_states = self._combine(esp, hidden_states, unsort=False)
        route, groups = self.route, self.groups
        pairs = all_to_all(hidden_states, groups.intra, "ep_intra", route.pairs_out, route.pairs_in)
        node_rows = pairs.new_zeros((self._relay_rows, pairs.shape[1])).index_add(0, self._pair_row, pairs)
        return all_to_all(node_rows, groups.inter, "ep_inter", route.rows_out, route.rows_in)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        n = self.hidden_shape[:-1].numel()
        out = hidden_states.new_zeros((n, hidden_states.shape[1])).index_add(0, self._row_token, hidden_states)
        self.plan = self.route = self.counts = self.counts_by_part = self.chunk_sizes = None
        self._row_token = self._pair_row = self._row_node = None
        self._secondary_token = self._secondary_node = None
        return out.view(self.hidden_shape)
