"""Block Attention Residuals (attention over depth): the float32 PyTorch reference.

Math source: "Attention Residuals" (Kimi team, arXiv 2603.15031), Block AttnRes, and spec/OPS.md
(section attn_residual), which is the contract followed here to the letter:

    logit_i = sum_d query[d] * RMSNorm(sources_i; rms_weight, eps)[..., d]
    p       = softmax_i(logit)                          (float32, over the source axis)
    out     = sum_i p_i * sources_i                     (values are NOT normalised)
    out     = RMSNorm(out; output_rms_weight, eps)      (only if output_rms_weight is given)

with RMSNorm(x; w, eps) = x * rsqrt(mean_d(x^2) + eps) * w.

The two-phase form (for the block-batching pass) splits the sources into a completed ``bank`` shared by
all Q queries of a block and one in-block ``partial`` source:

    phase 1:  m_q   = max_i logit_qi                                (over the bank)
              s_q   = sum_i exp(logit_qi - m_q)
              acc_q = sum_i exp(logit_qi - m_q) * bank_i
    merge:    M = max(m_q, l_p),  a = exp(m_q - M),  b = exp(l_p - M)   (l_p: the partial's logit)
              out = (a * acc_q + b * partial) / (a * s_q + b)         (then the optional output norm)

which is the online-softmax (flash-attention) merge rule and equals the direct form over
bank + [partial] up to float32 rounding.

Everything is computed in float32, written for clarity, not speed; gradients flow through ordinary
autograd. The Triton backend (backends/triton/attn_residual.py) has the same signatures.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .ops import check_eps, check_finite_cpu

__all__ = [
    "attn_residual",
    "attn_residual_phase1",
    "attn_residual_merge",
    "check_attn_residual_args",
    "check_phase1_args",
    "check_merge_args",
]


# ----------------------------------------------------------------------------------------------------
# argument checks (shared with the Triton backend)
# ----------------------------------------------------------------------------------------------------

def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


def _check_vector(name: str, t, d: int, where: str, device=None, of: str = "the sources") -> None:
    """A float [d] tensor; on `device` (that of `of`) when one is given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not _is_float(t):
        raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != 1 or t.shape[0] != d:
        raise ValueError(f"{where}: {name} must have shape [{d}] (d = hidden size of the sources), "
                         f"got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{where}: {name} is on {t.device} but {of} are on {device}")


def _check_sources(name: str, sources, where: str):
    """Checks a non-empty list of same-shape, same-dtype, same-device float tensors; returns (shape, dtype)."""
    if isinstance(sources, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a list/tuple of tensors (one per source), got a single "
                        f"tensor; use list(t.unbind(0)) for a stacked [L, ..., d] tensor")
    if not isinstance(sources, (list, tuple)):
        raise TypeError(f"{where}: {name} must be a list or tuple of tensors, got {type(sources).__name__}")
    if len(sources) == 0:
        raise ValueError(f"{where}: {name} is empty; at least one source is required (L >= 1)")
    first = sources[0]
    for i, s in enumerate(sources):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{where}: {name}[{i}] must be a torch.Tensor, got {type(s).__name__}")
        if not _is_float(s):
            raise TypeError(f"{where}: {name}[{i}] must be a floating-point tensor, got {s.dtype}")
        if s.dim() < 1 or s.shape[-1] == 0:
            raise ValueError(f"{where}: {name}[{i}] must have shape [..., d] with d >= 1, got {list(s.shape)}")
        if s.shape != first.shape:
            raise ValueError(f"{where}: {name}[{i}] has shape {list(s.shape)} but {name}[0] has "
                             f"{list(first.shape)}; all sources must have the same shape")
        if s.dtype != first.dtype:
            raise TypeError(f"{where}: {name}[{i}] has dtype {s.dtype} but {name}[0] has {first.dtype}; "
                            f"all sources must have the same dtype")
        if s.device != first.device:
            raise ValueError(f"{where}: {name}[{i}] is on {s.device} but {name}[0] is on {first.device}")
    return tuple(first.shape), first.dtype


def check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight,
                             where: str = "attn_residual"):
    """Validates the arguments of ``attn_residual``; returns (source shape, source dtype, d)."""
    shape, dtype = _check_sources("sources", sources, where)
    d = shape[-1]
    dev = sources[0].device
    _check_vector("query", query, d, where, dev)
    _check_vector("rms_weight", rms_weight, d, where, dev)
    if output_rms_weight is not None:
        _check_vector("output_rms_weight", output_rms_weight, d, where, dev)
    check_eps(eps, where)
    check_finite_cpu(where, query=query, rms_weight=rms_weight, output_rms_weight=output_rms_weight,
                      **{f"sources[{i}]": s for i, s in enumerate(sources)})
    return shape, dtype, d


def check_phase1_args(queries, bank, rms_weights, eps, where: str = "attn_residual_phase1",
                      acc_dtype: torch.dtype = torch.float32):
    """Validates the arguments of ``attn_residual_phase1`` (acc_dtype: float32, float16 or bfloat16, else
    TypeError); returns (bank shape, bank dtype, Q, d)."""
    shape, dtype = _check_sources("bank", bank, where)
    d = shape[-1]
    for name, t in (("queries", queries), ("rms_weights", rms_weights)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not _is_float(t):
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != d or t.shape[0] < 1:
            raise ValueError(f"{where}: {name} must have shape [Q, {d}] with Q >= 1 (d = hidden size of "
                             f"the bank), got {list(t.shape)}")
    if queries.shape != rms_weights.shape:
        raise ValueError(f"{where}: queries {list(queries.shape)} and rms_weights "
                         f"{list(rms_weights.shape)} must have the same shape [Q, d]")
    check_eps(eps, where)
    check_finite_cpu(where, queries=queries, rms_weights=rms_weights, **{f"bank[{i}]": s for i, s in enumerate(bank)})
    if acc_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{where}: acc_dtype {acc_dtype} is not float32/float16/bfloat16")
    return shape, dtype, queries.shape[0], d


def check_merge_args(acc, m, s, partial, query, rms_weight, eps, output_rms_weight,
                     where: str = "attn_residual_merge"):
    """Validates the arguments of ``attn_residual_merge``; returns (token shape, d)."""
    for name, t in (("acc", acc), ("m", m), ("s", s)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not _is_float(t):
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    if acc.dim() < 1 or acc.shape[-1] == 0:
        raise ValueError(f"{where}: acc must have shape [..., d], got {list(acc.shape)}")
    tok = tuple(acc.shape[:-1])
    d = acc.shape[-1]
    if tuple(m.shape) != tok or tuple(s.shape) != tok:
        raise ValueError(f"{where}: m {list(m.shape)} and s {list(s.shape)} must have acc's token shape "
                         f"{list(tok)} (acc is {list(acc.shape)}); pass acc[q], m[q], s[q] of one query")
    if partial is not None:
        if not isinstance(partial, torch.Tensor):
            raise TypeError(f"{where}: partial must be a torch.Tensor or None, got {type(partial).__name__}")
        if not _is_float(partial):
            raise TypeError(f"{where}: partial must be a floating-point tensor, got {partial.dtype}")
        if tuple(partial.shape) != tuple(acc.shape):
            raise ValueError(f"{where}: partial has shape {list(partial.shape)} but acc has "
                             f"{list(acc.shape)}; they must match")
        if partial.device != acc.device:
            raise ValueError(f"{where}: partial is on {partial.device} but acc is on {acc.device}")
    _check_vector("query", query, d, where)
    _check_vector("rms_weight", rms_weight, d, where)
    if output_rms_weight is not None:
        _check_vector("output_rms_weight", output_rms_weight, d, where)
    check_eps(eps, where)
    return tok, d


# ----------------------------------------------------------------------------------------------------
# the reference math
# ----------------------------------------------------------------------------------------------------

def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean_d(x^2) + eps), keepdim, float32."""
    return torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _logit(x: torch.Tensor, query: torch.Tensor, rms_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_d query * RMSNorm(x; rms_weight, eps) over the last axis; x float32 [..., d] -> [...]."""
    return (x * _rms(x, eps) * rms_weight.float() * query.float()).sum(dim=-1)


def attn_residual(query: torch.Tensor, sources: Sequence[torch.Tensor], rms_weight: torch.Tensor, *,
                  eps: float = 1e-6, output_rms_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over depth (Block AttnRes): a softmax-weighted mix of the residual sources.

    Math: arXiv 2603.15031 (Attention Residuals), spec/OPS.md "attn_residual":
    ``logit_i = <query, RMSNorm(sources_i; rms_weight, eps)>``, ``p = softmax_i(logit)`` in float32,
    ``out = sum_i p_i * sources_i`` (values not normalised), then ``RMSNorm(out; output_rms_weight, eps)``
    when ``output_rms_weight`` is given.

    Args:
        query: [d] float tensor, the learned pseudo-query of this sublayer.
        sources: list/tuple of L >= 1 tensors, each [..., d], all of the same shape, dtype and device.
        rms_weight: [d] float tensor, the key RMSNorm weight.
        eps: RMSNorm epsilon (both norms), a finite number > 0. Default 1e-6.
        output_rms_weight: optional [d] weight of a fused output RMSNorm (the next sublayer's pre-norm).

    Returns:
        out: [..., d] in the sources' dtype (computed in float32).

    Raises:
        ValueError: empty ``sources``, mismatched shapes/devices, a query/weight not of shape [d], bad eps,
            NaN or inf in a CPU input (GPU inputs are not scanned: it would synchronise every call).
        TypeError: a non-tensor or non-float argument, sources of different dtypes.
    """
    shape, dtype, d = check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight)
    x = torch.stack([s.float() for s in sources], dim=0)                  # [L, ..., d]
    logits = _logit(x, query, rms_weight, eps)                             # [L, ...]
    p = torch.softmax(logits, dim=0)                                       # float32, over depth
    out = (p.unsqueeze(-1) * x).sum(dim=0)                                 # [..., d]
    if output_rms_weight is not None:
        out = out * _rms(out, eps) * output_rms_weight.float()
    return out.to(dtype)


def attn_residual_phase1(queries: torch.Tensor, bank: Sequence[torch.Tensor], rms_weights: torch.Tensor, *,
                         eps: float = 1e-6, acc_dtype: torch.dtype = torch.float32):
    """Phase 1 of the two-phase Block AttnRes: all Q queries of a block scored against the completed bank.

    Math: spec/OPS.md "Two-phase form"; the per-query softmax statistics are those of online softmax
    (Milakov & Gimelshein 2018; flash-attention's merge rule). For query q and bank source i,
    ``logit_qi = <queries[q], RMSNorm(bank_i; rms_weights[q], eps)>``;
    ``m_q = max_i logit_qi``, ``s_q = sum_i exp(logit_qi - m_q)``, ``acc_q = sum_i exp(logit_qi - m_q) bank_i``.
    ``acc_q / s_q`` is exactly ``attn_residual(queries[q], bank, rms_weights[q])`` (without output norm).

    Args:
        queries: [Q, d] float tensor, one pseudo-query per AttnRes read of the block.
        bank: list/tuple of L >= 1 tensors, each [..., d] (same shape, dtype, device).
        rms_weights: [Q, d] float tensor, the key RMSNorm weight of each read.
        eps: RMSNorm epsilon, > 0.
        acc_dtype: dtype of ``acc`` (float32, the default, or float16 / bfloat16: computed in float32 and rounded
            once, as the Triton backend's option of the same name).

    Returns:
        (acc, m, s): acc [Q, ..., d] acc_dtype (un-normalised weighted sum), m [Q, ...] float32 (max logit),
        s [Q, ...] float32 (sum of exp(logit - m), >= 1).

    Raises:
        ValueError / TypeError as ``attn_residual`` (empty bank, shape/dtype mismatch, bad eps, NaN/inf in a CPU
        input); TypeError for an acc_dtype other than float32 / float16 / bfloat16.
    """
    shape, dtype, Q, d = check_phase1_args(queries, bank, rms_weights, eps, acc_dtype=acc_dtype)
    x = torch.stack([b.float() for b in bank], dim=0)                      # [L, ..., d]
    xr = x * _rms(x, eps)                                                   # [L, ..., d]
    qw = queries.float() * rms_weights.float()                              # [Q, d]
    logits = torch.einsum("l...d,qd->ql...", xr, qw)                       # [Q, L, ...]
    m = logits.amax(dim=1)                                                  # [Q, ...]
    e = torch.exp(logits - m.unsqueeze(1))                                  # [Q, L, ...]
    s = e.sum(dim=1)                                                        # [Q, ...]
    acc = torch.einsum("ql...,l...d->q...d", e, x)                          # [Q, ..., d]
    return acc.to(acc_dtype), m, s


def attn_residual_merge(acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, partial: Optional[torch.Tensor],
                        query: torch.Tensor, rms_weight: torch.Tensor, *, eps: float = 1e-6,
                        output_rms_weight: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Phase 2 of the two-phase Block AttnRes: merge one query's bank result with the in-block partial.

    Math: online-softmax merge (flash-attention), spec/OPS.md "Two-phase form". With
    ``l_p = <query, RMSNorm(partial; rms_weight, eps)>``, ``M = max(m, l_p)``, ``a = exp(m - M)``,
    ``b = exp(l_p - M)``: ``out = (a * acc + b * partial) / (a * s + b)``; without a partial,
    ``out = acc / s``. Then the optional output RMSNorm. The result equals
    ``attn_residual(query, bank + [partial], rms_weight, ...)``.

    Args:
        acc: [..., d] (float32 from phase 1, or a lower-precision copy of it), for ONE query: ``acc[q]``.
        m, s: [...] float tensors, that query's ``m[q]``, ``s[q]`` from phase 1.
        partial: [..., d] in-block partial sum (the extra source), or None (then only the bank is mixed).
        query: [d], the same query as row q of phase 1's ``queries``; rms_weight: [d], likewise.
        eps: RMSNorm epsilon, > 0 (the same as phase 1's).
        output_rms_weight: optional [d] weight of the fused output RMSNorm.
        out_dtype: dtype of the result; default partial's dtype, or acc's dtype when partial is None.

    Returns:
        out: [..., d] in ``out_dtype``.

    Raises:
        ValueError / TypeError on mismatched shapes, non-float tensors, bad eps.
    """
    check_merge_args(acc, m, s, partial, query, rms_weight, eps, output_rms_weight)
    if out_dtype is None:
        out_dtype = partial.dtype if partial is not None else acc.dtype
    a32, m32, s32 = acc.float(), m.float(), s.float()
    if partial is None:
        out = a32 / s32.unsqueeze(-1)
    else:
        x = partial.float()
        lp = _logit(x, query, rms_weight, eps)
        big = torch.maximum(m32, lp)
        a = torch.exp(m32 - big)
        b = torch.exp(lp - big)
        out = (a.unsqueeze(-1) * a32 + b.unsqueeze(-1) * x) / (a * s32 + b).unsqueeze(-1)
    if output_rms_weight is not None:
        out = out * _rms(out, eps) * output_rms_weight.float()
    return out.to(out_dtype)
