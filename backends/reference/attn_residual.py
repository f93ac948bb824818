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
    "check_attn_residual_result",
    "check_two_phase_result",
    "needs_safe_path",
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

#: |values| past which a float32 sum of squares (or of query products) over a row could overflow: d * 2^80
#: stays inside float32 for any d < 2^48. A row or vector beyond it is scaled by a power of two first (exact),
#: and everything at or below it is computed exactly as the plain formulas do, bit for bit.
SAFE_MAGNITUDE = 2.0 ** 40


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32, exactly, for an integer tensor e in [-126, 127] (the bits of the float built directly)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _big_exponent(m: torch.Tensor) -> torch.Tensor:
    """Where m (>= 0, float32) exceeds SAFE_MAGNITUDE: e with m / 2^e in [0.5, 1), at most 128; elsewhere 0."""
    return torch.where(m > SAFE_MAGNITUDE, torch.frexp(m).exponent, 0)


def _may_hold(mask: torch.Tensor) -> bool:
    """Whether a bool tensor may hold a True: read for CPU tensors (free there), assumed on a GPU (reading it would
    synchronise every call; the branch-free form below is taken instead)."""
    return mask.device.type != "cpu" or bool(mask.any())


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean_d(x^2) + eps) over the last axis (RMSNorm without its weight), float32 [..., d].

    A row whose largest |x| passes SAFE_MAGNITUDE (its x^2 could overflow float32, and rsqrt(inf) = 0 would
    zero the row) is first divided by 2^e ~ its largest |x|; the identity x * rsqrt(mean x^2 + eps) = (x / 2^e)
    * rsqrt(mean (x / 2^e)^2 + eps / 4^e) then holds, and eps / 4^e (below 2^-80) is left out: next to
    mean (x / 2^e)^2 >= 1 / (4 d) it is below float32's resolution. Other rows: the plain formula, bit for bit."""
    with torch.no_grad():
        e = _big_exponent(x.detach().abs().amax(dim=-1, keepdim=True))
    plain = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if not _may_hold(e > 0):
        return plain
    xs = x * _pow2(-e.clamp(max=126))                   # (a factor 1 for ordinary rows; 2^-126 at most)
    ms = xs.pow(2).mean(dim=-1, keepdim=True)
    # (the plain form itself where it is right, so that values and gradients there are the plain formula's; the
    # scaled form of those rows divides by 1 instead: no inf / NaN in its backward)
    return torch.where(e > 0, xs * torch.rsqrt(torch.where(e > 0, ms, 1.0)), plain)


def _scaled_qw(query: torch.Tensor, rms_weight: torch.Tensor):
    """(q', w', E): query and rms_weight as float32, each divided by a power of two where its largest |value|
    passes SAFE_MAGNITUDE (so that q' * w' * RMSNorm(x) and its sum over d cannot overflow), and E, the int
    tensor with q * w = q' * w' * 2^E (0 for ordinary vectors, which are then unchanged)."""
    qf, wf = query.float(), rms_weight.float()
    with torch.no_grad():
        eq = _big_exponent(qf.detach().abs().amax())
        ew = _big_exponent(wf.detach().abs().amax())
    return qf * _pow2(-eq.clamp(max=126)), wf * _pow2(-ew.clamp(max=126)), eq.clamp(max=126) + ew.clamp(max=126)


def _logit(x: torch.Tensor, query: torch.Tensor, rms_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_d query * RMSNorm(x; rms_weight, eps) over the last axis; x float32 [..., d] -> [...] (ordinary
    magnitudes; huge query / weight values: _scaled_qw and _softmax_scaled)."""
    return (_normed(x, eps) * rms_weight.float() * query.float()).sum(dim=-1)


def _softmax_scaled(lg: torch.Tensor, E: torch.Tensor, dim: int) -> torch.Tensor:
    """softmax(lg * 2^E) along dim for logits lg held scaled by 2^-E (E >= 0, up to 252: the true logits may lie
    beyond float32). With E = 0: torch.softmax(lg) itself. Otherwise the differences to the max, lg - max <= 0,
    are multiplied up by 2^E in three exact steps (each factor inside float32; a difference that leaves the
    range becomes -inf, weight 0, never NaN): the largest logits take the weight, as the exact softmax gives."""
    if not _may_hold(E > 0):
        return torch.softmax(lg, dim=dim)
    z = lg - lg.amax(dim=dim, keepdim=True).detach()
    for part in (E // 3, (E - E // 3) // 2, E - E // 3 - (E - E // 3) // 2):
        z = z * _pow2(part)
    return torch.where(E == 0, torch.softmax(lg, dim=dim), torch.softmax(z, dim=dim))


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

    Huge values: a source row or the query / weight past 2^40 (SAFE_MAGNITUDE: where x^2 or the logits could
    overflow float32) is scaled by a power of two first, exactly, and the softmax of logits beyond float32 is
    taken on their scaled differences: the result is finite wherever the exact one is (else ValueError).

    Raises:
        ValueError: empty ``sources``, mismatched shapes/devices, a query/weight not of shape [d], bad eps,
            NaN or inf in a CPU input (GPU inputs are not scanned: it would synchronise every call), a CPU
            result that overflows its dtype (check_attn_residual_result).
        TypeError: a non-tensor or non-float argument, sources of different dtypes.
    """
    shape, dtype, d = check_attn_residual_args(query, sources, rms_weight, eps, output_rms_weight)
    x = torch.stack([s.float() for s in sources], dim=0)                  # [L, ..., d]
    qs, ws, E = _scaled_qw(query, rms_weight)                              # (q, w themselves unless huge)
    logits = (_normed(x, eps) * ws * qs).sum(dim=-1)                       # [L, ...] (times 2^E)
    p = _softmax_scaled(logits, E, dim=0)                                  # float32, over depth
    out = (p.unsqueeze(-1) * x).sum(dim=0)                                 # [..., d]
    if output_rms_weight is not None:
        out = _normed(out, eps) * output_rms_weight.float()
    out = out.to(dtype)
    check_attn_residual_result(out, dtype, "attn_residual")
    return out


def check_attn_residual_result(out: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    """ValueError when the result of finite inputs holds inf / NaN (CPU tensors; on a GPU the scan would
    synchronise every call): only a fused output norm whose weight is huge can leave float32 (or a 16-bit
    dtype's range), as the exact result then does too."""
    if out.device.type == "cpu" and out.numel() and not bool(torch.isfinite(out).all()):
        raise ValueError(f"{where}: the result overflows {dtype} (finite inputs; |output_rms_weight| * sqrt(d) "
                         f"past the dtype's largest value)")


def check_two_phase_result(where: str, **tensors) -> None:
    """ValueError naming the first result of the two-phase form that holds inf / NaN from finite inputs (CPU
    tensors): its float32 logit max m cannot hold logits past float32's range (huge queries * rms_weights),
    which the direct attn_residual takes."""
    for name, t in tensors.items():
        if t.device.type == "cpu" and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} overflows float32 (finite inputs: the logits or the result leave "
                             f"float32's range, e.g. huge queries * rms_weights); attn_residual computes such "
                             f"logits scaled")


def needs_safe_path(query, sources, rms_weight) -> bool:
    """Whether a float32 kernel's direct sums could overflow for these inputs: a source value or |query *
    rms_weight| past SAFE_MAGNITUDE (2^40). Scanned on CPU tensors only (on a GPU the scan would synchronise
    every call, as the NaN / inf scan would; False there). A backend then returns this reference's result, which
    scales such rows exactly (_normed, _scaled_qw)."""
    if sources[0].device.type != "cpu":
        return False
    qw = (query.detach().double() * rms_weight.detach().double()).abs().amax()
    return bool(qw > SAFE_MAGNITUDE) or any(s.numel() and bool(s.detach().abs().amax() > SAFE_MAGNITUDE)
                                            for s in sources)


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
        input); TypeError for an acc_dtype other than float32 / float16 / bfloat16; ValueError for a CPU result
        that overflows (logits past float32, which m cannot hold: check_two_phase_result).
    """
    shape, dtype, Q, d = check_phase1_args(queries, bank, rms_weights, eps, acc_dtype=acc_dtype)
    x = torch.stack([b.float() for b in bank], dim=0)                      # [L, ..., d]
    xr = _normed(x, eps)                                                    # [L, ..., d]
    qw = queries.float() * rms_weights.float()                              # [Q, d]
    logits = torch.einsum("l...d,qd->ql...", xr, qw)                       # [Q, L, ...]
    m = logits.amax(dim=1)                                                  # [Q, ...]
    e = torch.exp(logits - m.unsqueeze(1))                                  # [Q, L, ...]
    s = e.sum(dim=1)                                                        # [Q, ...]
    acc = torch.einsum("ql...,l...d->q...d", e, x)                          # [Q, ..., d]
    acc = acc.to(acc_dtype)
    check_two_phase_result("attn_residual_phase1", m=m, s=s, acc=acc)
    return acc, m, s


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
        ValueError / TypeError on mismatched shapes, non-float tensors, bad eps; ValueError for a CPU result that
        overflows (check_two_phase_result).
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
        out = _normed(out, eps) * output_rms_weight.float()
    out = out.to(out_dtype)
    check_two_phase_result("attn_residual_merge", out=out)
    return out
