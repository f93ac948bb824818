"""Expert parallelism: the routed experts of one MoE layer spread over the ranks of an ``ep`` process group.

Every rank holds the physical expert slots that a :class:`passes.place_experts.Placement` gives its GPU (slot
``s`` on rank ``s // slots_per_gpu``; the hottest experts may have several replicas). :func:`moe_experts_ep`
computes ``moe_experts`` (spec/OPS.md) for this rank's tokens:

1. every (token, choice) pair goes to one slot of its expert (replica ``token % replica_count``, so replicas share
   an expert's tokens), the pairs sorted by destination rank;
2. the per-destination counts are exchanged first (``all_to_all_single`` of an int64 [ep] tensor), then the
   pairs' latent inputs and their local slot indices (``all_to_all_single`` with those split sizes);
3. each rank runs its local experts on what it received (the grouped GEMMs of the single-process op, one choice
   per row, weight 1), and the results return by the reverse exchange;
4. the source rank weights them by the routing weights and sums each token's choices.

The data exchanges are ``torch.distributed._functional_collectives.all_to_all_single_autograd``: the backward
runs the same exchange in reverse (GShard, arXiv 2006.16668, sec. 3.2; torchtitan's expert parallel path).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from dsl.errors import MtcError

__all__ = ["ExchangeStats", "moe_experts_ep", "local_slots", "shard_rows", "slots_to_shard", "shard_to_slots"]


@dataclass
class ExchangeStats:
    """What one exchange sent from this rank: its (token, choice) pairs, those whose slot is on another rank, the
    dispatch bytes that left it (those pairs' inputs) and the combine bytes (the results it computed for other
    ranks' pairs); payload only, the counts and slot indices not included; recv_counts: pairs received per rank."""

    pairs: int
    remote_pairs: int
    dispatch_bytes: int
    combine_bytes: int
    recv_counts: list[int]


def local_slots(placement, rank: int) -> torch.Tensor:
    """int64 [slots_per_gpu]: the logical experts of rank ``rank``'s slots (its weights are ``full[these]``)."""
    s = placement.slots_per_gpu
    return placement.physical_to_logical[rank * s:(rank + 1) * s].clone()


def shard_rows(num_experts: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi): the logical experts that rank ``rank`` holds of a Shard(0) DTensor over ``world`` ranks
    (torch.chunk's split, as DTensor's: ceil(E / world) rows per rank, the last ranks fewer or none)."""
    c = -(-num_experts // world)
    lo = min(num_experts, rank * c)
    return lo, min(num_experts, lo + c)


def _exchange(src_rows: torch.Tensor, pick: list, counts_out: list, counts_in: list, rows_in: int, group):
    """all_to_all_single of the rows ``src_rows[pick]`` (in destination order, ``counts_out`` to each rank);
    returns the [rows_in, ...] rows received (``counts_in`` from each rank, in rank order)."""
    send = src_rows[torch.tensor(pick, dtype=torch.int64, device=src_rows.device)].contiguous()
    recv = src_rows.new_empty((rows_in, *src_rows.shape[1:]))
    dist.all_to_all_single(recv, send, counts_in, counts_out, group=group)
    return recv


def slots_to_shard(local: torch.Tensor, placement, group) -> torch.Tensor:
    """This rank's rows of the whole expert weight [E, ...] as a Shard(0) DTensor splits it (:func:`shard_rows`),
    from every rank's slots ``local`` [slots_per_gpu, ...] (each expert from its first replica): one
    all_to_all_single over ``group``, a collective call. Returns [hi - lo, ...]."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    E, spg = placement.num_experts, placement.slots_per_gpu
    first = placement.logical_to_physical[:, 0].tolist()
    pick, out = [], [0] * world
    for q in range(world):                      # to rank q: its experts whose first replica is here
        lo, hi = shard_rows(E, world, q)
        for e in range(lo, hi):
            if first[e] // spg == rank:
                pick.append(first[e] % spg)
                out[q] += 1
    lo, hi = shard_rows(E, world, rank)
    src = [first[e] // spg for e in range(lo, hi)]
    cin = [src.count(q) for q in range(world)]
    recv = _exchange(local, pick, out, cin, hi - lo, group)
    # received by source rank, each in expert order: back to expert order
    order = sorted(range(hi - lo), key=lambda j: (src[j], j))
    rows = torch.empty_like(recv)
    rows[torch.tensor(order, dtype=torch.int64, device=recv.device)] = recv
    return rows


def shard_to_slots(shard: torch.Tensor, placement, group) -> torch.Tensor:
    """The inverse of :func:`slots_to_shard`: this rank's slots [slots_per_gpu, ...] (``full[local_slots]``, the
    replicas included) from every rank's Shard(0) rows ``shard`` of the whole expert weight; a collective call."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    E, spg = placement.num_experts, placement.slots_per_gpu
    p2l = placement.physical_to_logical.tolist()
    owner = [q for q in range(world) for _e in range(*shard_rows(E, world, q))]
    lo = shard_rows(E, world, rank)[0]
    pick, out = [], [0] * world
    for r in range(world):                      # to rank r: the rows of its slots whose expert is held here
        for e in p2l[r * spg:(r + 1) * spg]:
            if owner[e] == rank:
                pick.append(e - lo)
                out[r] += 1
    mine = p2l[rank * spg:(rank + 1) * spg]
    src = [owner[e] for e in mine]
    cin = [src.count(q) for q in range(world)]
    recv = _exchange(shard, pick, out, cin, spg, group)
    order = sorted(range(spg), key=lambda j: (src[j], j))
    rows = torch.empty_like(recv)
    rows[torch.tensor(order, dtype=torch.int64, device=recv.device)] = recv
    return rows


def moe_experts_ep(x_lat, topk_idx, topk_weight, w1, w3, w2, *, placement, group, experts_fn):
    """moe_experts for this rank's tokens with the experts spread over ``group`` (see the module docstring).

    Args:
        x_lat [N, l]; topk_idx [N, k] int64 logical expert ids in [0, E); topk_weight [N, k] float32.
        w1, w3 [S_r, I, l]; w2 [S_r, l, I]: this rank's slots, in slot order (``full[local_slots(placement,
            rank)]``).
        placement: the layer's Placement over the group's ranks (num_gpus == group size).
        group: the expert-parallel process group.
        experts_fn(x [M, l], idx [M, 1], weight [M, 1], w1, w3, w2) -> [M, l]: the single-process moe_experts on
            this rank's slots (a reference or Triton implementation).
    Returns:
        (u [N, l] in x_lat's dtype, ExchangeStats). Differentiable in x_lat, topk_weight and the local weights.
    Raises:
        MtcError: a placement for another group size or another expert count.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if placement.num_gpus != world:
        raise MtcError(f"expert parallel: the placement is for {placement.num_gpus} GPUs but the ep group has "
                       f"{world} ranks")
    n, k = topk_idx.shape
    l = x_lat.shape[1]
    dev = x_lat.device
    spg = placement.slots_per_gpu
    if w1.shape[0] != spg:
        raise MtcError(f"expert parallel: this rank holds {w1.shape[0]} expert slots but the placement gives each "
                       f"rank {spg}")
    e = topk_idx.reshape(-1)
    tok = torch.arange(n, device=dev).repeat_interleave(k)
    l2p = placement.logical_to_physical.to(dev)
    reps = placement.replica_count.to(dev)
    slot = l2p[e, tok % reps[e]]                                   # the replica this pair goes to
    dest = slot // spg
    order = torch.sort(dest, stable=True).indices
    send = torch.bincount(dest, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)                # counts first
    send_l, recv_l = send.tolist(), recv.tolist()
    x_send = x_lat[tok[order]]
    slot_send = (slot % spg)[order]
    slot_recv = slot_send.new_empty(sum(recv_l))
    dist.all_to_all_single(slot_recv, slot_send, recv_l, send_l, group=group)
    x_recv = fc.wait_tensor(fc.all_to_all_single_autograd(x_send.contiguous(), recv_l, send_l, group))
    ones = torch.ones(x_recv.shape[0], 1, dtype=torch.float32, device=dev)
    if x_recv.shape[0]:
        y_recv = experts_fn(x_recv, slot_recv[:, None], ones, w1, w3, w2)
    else:   # no pair for this rank's experts: an empty result still tied to the exchange, so that this rank's
        # backward joins the reverse exchanges as the others do
        y_recv = x_recv.new_zeros((0, w2.shape[1])) + 0.0 * x_recv.sum()
    y_back = fc.wait_tensor(fc.all_to_all_single_autograd(y_recv.contiguous(), send_l, recv_l, group))
    y = y_back[torch.argsort(order)]                               # back to (token, choice) order
    u = (y.float().view(n, k, l) * topk_weight.float()[..., None]).sum(1)
    elem = x_lat.element_size()
    remote = n * k - send_l[rank]
    served = sum(recv_l) - recv_l[rank]                            # pairs of other ranks computed here
    return u.to(x_lat.dtype), ExchangeStats(n * k, remote, remote * l * elem, served * l * y_recv.element_size(),
                                             recv_l)
