"""mla_attention for the Triton backend: the softmax attention core of (gated) MLA.

There is no mtc kernel for it: it runs torch's fused scaled-dot-product attention (FlashAttention /
memory-efficient kernels on the GPU, O(T) memory; the math path on the CPU), which is what the compiled
models' triton target calls. It is here so that every backend has every op of spec/OPS.md with the same
signature; the argument checks are the reference's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.reference.kda import check_cu_seqlens
from backends.reference.ops import check_attention_args, check_attention_finite
from backends.reference.ops import mla_attention as _ref_mla_attention
from .guard import scan_values

__all__ = ["mla_attention"]


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                  cu_seqlens: torch.Tensor | None = None, check_finite: bool | None = None) -> torch.Tensor:
    """o = softmax(q k^T * scale + mask) v per head (Vaswani et al. 2017, eq. 1; DeepSeek-V2 MLA), softmax in
    float32 inside the fused kernel.

    Args:
        q, k: [B, T, H, Dqk]; v: [B, T, H, Dv] (Dqk may differ from Dv: 192 and 128 in K3); float dtypes
            (mixed ones are promoted); any device.
        scale: the logit scale (a finite number; no default, as in the contract).
        causal: mask future tokens (default True).
        cu_seqlens: int32/int64 [N_seq+1] offsets of packed sequences (B == 1): attention never crosses a
            sequence boundary (one fused call per sequence; read on the host once).
        check_finite: scan q, k, v for NaN / inf first (None: on CPU tensors only; on the GPU it costs a
            host sync), and the result: where the logits overflowed float32 (huge q or k; NaN from the fused
            kernel), the reference's result (those rows' logits in float64) is returned instead.

    Returns:
        o [B, T, H, Dv] in v's dtype.

    Raises:
        TypeError / ValueError: as backends.reference.mla_attention (shapes, dtypes, scale, cu_seqlens, NaN /
            inf when scanned).
    """
    where = "triton.mla_attention"
    check_attention_args(q, k, v, scale, where, causal)
    scan = scan_values(check_finite, q)
    if scan:
        check_attention_finite(q, k, v, where)
    B, T = q.shape[:2]
    if cu_seqlens is not None:
        bounds = check_cu_seqlens(cu_seqlens, B, T, where)
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for a, b in bounds:
            if b > a:
                out[:, a:b] = _sdpa(q[:, a:b], k[:, a:b], v[:, a:b], float(scale), bool(causal))
    else:
        out = _sdpa(q, k, v, float(scale), bool(causal))
    if scan and out.numel() and not bool(torch.isfinite(out).all()):
        # finite inputs, non-finite result: q k^T * scale overflowed float32 (inf - inf in the softmax); the
        # reference forms those rows' logits in float64 (its result, finite)
        return _ref_mla_attention(q, k, v, scale=scale, causal=causal, cu_seqlens=cu_seqlens)
    return out


def _sdpa(q, k, v, scale, causal):
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    dq, dv = q.shape[-1], v.shape[-1]
    d = max(dq, dv)                  # one head dim for the fused kernels: zero columns change no dot product
    qp, kp, vp = (F.pad(t.to(dt), (0, d - t.shape[-1])) if t.shape[-1] < d else t.to(dt) for t in (q, k, v))
    if causal and scale <= 0:
        # torch's causal kernels mask with -inf before scaling (CPU, torch 2.13): a scale <= 0 turns the masked
        # logits into +inf / NaN.  The scale goes into q instead (one more rounding of q, only for this case)
        qp, scale = qp * scale, 1.0
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                       is_causal=causal, scale=scale)
    # (contiguous [B, T, H, Dv], not a strided view of the kernel's [B, H, T, D] output)
    o = o.transpose(1, 2)[..., :dv]
    return o.contiguous() if o.dtype == v.dtype else o.to(dtype=v.dtype, memory_format=torch.contiguous_format)
