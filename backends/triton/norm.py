"""RMSNorm over the last dimension on Triton, forward and backward, one pass over the rows each way.

``y = x * rsqrt(mean_d(x^2) + eps) * w`` (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", eq. 4), in
float32, rounded once to x's dtype: the reference ``backends.reference.ops.rmsnorm`` in one kernel instead of
torch's chain of casts, reductions and broadcasts (the latent MoE's norm on u: at 32768 tokens of the K3 layer that
chain took about 4 ms of kernels per forward+backward on the H200, 15th session).

Backward, with r = rsqrt(mean(x^2) + eps), xh = x r, gw = g w:
``dx = r (gw - xh mean_d(gw xh))``, ``dw = sum_rows g xh`` (per-program partial sums in float32, then one sum).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from backends.reference.ops import check_eps
from backends.reference.ops import rmsnorm as rmsnorm_reference
from .guard import cdiv, check_kernel_device, next_power_of_2, no_create_graph, sm_count

__all__ = ["rms_norm"]

# The widest row the kernels take (a whole row is one program's registers); wider rows go through the reference's
# torch ops
MAX_D = 65536


@triton.jit
def _rms_fwd_kernel(x_ptr, w_ptr, y_ptr, r_ptr, N, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr,
                    ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rm = rows < N
    cm = cols < D
    m = rm[:, None] & cm[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * r[:, None] * w[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)
    tl.store(r_ptr + rows, r, mask=rm)


@triton.jit
def _rms_bwd_kernel(x_ptr, w_ptr, r_ptr, g_ptr, dx_ptr, dwp_ptr, N, D, stride_x, stride_g, stride_dx,
                    rows_per_prog, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, NEED_DW: tl.constexpr):
    """Rows [pid * rows_per_prog, ...) in blocks of ROWS; dx per row, this program's dw partial into dwp[pid]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    r_start = pid.to(tl.int64) * rows_per_prog
    r_end = tl.minimum(r_start + rows_per_prog, N)
    for r0 in range(r_start, r_end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rm = rows < r_end
        m = rm[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=rm, other=0.0)
        xh = x * r[:, None]
        gw = g * w[None, :]
        c = tl.sum(gw * xh, axis=1) / D
        dx = r[:, None] * (gw - xh * c[:, None])
        tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        if NEED_DW:
            dw += tl.sum(g * xh, axis=0)
    if NEED_DW:
        tl.store(dwp_ptr + pid.to(tl.int64) * D + cols, dw, mask=cm)


def _tiling(d):
    """(BLOCK_D, ROWS, num_warps) for rows of d: the row padded to a power of two, and rows per block so that one
    block is about 8K elements (a short row: several rows)."""
    block_d = next_power_of_2(d)
    return block_d, max(1, min(64, 8192 // block_d)), 8 if block_d >= 2048 else 4


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        d = shape[-1]
        x2 = x.reshape(-1, d)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n = x2.shape[0]
        y = torch.empty((n, d), dtype=x.dtype, device=x.device)
        r = torch.empty(n, dtype=torch.float32, device=x.device)
        block_d, rows, warps = _tiling(d)
        if n:
            _rms_fwd_kernel[(cdiv(n, rows),)](x2, weight, y, r, n, d, x2.stride(0), y.stride(0), float(eps),
                                              BLOCK_D=block_d, ROWS=rows, num_warps=warps)
        ctx.save_for_backward(x2, weight, r)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, g):
        no_create_graph("backends.triton.rms_norm")
        x2, weight, r = ctx.saved_tensors
        n, d = x2.shape
        need_x, need_w = ctx.needs_input_grad[:2]
        g2 = g.reshape(n, d)
        if g2.stride(-1) != 1:
            g2 = g2.contiguous()
        dx = torch.empty((n, d), dtype=x2.dtype, device=x2.device)
        if n == 0:
            dw = torch.zeros(d, dtype=weight.dtype, device=x2.device) if need_w else None
            return (dx.view(ctx.shape) if need_x else None), dw, None
        block_d, rows, warps = _tiling(d)
        progs = min(cdiv(n, rows), 4 * sm_count(x2.device) if x2.is_cuda else 3)
        per = cdiv(cdiv(n, progs), rows) * rows  # rows per program, whole blocks
        progs = cdiv(n, per)
        dwp = torch.empty((progs, d), dtype=torch.float32, device=x2.device)
        _rms_bwd_kernel[(progs,)](x2, weight, r, g2, dx, dwp, n, d, x2.stride(0), g2.stride(0), dx.stride(0),
                                  per, BLOCK_D=block_d, ROWS=rows, NEED_DW=need_w, num_warps=warps)
        dw = dwp.sum(0).to(weight.dtype) if need_w else None
        return (dx.view(ctx.shape) if need_x else None), dw, None


@on_tensor_device
def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dimension (Zhang & Sennrich 2019, eq. 4): ``x * rsqrt(mean(x^2) + eps) * weight``.

    Args:
        x: [..., D] float32 / bfloat16 / float16 (float64 is taken too, computed in float32 as the reference
            does); any leading shape; the last dimension contiguous is fastest. 1 <= D <= MAX_D (65536) runs the
            Triton kernels, wider rows (and D = 0) the reference's torch ops.
        weight: [D], any float dtype (used in float32).
        eps: > 0, added to the mean square.
    Returns:
        y [..., D] in x's dtype, computed in float32 and rounded once (as ``backends.reference.ops.rmsnorm``).
        Differentiable in x and weight (weight's gradient in weight's dtype, summed in float32).
    Raises:
        TypeError / ValueError for a non-float x, a weight that is not [D], a bad eps, or tensors on different
        devices (or a CPU tensor outside TRITON_INTERPRET=1).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"rms_norm: x must be a floating-point tensor [..., D], got "
                        f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must be a float [D={x.shape[-1]}] tensor, got "
                         f"{getattr(weight, 'dtype', type(weight).__name__)} {tuple(getattr(weight, 'shape', ()))}")
    check_eps(eps, "rms_norm")
    check_kernel_device("triton.rms_norm", x=x, weight=weight)
    if x.shape[-1] > MAX_D or x.shape[-1] == 0:
        # one row per program in registers: wider rows take torch's ops (same math); so do empty rows
        return rmsnorm_reference(x, weight, eps=eps)
    return _RMSNormFn.apply(x, weight.contiguous(), float(eps))
