"""Context parallelism: one sequence split along time over the ranks of a process group, op by op.

Every rank holds a contiguous run of the sequence's tokens, in rank order (rank 0 the first ones); runs may be of
different lengths (:func:`split_sizes` gives the even split torch.chunk-like callers use, any lengths >= 1 work).
The functions here take the rank's local tensors and return its local outputs, equal (to float32 rounding) to the
single-process op on the whole sequence restricted to this rank's tokens. They communicate through
``torch.distributed._functional_collectives`` (autograd-aware all-gathers), so a backward through them gives each
rank the gradients of its own inputs (the all-gather's backward is a reduce-scatter).

* :func:`kda_chunk_cp`: Kimi Delta Attention by exact state passing. The recurrence (spec/OPS.md kda_chunk) is
  affine in the state: over a run of tokens, ``S_end = M S_start + R`` with ``M`` [H, K, K] the product of the
  per-token transitions ``(I - beta_t k_t k_t^T) diag(exp(g_t))`` and ``R`` [H, K, V] the final state from a zero
  start. Each rank computes both in one chunked call by appending K value columns that start as the identity
  (state ``[0 | I]``, values ``[v | 0]``): the last K columns of the final state are ``M``, the first V are ``R``,
  and the extra output columns are ``scale * P_t^T q_t`` with ``P_t`` the transition up to token t, so the output
  with an incoming state ``S_in`` is ``o_t = o_t(0) + S_in^T (scale P_t^T q_t)``. The ranks all-gather their
  ``[R | M]``, and every rank combines them in rank order (``S_in(r) = M_{r-1} S_in(r-1) + R_{r-1}``, starting
  from the caller's initial state): exact, no approximation (Kimi Linear, arXiv 2510.26692, the chunked form's
  inter-chunk state passing, applied between ranks).
* :func:`short_conv_cp`: the causal depthwise conv; each rank needs the ``W - 1`` inputs before its first token,
  which may come from several earlier ranks when runs are shorter than ``W - 1``: the ranks all-gather their last
  ``min(T_r, W - 1)`` inputs.
* :func:`mla_attention_cp`: causal softmax attention; the keys and values of all ranks are all-gathered and each
  query at global position ``offset + t`` sees the keys ``s <= offset + t`` (ring attention without the ring).
  Called alone it gathers the op's K and V; a parallel module instead gathers MLA's latent (kv_lora_rank +
  qk_rope_dim values per token, 576 for K3) and runs the up-projection on the whole sequence (``kv_full``).

Raises MtcError for tensors whose lengths do not match, an empty run, or a group that is not initialised.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from dsl.errors import MtcError

# torch 2.13 renames the tensor collectives (the *_into_tensor / *_tensor forms are deprecated there); the GPU
# machine's torch 2.11 has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd

__all__ = ["split_sizes", "gather_lengths", "kda_chunk_cp", "short_conv_cp", "mla_attention_cp"]


def split_sizes(total: int, parts: int) -> list[int]:
    """The lengths of ``total`` tokens split into ``parts`` contiguous runs as evenly as possible, the longer runs
    first (torch.tensor_split's rule). MtcError when a run would be empty (``total < parts``)."""
    if parts < 1 or total < parts:
        raise MtcError(f"context parallel: {total} tokens cannot be split over {parts} ranks (each rank needs at "
                       f"least one token)")
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


def _rank_world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise MtcError("context parallel: torch.distributed is not initialised (init_process_group first)")
    return dist.get_rank(group), dist.get_world_size(group)


def gather_lengths(t_local: int, group, device=None) -> list[int]:
    """Every rank's run length in rank order (one all-gather of an int64 scalar; the counts go first so that
    the data exchanges after it know their sizes). MtcError when a rank has no tokens."""
    _rank, world = _rank_world(group)
    t = torch.tensor([int(t_local)], dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t, group=group)
    lengths = [int(x) for x in out]
    if min(lengths) < 1:
        raise MtcError(f"context parallel: every rank needs at least one token; the runs are {lengths}")
    return lengths


def _gather_time(x: torch.Tensor, lengths: list[int], group) -> torch.Tensor:
    """All ranks' ``x`` [B, T_r, ...] concatenated along dim 1 in rank order (padded to the longest run for the
    collective, the padding dropped); differentiable."""
    tmax = max(lengths)
    if x.shape[1] < tmax:
        pad = x.new_zeros((x.shape[0], tmax - x.shape[1], *x.shape[2:]))
        x = torch.cat([x, pad], dim=1)
    full = fc.wait_tensor(_all_gather_autograd(x.unsqueeze(0).contiguous(), 0, group))
    return torch.cat([full[j, :, :n] for j, n in enumerate(lengths)], dim=1)


def kda_chunk_cp(q, k, v, g, beta, *, group, scale=None, initial_state=None, output_final_state=False,
                 lengths: list[int] | None = None, kda=None):
    """kda_chunk (spec/OPS.md) on this rank's run of a sequence split over ``group`` (see the module docstring).

    Args:
        q, k [B, T_r, H, K]; v [B, T_r, H, V]; g [B, T_r, H, K] float32 log decay; beta [B, T_r, H]: this rank's
            tokens (rank order is time order).
        group: the context-parallel process group.
        scale: default K ** -0.5.
        initial_state: [B, H, K, V] the state before the sequence's first token, or None (zeros); the same
            tensor on every rank (each rank combines the transitions from it; its gradient is each rank's share,
            summed over the group by the caller as for any replicated input).
        output_final_state: also return the state after the sequence's last token [B, H, K, V] float32, on
            every rank.
        lengths: every rank's T_r (gather_lengths), if known; gathered otherwise.
        kda: the single-process kda_chunk to run locally (default backends.reference.kda_chunk; the Triton one
            takes the same arguments).
    Returns:
        (o [B, T_r, H, V] in v's dtype, final_state or None). Differentiable in q, k, v, g, beta, initial_state.
    """
    if kda is None:
        from backends.reference import kda_chunk as kda
    rank, world = _rank_world(group)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if lengths is None:
        lengths = gather_lengths(T, group, q.device)
    if lengths[rank] != T:
        raise MtcError(f"kda_chunk_cp: rank {rank} holds {T} tokens but lengths says {lengths[rank]}")
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(B, H, K, K)
    s0 = torch.cat([torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device), eye], dim=-1)
    v_aug = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)
    o_aug, s_end = kda(q, k, v_aug, g, beta, scale=scale, initial_state=s0, output_final_state=True)
    s_start = (initial_state.float() if initial_state is not None
               else torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device))
    s_in, s_final = _StateScan.apply(s_end.float(), s_start, group, V)
    o = o_aug[..., :V].float() + torch.einsum("bthk,bhkv->bthv", o_aug[..., V:].float(), s_in)
    return o.to(v.dtype), (s_final if output_final_state else None)


def _scan(trans, s, rank: int, V: int):
    """(the state entering rank ``rank``, the state after the last rank) from every rank's [R | M] ``trans``
    [W, B, H, K, V + K] and the sequence's initial state ``s`` [B, H, K, V]: S_end(j) = M_j S_start(j) + R_j."""
    s_in = s
    for j in range(trans.shape[0]):
        if j == rank:
            s_in = s
        s = trans[j, ..., V:] @ s + trans[j, ..., :V]
    return s_in, s


class _StateScan(torch.autograd.Function):
    """The rank-order combine of kda_chunk_cp: all-gather every rank's [R | M], scan. Its backward recomputes
    the scan, takes the gradients of all ranks' transitions and reduce-scatters them (each rank gets the sum of
    what every rank's outputs owe its own transition). A Function rather than a differentiable all-gather so that
    the backward's collective runs on every rank, also on rank 0, whose incoming state does not depend on the
    gathered values (a rank that skipped it would leave the others waiting)."""

    @staticmethod
    def forward(ctx, s_end, s_start, group, V):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        trans = s_end.new_empty((world * s_end.shape[0], *s_end.shape[1:]))
        _all_gather_single(trans, s_end.contiguous(), group=group)      # (gloo: ranks along dim 0)
        trans = trans.view(world, *s_end.shape)
        ctx.save_for_backward(trans, s_start)
        ctx.group, ctx.rank, ctx.V = group, rank, V
        return _scan(trans, s_start, rank, V)

    @staticmethod
    def backward(ctx, g_in, g_final):
        trans, s_start = ctx.saved_tensors
        with torch.enable_grad():
            t = trans.detach().requires_grad_()
            s0 = s_start.detach().requires_grad_()
            s_in, s_final = _scan(t, s0, ctx.rank, ctx.V)
            g_t, g_s0 = torch.autograd.grad([s_in, s_final], [t, s0], [g_in, g_final], allow_unused=True)
        g_t = torch.zeros_like(trans) if g_t is None else g_t
        g_s0 = torch.zeros_like(s_start) if g_s0 is None else g_s0
        mine = torch.empty_like(trans[0])
        _reduce_scatter_single(mine, g_t.reshape(-1, *trans.shape[2:]).contiguous(), group=ctx.group)
        return mine, g_s0, None, None


def short_conv_cp(x, weight, *, group, initial_state=None, output_final_state=False,
                  lengths: list[int] | None = None, conv=None):
    """short_conv (causal depthwise conv over time, backends.reference.short_conv) on this rank's run.

    Args:
        x [B, T_r, C]: this rank's tokens; weight [C, 1, W] or [C, W].
        group: the context-parallel process group.
        initial_state: [B, C, W - 1] the inputs before the sequence's first token (zeros if None; the same on
            every rank).
        output_final_state: also return the last W - 1 inputs of the whole sequence [B, C, W - 1] float32, on
            every rank.
        lengths: every rank's T_r (gather_lengths), if known.
        conv: the single-process short_conv (default backends.reference.short_conv).
    Returns:
        (y [B, T_r, C] in x's dtype, final_state or None). Differentiable in x, weight, initial_state.
    """
    if conv is None:
        from backends.reference import short_conv as conv
    rank, world = _rank_world(group)
    B, T, C = x.shape
    w1 = int(weight.shape[-1]) - 1
    if lengths is None:
        lengths = gather_lengths(T, group, x.device)
    if w1 == 0:
        y, _ = conv(x, weight)
        return y, (x.new_zeros(B, C, 0, dtype=torch.float32) if output_final_state else None)
    keep = [min(n, w1) for n in lengths]
    tails = _gather_time(x[:, T - keep[rank]:], keep, group)          # [B, sum(keep), C]
    before = (initial_state.transpose(1, 2).to(x.dtype) if initial_state is not None
              else x.new_zeros(B, w1, C))
    ctx = torch.cat([before, tails[:, :sum(keep[:rank])]], dim=1)[:, -w1:]
    y, _ = conv(x, weight, initial_state=ctx.transpose(1, 2))
    final = None
    if output_final_state:
        final = torch.cat([before, tails], dim=1)[:, -w1:].transpose(1, 2).float()
    return y, final


def mla_attention_cp(q, k, v, *, scale, group, lengths: list[int] | None = None, kv_full: bool = False):
    """Causal mla_attention (softmax attention, float32 softmax; spec/OPS.md) on this rank's queries.

    Args:
        q, k [B, T_r, H, Dqk]; v [B, T_r, H, Dv]: this rank's tokens.
        scale: the logit scale; group: the context-parallel process group; lengths: every rank's T_r.
        kv_full: k and v already hold the whole sequence [B, sum(lengths), H, D] (computed from the gathered latent,
            see backends.parallel.module): no gather here.
    Returns:
        o [B, T_r, H, Dv] in v's dtype; differentiable in q, k, v (the gathered K / V's gradients return to their
        ranks through the all-gather's backward).
    """
    rank, world = _rank_world(group)
    B, T, H, _ = q.shape
    if lengths is None:
        lengths = gather_lengths(T, group, q.device)
    offset = sum(lengths[:rank])
    if kv_full:
        if k.shape[1] != sum(lengths) or v.shape[1] != sum(lengths):
            raise MtcError(f"mla_attention_cp: kv_full needs K / V of the whole sequence ({sum(lengths)} tokens), "
                           f"got {k.shape[1]} and {v.shape[1]}")
        k_all, v_all = k, v
    else:
        k_all = _gather_time(k, lengths, group)
        v_all = _gather_time(v, lengths, group)
    S = k_all.shape[1]
    # query t (global offset + t) sees key s when s <= offset + t
    mask = (torch.arange(S, device=q.device)[None, :]
            <= offset + torch.arange(T, device=q.device)[:, None])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k_all.float().transpose(1, 2), v_all.float().transpose(1, 2),
        attn_mask=mask, scale=float(scale))
    return o.transpose(1, 2).to(v.dtype)
