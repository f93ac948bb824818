"""The attn_residual backward, its autograd Function and the public ``attn_residual``.

``_bwd_kernel`` recomputes the mix from the saved logits and log-sum-exp (one read of the sources), then reads
every source once more to write its gradient; per-program partial sums of d(query*rms_weight) and
d(output_rms_weight) are reduced on the host side. Derivation: with k_i = x_i r_i, logit_i = <qw, k_i>,
qw = query*rms_weight, do = dL/d(mix):
    dlogit_i = p_i (<do, x_i> - <do, mix>),
    dx_i = p_i do + dlogit_i r_i (qw - logit_i r_i x_i / d),  dqw = sum dlogit_i r_i x_i.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from ..guard import cdiv, no_create_graph, warn_interpreter_bf16
from .common import check_device, flat, num_sms, offset_table, ref, row_tile
from .forward import forward


@triton.jit
def _bwd_kernel(
    base, offs, dx,               # sources (base + offsets), dx [L, N, D] sources' dtype (stacked grads)
    q, w, ow, dy,                 # dy [N, D]
    logit_buf, lse_buf,           # saved by the forward
    dqw_part, dow_part,           # [G, D] f32 per-program partial sums
    N, ND, L, eps, tiles_per_prog,       # ND = N * D (a Python int: 64-bit when it needs to be)
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, VEC: tl.constexpr, HAS_ONORM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    G = tl.num_programs(0)
    cols = tl.arange(0, BD)
    cmask = cols < D
    qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
        tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_ONORM:
        oww = tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
    dqw_acc = tl.zeros([BD], tl.float32)
    dow_acc = tl.zeros([BD], tl.float32)
    for j in range(0, tiles_per_prog):
        t = pid + j * G                                               # tile index (int64); t >= n_tiles is masked
        rows = t * BT + tl.arange(0, BT).to(tl.int64)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        tile = rows[:, None] * D + cols[None, :]
        lse = tl.load(lse_buf + rows, mask=rmask, other=0.0)
        # pass 1: the pre-norm mix o = sum_i p_i x_i, from the saved logits
        o = tl.zeros([BT, BD], tl.float32)
        lgp = logit_buf
        for i in range(L):
            off = tl.multiple_of(tl.load(offs + i), VEC)
            x = tl.load(base + off + tile, mask=mask, other=0.0).to(tl.float32)
            lg = tl.load(lgp + rows, mask=rmask, other=0.0)
            lgp += N
            o += tl.exp(lg - lse)[:, None] * x
        g = tl.load(dy + tile, mask=mask, other=0.0).to(tl.float32)
        if HAS_ONORM:
            ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
            xhat = o * ro[:, None]
            dow_acc += tl.sum(xhat * g, axis=0)
            gw = g * oww[None, :]
            do = ro[:, None] * (gw - xhat * (tl.sum(gw * xhat, axis=1) / D)[:, None])
        else:
            do = g
        delta = tl.sum(do * o, axis=1)
        # pass 2: every source's gradient
        lgp = logit_buf
        dxp = dx                                                      # advances by N*D per source (64-bit)
        for i in range(L):
            off = tl.multiple_of(tl.load(offs + i), VEC)
            x = tl.load(base + off + tile, mask=mask, other=0.0).to(tl.float32)
            lg = tl.load(lgp + rows, mask=rmask, other=0.0)
            lgp += N
            p = tl.exp(lg - lse)
            r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
            dl = p * (tl.sum(x * do, axis=1) - delta)
            dlr = dl * r
            dxi = p[:, None] * do + dlr[:, None] * (qw[None, :] - (lg * r / D)[:, None] * x)
            tl.store(dxp + tile, dxi.to(dx.dtype.element_ty), mask=mask)
            dxp += ND
            dqw_acc += tl.sum(dlr[:, None] * x, axis=0)
    tl.store(dqw_part + pid * D + cols, dqw_acc, mask=cmask)
    if HAS_ONORM:
        tl.store(dow_part + pid * D + cols, dow_acc, mask=cmask)



class _AttnResFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, rms_weight, output_rms_weight, eps, *xs):
        save = ctx.needs_input_grad is not None and any(ctx.needs_input_grad)
        out, _, logit, lse = forward(query, xs, rms_weight, output_rms_weight, eps, save)
        if save:
            ctx.save_for_backward(query, rms_weight, output_rms_weight, logit, lse, *xs)
            ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, dy):
        no_create_graph("backends.triton.attn_residual")
        query, w, ow, logit, lse, *xs = ctx.saved_tensors
        eps = ctx.eps
        L = len(xs)
        n, d = xs[0].shape
        dev = xs[0].device
        base, offs, vec = offset_table(xs, "attn_residual backward")
        dx = torch.empty((L, n, d), dtype=xs[0].dtype, device=dev)
        bt, bd, nw = row_tile(d, n)
        if bd * bt >= 8192:
            nw = 16
        n_tiles = cdiv(n, bt)
        G = max(1, min(n_tiles, 4 * num_sms(dev)))
        dqw = torch.zeros((G, d), dtype=torch.float32, device=dev)
        dow = torch.zeros((G, d), dtype=torch.float32, device=dev) if ow is not None else dqw
        dy = dy.contiguous()
        if n > 0:
            _bwd_kernel[(G,)](
                base, offs, dx, query, w, ow if ow is not None else query, dy, logit, lse, dqw, dow,
                n, n * d, L, float(eps), cdiv(n_tiles, G), D=d, BT=bt, BD=bd, VEC=vec, HAS_ONORM=ow is not None,
                num_warps=nw)
        dqw_t = dqw.sum(0)
        dq = (dqw_t * w.float()).to(query.dtype)
        dw = (dqw_t * query.float()).to(w.dtype)
        dow_t = dow.sum(0).to(ow.dtype) if ow is not None else None
        return (dq, dw, dow_t, None, *dx.unbind(0))


@on_tensor_device
def attn_residual(query: torch.Tensor, sources: Sequence[torch.Tensor], rms_weight: torch.Tensor, *,
                  eps: float = 1e-6, output_rms_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over depth (Block AttnRes), one fused Triton pass over the sources; differentiable.

    Math: arXiv 2603.15031 (Attention Residuals), spec/OPS.md "attn_residual":
    ``logit_i = <query, RMSNorm(sources_i; rms_weight, eps)>``, ``p = softmax_i(logit)`` (float32),
    ``out = sum_i p_i sources_i``, then ``RMSNorm(out; output_rms_weight, eps)`` if that weight is given.
    Computed with an online softmax over depth: every source element is read once, float32 accumulation,
    int64 indexing (right past 2^32 elements). Backward (torch.autograd) gives gradients for query,
    rms_weight, output_rms_weight and every source; it re-reads the sources twice.

    Args:
        query: [d] float tensor; rms_weight: [d]; output_rms_weight: optional [d].
        sources: list/tuple of L >= 1 tensors [..., d], same shape and dtype (float32, float16 or
            bfloat16), on a CUDA device (or on CPU under TRITON_INTERPRET=1). Any L (runtime value).
        eps: RMSNorm epsilon of both norms, > 0.

    Returns:
        out: [..., d] in the sources' dtype.

    Huge values (CPU tensors, scanned as for NaN / inf; not scanned on the GPU): a source value or |query *
    rms_weight| past 2^40, where the kernel's float32 sums could overflow, gives the reference's result (which
    scales such rows exactly); a result that overflows its dtype is the reference's ValueError.

    Raises:
        ValueError: empty sources, mismatched shapes/devices, wrong weight shapes, bad eps, CPU tensors
            without the interpreter, a CPU result that overflows its dtype.
        TypeError: non-tensor arguments, mismatched or unsupported dtypes.
    """
    shape, dtype, d = ref.check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight)
    check_device(sources[0], "attn_residual")
    warn_interpreter_bf16("backends.triton.attn_residual", *sources)
    if ref.needs_safe_path(query, sources, rms_weight):
        # values past 2^40 (CPU inputs, scanned as for NaN / inf): the kernel's float32 sums of x^2 or of the
        # logits could overflow; the reference scales those rows exactly (the same result as there)
        return ref.attn_residual(query, sources, rms_weight, eps=eps, output_rms_weight=output_rms_weight)
    xs = [flat(s, d) for s in sources]
    q, w = query.contiguous(), rms_weight.contiguous()
    ow = output_rms_weight.contiguous() if output_rms_weight is not None else None
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, w, ow, *xs))):
        # nothing to differentiate: the kernel alone, without autograd.Function's bookkeeping (host work that
        # shows beside a kernel of a fraction of a millisecond)
        out = forward(q, xs, w, ow, float(eps), False)[0].view(shape)
    else:
        out = _AttnResFn.apply(q, w, ow, float(eps), *xs).view(shape)
    ref.check_attn_residual_result(out, dtype, "attn_residual")
    return out
