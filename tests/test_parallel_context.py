"""Context parallelism op by op (backends/parallel/context.py): kda_chunk by exact state passing, the short
conv by exchanging the last W - 1 inputs, MLA attention by gathering K / V with a causal offset. 2 and 4 gloo
processes, float32, uneven runs (some shorter than the conv's W - 1); each rank's outputs and the gradients of
its inputs equal the single-process op on the whole sequence (the reference backend, run on every rank from the
same seed), with and without an initial state and with the final state returned."""
import torch
import torch.distributed as dist

from backends import reference as R
from backends.parallel.context import (gather_lengths, kda_chunk_cp, mla_attention_cp, short_conv_cp,
                                       split_sizes)
from dsl.errors import MtcError
from dist_util import run_ranks

import pytest

B, H, K, V, C, W = 2, 2, 8, 6, 5, 4


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check(name, got, want, tol=1e-5):
    r = _rel(got, want)
    assert r < tol, f"{name}: relative error {r:.2e}"


def _allsum(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _kda_inputs(T, gen):
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [q, k, v, g, beta]


def _ops(rank, world, seed, lengths):
    group = dist.group.WORLD
    T = sum(lengths)
    lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
    assert gather_lengths(hi - lo, group) == lengths
    gen = torch.Generator().manual_seed(seed)
    # -- kda_chunk, with an initial state and the final state returned, and without --------------------------
    for with_state in (True, False):
        full = _kda_inputs(T, gen)
        s0 = torch.randn(B, H, K, V, generator=gen) if with_state else None
        wo, ws = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
        ref_in = [x.clone().requires_grad_() for x in full]
        ref_s0 = s0.clone().requires_grad_() if with_state else None
        o, s = R.kda_chunk(*ref_in, initial_state=ref_s0, output_final_state=True)
        ((o * wo).sum() + (s * ws).sum()).backward()
        loc = [x[:, lo:hi].clone().requires_grad_() for x in full]
        loc_s0 = s0.clone().requires_grad_() if with_state else None
        o_l, s_l = kda_chunk_cp(*loc, group=group, initial_state=loc_s0, output_final_state=True, lengths=lengths)
        _check("kda o", o_l, o[:, lo:hi])
        _check("kda final state", s_l, s)
        # the final-state term once over the group (every rank returns it)
        loss = (o_l * wo[:, lo:hi]).sum() + ((s_l * ws).sum() if rank == world - 1 else 0.0)
        loss.backward()
        for nm, a, b in zip("qkvgb", loc, ref_in):
            _check(f"kda d{nm}", a.grad, b.grad[:, lo:hi])
        if with_state:
            _check("kda d initial_state", _allsum(loc_s0.grad), ref_s0.grad)
        o2, s2 = kda_chunk_cp(*[x.detach() for x in loc], group=group, lengths=lengths)
        assert s2 is None
    # -- short_conv, with an initial state and the final state ---------------------------------------------
    for with_state in (True, False):
        x = torch.randn(B, T, C, generator=gen)
        w = torch.randn(C, 1, W, generator=gen)
        st = torch.randn(B, C, W - 1, generator=gen) if with_state else None
        wy, wf = torch.randn(B, T, C, generator=gen), torch.randn(B, C, W - 1, generator=gen)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        str_ = st.clone().requires_grad_() if with_state else None
        y, f = R.short_conv(xr, wr, initial_state=str_, output_final_state=True)
        ((y * wy).sum() + (f * wf).sum()).backward()
        xl, wl = x[:, lo:hi].clone().requires_grad_(), w.clone().requires_grad_()
        stl = st.clone().requires_grad_() if with_state else None
        y_l, f_l = short_conv_cp(xl, wl, group=group, initial_state=stl, output_final_state=True, lengths=lengths)
        _check("conv y", y_l, y[:, lo:hi])
        _check("conv final state", f_l, f)
        ((y_l * wy[:, lo:hi]).sum() + ((f_l * wf).sum() if rank == world - 1 else 0.0)).backward()
        _check("conv dx", xl.grad, xr.grad[:, lo:hi])
        _check("conv dw", _allsum(wl.grad), wr.grad)
        if with_state:
            _check("conv d initial_state", _allsum(stl.grad), str_.grad)
    # -- mla_attention ------------------------------------------------------------------------------------
    q, k = torch.randn(B, T, H, 12, generator=gen), torch.randn(B, T, H, 12, generator=gen)
    v, wo = torch.randn(B, T, H, 7, generator=gen), torch.randn(B, T, H, 7, generator=gen)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    o = R.mla_attention(*ref, scale=12 ** -0.5)
    (o * wo).sum().backward()
    loc = [t[:, lo:hi].clone().requires_grad_() for t in (q, k, v)]
    o_l = mla_attention_cp(*loc, scale=12 ** -0.5, group=group, lengths=lengths)
    _check("mla o", o_l, o[:, lo:hi])
    (o_l * wo[:, lo:hi]).sum().backward()
    for nm, a, b in zip("qkv", loc, ref):
        _check(f"mla d{nm}", a.grad, b.grad[:, lo:hi])


def test_context_parallel_ops_two_ranks(_fresh_seed):
    run_ranks(_ops, 2, _fresh_seed, split_sizes(37, 2))          # 19 + 18


def test_context_parallel_ops_four_ranks_uneven(_fresh_seed):
    run_ranks(_ops, 4, _fresh_seed, [2, 1, 23, 11])              # runs shorter than the conv's W - 1 = 3


def test_split_sizes():
    assert split_sizes(10, 4) == [3, 3, 2, 2] and split_sizes(3, 3) == [1, 1, 1]
    with pytest.raises(MtcError, match="each rank needs at least one token"):
        split_sizes(2, 3)
