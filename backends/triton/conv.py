"""Triton short convolution with the KDA prologue fused in: causal depthwise conv -> SiLU (-> per-head L2 norm).

In a KDA layer (Kimi Linear, arXiv 2510.26692, Sec. 3: q, k, v pass a short causal convolution with SiLU; q and
k are L2-normalised per head) each of q, k, v is ``short_conv -> silu [-> l2norm]``: three ops, three passes
over the activation in the reference op table. ``conv_silu_norm`` does the chain in one pass (the W shifted
input rows come from L1/L2), in float32, rounding once at the end. The runtime runs it for every such chain
that fuse_tiles put into a kda_chunk group (target "triton", forward without autograd;
``passes.lower.conv_chains`` finds them, the kernel IR prints them in brackets).
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from .guard import cdiv, check_forward_only, check_kernel_device, next_power_of_2
from backends.cuda_device import on_tensor_device
from backends.reference.ops import _check_float_input, check_conv_weight, check_eps, check_finite_cpu, check_flag

__all__ = ["conv_silu_norm"]


@triton.jit
def _conv_silu_norm_kernel(x, w, y, T, C, eps, D: tl.constexpr, BD: tl.constexpr, W: tl.constexpr,
                           BT: tl.constexpr, SILU: tl.constexpr, NORM: tl.constexpr):
    """Program (time tile, channel group of D, batch): y[b, t, c] = f(sum_j w[c, j] x[b, t - W + 1 + j, c])."""
    pt = tl.program_id(0)
    grp = tl.program_id(1)
    b = tl.program_id(2)
    rows = pt * BT + tl.arange(0, BT)
    dd = tl.arange(0, BD)
    cm = dd < D
    cols = grp * D + dd
    base = b.to(tl.int64) * T * C
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - (W - 1) + j
        m = (src >= 0) & (src < T)
        xv = tl.load(x + base + src.to(tl.int64)[:, None] * C + cols[None, :], mask=m[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)
        wj = tl.load(w + cols * W + j, mask=cm, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    if NORM:
        acc = acc * tl.rsqrt(tl.sum(acc * acc, axis=1) + eps)[:, None]
    tl.store(y + base + rows.to(tl.int64)[:, None] * C + cols[None, :], acc.to(y.dtype.element_ty),
             mask=(rows < T)[:, None] & cm[None, :])


@on_tensor_device
def conv_silu_norm(x: torch.Tensor, weight: torch.Tensor, *, silu: bool = True, head_dim: int | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """Causal depthwise short convolution, then SiLU, then (``head_dim`` given) an L2 norm per head.

    Math: ``u[b,t,c] = sum_j w[c, j] x[b, t - W + 1 + j, c]`` (zeros before t = 0, as reference
    ``short_conv`` without initial state); ``silu(u) = u * sigmoid(u)``; per head of ``head_dim`` channels
    ``y = s / sqrt(sum(s^2) + eps)`` (reference ``l2norm``). All in float32, rounded once to x's dtype.

    Args:
        x: [B, T, C] activations (float32/float16/bfloat16), on the GPU or (TRITON_INTERPRET=1) the CPU.
        weight: [C, W] or [C, 1, W] conv taps.
        silu: apply SiLU after the convolution.
        head_dim: when given, C must be a multiple of it; each group of head_dim channels is L2-normalised.
        eps: the L2 norm's epsilon.
    Returns:
        y [B, T, C] in x's dtype (view it as [B, T, C // head_dim, head_dim] for the per-head layout).
    Raises:
        TypeError: x not a float tensor, weight not a real tensor, head_dim not an int, silu not a bool.
        ValueError: wrong ranks or weight shape (as reference short_conv), C mismatch between x and weight,
            head_dim not dividing C, eps <= 0.
        RuntimeError: autograd records a gradient for x or weight (forward only: the result would carry none).
    Forward only (no autograd): the runtime uses it when no gradient is recorded."""
    _check_float_input(x, "conv_silu_norm")
    check_conv_weight(weight, "conv_silu_norm")
    silu = check_flag(silu, "silu", "conv_silu_norm")
    check_forward_only("conv_silu_norm", x, weight)
    check_kernel_device("triton.conv_silu_norm", x=x, weight=weight)
    if x.dim() != 3:
        raise ValueError(f"conv_silu_norm: x must be [B, T, C], got {list(x.shape)}")
    w = weight.reshape(weight.shape[0], -1).float()
    Bn, T, C = x.shape
    if w.shape[0] != C:
        raise ValueError(f"conv_silu_norm: weight has {w.shape[0]} channels, x has {C}")
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral):
            raise TypeError(f"conv_silu_norm: head_dim must be an int or None, got {type(head_dim).__name__} "
                            f"{head_dim!r}")
        if head_dim < 1 or C % head_dim:
            raise ValueError(f"conv_silu_norm: head_dim {head_dim} does not divide C = {C}")
    check_eps(eps, "conv_silu_norm")
    check_finite_cpu("conv_silu_norm", x=x, weight=weight)
    x = x.contiguous()
    w = w.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    D = head_dim if head_dim is not None else min(C, 128)
    if head_dim is None:
        while C % D:
            D //= 2
    BD = next_power_of_2(D)
    BT = max(1, min(64, 4096 // BD, next_power_of_2(T)))
    grid = (cdiv(T, BT), C // D, Bn)
    _conv_silu_norm_kernel[grid](x, w, y, T, C, float(eps), D=D, BD=BD, W=w.shape[1], BT=BT, SILU=silu,
                                 NORM=head_dim is not None, num_warps=4)
    return y
