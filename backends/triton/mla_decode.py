"""MLA decode in the absorbed form as a split-T (flash-decoding) Triton kernel: one query token per row attends over
the latent cache, which every head shares, so each program reads a block of the cache once for a block of heads.

    s[b, h, j] = scale * (q_lat[b, h] . C[b, j] + q_rope[b, h] . R[b, j])        j < length[b]
    o_lat[b, h] = sum_j softmax_j(s[b, h]) C[b, j]

with q_lat = q_nope W_UK (W_UK: the nope rows of kv_b_proj per head, folded into the query) and the layer's output
o = o_lat W_UV^T after it (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1.2 and App. C; the split over T and the merge of
the partial softmaxes: Dao et al., "Flash-Decoding for long-context inference", 2023). The kernel computes one
partial (max, sum, weighted sum) per (row, block of heads, split of T); the merge of the splits is a few torch ops.

Not tuned on a GPU yet (split size and head block chosen by the rule below); issue 35 item 4 asks for 2x of the
latent cache's read floor at T = 1M, 96 heads (benchmarks/generate.py measures it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends import interpreting

from .guard import cdiv, next_power_of_2

__all__ = ["mla_decode"]

LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(QL, QR, C, R, LEN, ACC, MX, SM, H, KL, DR, SPLIT, qk_scale,
                       s_qb, s_qh, s_rb, s_rh, s_cb, s_cn, s_pb, s_pn, s_ab, s_as, s_ah, s_mb, s_ms,
                       BH: tl.constexpr, BN: tl.constexpr, BKL: tl.constexpr, BDR: tl.constexpr,
                       HAS_ROPE: tl.constexpr, PREC: tl.constexpr):
    """Program (row b, head block, split): the online softmax over keys [split * SPLIT, min(+SPLIT, len[b]))."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(LEN + b)
    start = sp * SPLIT
    end = tl.minimum(start + SPLIT, length)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < H
    kk = tl.arange(0, BKL)
    km = kk < KL
    b64 = b.to(tl.int64)
    ql = tl.load(QL + b64 * s_qb + heads[:, None] * s_qh + kk[None, :], mask=hm[:, None] & km[None, :], other=0.0)
    ql = (ql * qk_scale).to(C.dtype.element_ty)
    if HAS_ROPE:
        rr = tl.arange(0, BDR)
        rm = rr < DR
        qr = tl.load(QR + b64 * s_rb + heads[:, None] * s_rh + rr[None, :], mask=hm[:, None] & rm[None, :],
                     other=0.0)
        qr = (qr * qk_scale).to(R.dtype.element_ty)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BKL], dtype=tl.float32)
    for n0 in range(start, end, BN):
        nn = n0 + tl.arange(0, BN)
        nm = nn < end
        c = tl.load(C + b64 * s_cb + nn.to(tl.int64)[:, None] * s_cn + kk[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0)
        s = tl.dot(ql, tl.trans(c), input_precision=PREC)             # [BH, BN], log2 units
        if HAS_ROPE:
            r = tl.load(R + b64 * s_pb + nn.to(tl.int64)[:, None] * s_pn + rr[None, :],
                        mask=nm[:, None] & rm[None, :], other=0.0)
            s += tl.dot(qr, tl.trans(r), input_precision=PREC)
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PREC)
        m_i = m_new
    out = b64 * s_ab + sp * s_as + heads[:, None] * s_ah + kk[None, :]
    tl.store(ACC + out, acc, mask=hm[:, None] & km[None, :])
    tl.store(MX + b64 * s_mb + sp * s_ms + heads, m_i, mask=hm)
    tl.store(SM + b64 * s_mb + sp * s_ms + heads, l_i, mask=hm)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor | None, latent: torch.Tensor, rope: torch.Tensor | None,
               lengths: torch.Tensor, scale: float, *, split: int | None = None,
               max_length: int | None = None) -> torch.Tensor:
    """Attention of one query per row over the MLA latent cache (see the module docstring).

    Args:
        q_lat: [B, H, kv_lora_rank] (float32 or the cache's dtype): the queries with W_UK folded in.
        q_rope: [B, H, qk_rope_dim] or None (no rope part).
        latent: [B, >= max(lengths), kv_lora_rank] the cache (float32 / float16 / bfloat16; last dim contiguous).
        rope: [B, >= max(lengths), qk_rope_dim] or None.
        lengths: int [B], >= 1: row b attends to keys 0 .. lengths[b] - 1.
        scale: the logit scale (1 / sqrt(qk_nope_dim + qk_rope_dim) in MLA).
        split: keys per split (default: about two programs per SM over all rows and head blocks, at least 64).
        max_length: max(lengths) when the caller knows it (saves reading it back from the device).
    Returns:
        o_lat [B, H, kv_lora_rank] float32 (multiply by W_UV^T per head for the layer's attention output).
    The query is rounded to the cache's dtype for the tensor-core dots; scores and the softmax are float32.
    """
    B, H, KL = q_lat.shape
    DR = rope.shape[-1] if rope is not None and q_rope is not None and rope.shape[-1] else 0
    BH = max(16, min(32, next_power_of_2(H)))
    BN = 32
    n_hb = cdiv(H, BH)
    Lmax = int(lengths.max()) if max_length is None else int(max_length)
    if split is None:
        sms = torch.cuda.get_device_properties(latent.device).multi_processor_count if latent.is_cuda else 4
        splits = max(1, cdiv(2 * sms, B * n_hb))
        split = max(64, cdiv(Lmax, splits))
    split = cdiv(split, BN) * BN
    n_sp = cdiv(Lmax, split)
    f32 = dict(dtype=torch.float32, device=latent.device)
    acc = torch.empty(B, n_sp, H, KL, **f32)
    mx = torch.empty(B, n_sp, H, **f32)
    sm = torch.empty(B, n_sp, H, **f32)
    ql = q_lat.contiguous()
    qr = q_rope.contiguous() if DR else ql
    r = rope if DR else latent
    grid = (B, n_hb, n_sp)
    _mla_decode_kernel[grid](ql, qr, latent, r, lengths.to(device=latent.device, dtype=torch.int32).contiguous(),
                             acc, mx, sm, H, KL, DR, split, float(scale) * LOG2E,
                             ql.stride(0), ql.stride(1), qr.stride(0), qr.stride(1), latent.stride(0), latent.stride(1),
                             r.stride(0), r.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), mx.stride(0),
                             mx.stride(1), BH=BH, BN=BN, BKL=max(16, next_power_of_2(KL)),
                             BDR=max(16, next_power_of_2(max(DR, 1))), HAS_ROPE=DR > 0,
                             # float32 caches: three tf32 products (about float32 accuracy) on the GPU, FMAs in the
                             # interpreter; 16-bit ones take the tensor cores as they are
                             PREC="ieee" if interpreting() else "tf32x3", num_warps=4)
    # merge the splits' partial softmaxes (log2 units); an empty split has max -inf and sum 0
    top = mx.max(dim=1, keepdim=True).values
    w = torch.exp2(mx - top)
    w = torch.where(torch.isfinite(mx), w, torch.zeros_like(w))
    return (acc * w[..., None]).sum(1) / (sm * w).sum(1)[..., None]
