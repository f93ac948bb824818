"""Reference implementations of the simple graph ops and the MLA attention core: plain PyTorch,
computed in float32, written for clarity. Each returns its result in the input's dtype unless noted.
Semantics: ../shared/spec/OPS.md ("Other graph ops", "gated MLA attention core")."""
from __future__ import annotations

import numbers

import numpy as np
import torch
import torch.nn.functional as F


def _f32(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"backends.reference: expected a torch.Tensor, got {type(x).__name__}")
    return x.float()


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill their storage span once each (a permutation of a contiguous layout)."""
    want = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if st != want:
            return False
        want *= n
    return True


def writable(out, dtype: torch.dtype, *operands: torch.Tensor) -> bool:
    """Whether an elementwise result of ``operands`` in ``dtype`` may be written into ``out`` (the ``out=`` of the
    ops here) with the values and the layout it has when computed into a fresh tensor: ``out`` has the result's
    shape and dtype, is dense, and every operand of its shape has its strides (an elementwise result takes the
    layout of its full-shape operands; broadcast ones do not decide it)."""
    if out is None or out.dtype != dtype or not _dense(out):
        return False
    if tuple(out.shape) != tuple(torch.broadcast_shapes(*(x.shape for x in operands))):
        return False
    return all(x.shape != out.shape or all(a == b for n, a, b in zip(x.shape, x.stride(), out.stride()) if n != 1)
               for x in operands)


def _store(out: torch.Tensor, fn, *xs):
    """``fn(*xs)`` (float32 math) into ``out``: computed there when ``out`` is float32, else rounded into it (the
    rounding of ``.to(dtype)``). Returns ``out``."""
    if out.dtype == torch.float32:
        return fn(*xs, out=out)
    return out.copy_(fn(*xs))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids]. ids [...] int64 in [0, vocab); weight [vocab, d] -> [..., d] in weight's dtype.
    Raises IndexError naming the first out-of-range token id."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"embedding: token ids must be int64/int32, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
        bad = ids[(ids < 0) | (ids >= weight.shape[0])][0].item()
        raise IndexError(f"embedding: token id {bad} is outside the vocabulary [0, {weight.shape[0]})")
    return weight[ids]


def _check_weight(w, shape_ok, want: str, where: str) -> None:
    """A weight tensor of the expected shape (any real dtype: it is used as float32, so an integer norm weight
    works, as the Triton layers take it): TypeError / ValueError naming what was expected.  shape_ok: a bool, or
    a callable of the weight tested only once it is known to be a tensor."""
    if not isinstance(w, torch.Tensor) or w.is_complex() or w.dtype == torch.bool:
        raise TypeError(f"{where}: the weight must be a real tensor, got "
                        f"{w.dtype if isinstance(w, torch.Tensor) else type(w).__name__}")
    if not (shape_ok(w) if callable(shape_ok) else shape_ok):
        raise ValueError(f"{where}: the weight must be {want}, got {list(w.shape)}")


def check_conv_weight(weight, where: str) -> None:
    """A short convolution's taps: a real tensor (TypeError) of shape [C, 1, W] or [C, W] with W >= 1
    (ValueError)."""
    _check_weight(weight, lambda w: w.dim() in (2, 3) and (w.dim() == 2 or w.shape[1] == 1) and w.shape[-1] >= 1,
                  "[C, 1, W] or [C, W] with W >= 1", where)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           _where: str = "linear") -> torch.Tensor:
    """x @ weight^T (+ bias). x [..., in]; weight [out, in] -> [..., out] in x's dtype (float32 math).
    Raises TypeError for a non-float x, ValueError for shapes that do not fit."""
    _check_float_input(x, _where, min_dim=1)
    _check_weight(weight, lambda w: w.dim() == 2 and w.shape[1] == x.shape[-1],
                  f"[out, {x.shape[-1]}] for x {list(x.shape)}", _where)
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{_where}: bias must be a tensor or None, got {type(bias).__name__}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_where}: bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    y = _f32(x) @ _f32(weight).t()
    if bias is not None:
        y = y + _f32(bias)
    return y.to(x.dtype)


def lm_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """logits = x @ weight^T; weight [vocab, d].  Raises as linear."""
    return linear(x, weight, _where="lm_head")


def check_eps(eps, where: str) -> None:
    """A norm's epsilon: a finite number > 0 (ValueError otherwise; eps <= 0 gives NaN for a zero row)."""
    if isinstance(eps, torch.Tensor):
        raise ValueError(f"{where}: eps must be a Python or numpy number, got a tensor ({eps!r}); pass "
                         f"float(eps)")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < float("inf"):
        raise ValueError(f"{where}: eps must be a finite number > 0, got {eps!r}")


def check_finite_cpu(where: str, **tensors) -> None:
    """ValueError naming the first CPU tensor that holds NaN or inf (NaN in gives NaN out; GPU tensors are not
    scanned: the scan would synchronise every call; None entries are skipped)."""
    for name, t in tensors.items():
        if t is not None and t.device.type == "cpu" and t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} holds NaN or inf")


def check_flag(value, name: str, where: str) -> bool:
    """A yes/no argument (output_final_state, causal, silu): True or False (numpy's bool and a 0-d bool tensor
    too); TypeError for anything else (a truthy string or list would silently mean True). Returns a bool."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0 and not value.is_meta:
        return bool(value)
    raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")


def check_devices(where: str, *, allow_meta: bool = False, **tensors) -> None:
    """The tensors among ``tensors`` (None and other values are skipped) on one device, else ValueError naming
    each one's device; and, unless allow_meta (an op that reads no values, e.g. kda_gate on meta tensors only),
    none on the meta device, whose tensors hold no values to compute with (ValueError naming them)."""
    named = {n: t for n, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len({t.device for t in named.values()}) > 1:
        raise ValueError(f"{where}: the tensors are on different devices: "
                         + ", ".join(f"{n} on {t.device}" for n, t in named.items()))
    meta = [n for n, t in named.items() if t.device.type == "meta"]
    if meta and not allow_meta:
        raise ValueError(f"{where}: meta tensors hold no data to compute with: {', '.join(meta)} (for shapes "
                         f"alone, compile the model with device='meta': dsl's typed IR)")


def _check_float_input(x, where: str, min_dim: int = 0) -> None:
    """x a floating-point tensor (TypeError) of at least min_dim dimensions (ValueError)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{where}: x must be a floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{where}: x must have at least {min_dim} dimension(s) (the last one is the feature "
                         f"dimension), got a {x.dim()}-d tensor")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight (Zhang & Sennrich 2019, eq. 4); float32 math.

    x [..., d] float; weight [d] (any real dtype, used as float32). Returns x's shape and dtype. ``out``: a tensor
    to write the result into (x itself allowed: each row is read before it is written); taken where
    :func:`writable`, else the result is a fresh tensor. Raises TypeError for a non-float x, ValueError for eps
    not a finite number > 0 or a weight that is not [d]."""
    _check_float_input(x, "rmsnorm", min_dim=1)
    check_eps(eps, "rmsnorm")
    _check_weight(weight, lambda w: tuple(w.shape) == (x.shape[-1],), f"[d] with d = x's last size {x.shape[-1]}",
                  "rmsnorm")
    xf = _f32(x)
    scaled = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if writable(out, x.dtype, x):
        return _store(out, torch.mul, scaled, _f32(weight))
    return (scaled * _f32(weight)).to(x.dtype)


def l2norm(x: torch.Tensor, *, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(sum(x^2, -1) + eps) (the q/k normalisation of KDA).

    x [..., d] float. Returns x's shape and dtype. ``out``: as for :func:`rmsnorm`. Raises TypeError for a
    non-float x, ValueError for eps not a finite number > 0."""
    _check_float_input(x, "l2norm")
    check_eps(eps, "l2norm")
    xf = _f32(x)
    r = torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)
    if writable(out, x.dtype, x):
        return _store(out, torch.mul, xf, r)
    return (xf * r).to(x.dtype)


def short_conv(x: torch.Tensor, weight: torch.Tensor, *, initial_state: torch.Tensor | None = None,
               output_final_state: bool = False):
    """Causal depthwise convolution over time: y[b,t,c] = sum_j w[c, j] * x[b, t - W + 1 + j, c].

    x [B, T, C]; weight [C, 1, W] or [C, W]; initial_state [B, C, W-1] (the last W-1 inputs before t=0,
    zeros if None). Returns (y [B, T, C] in x's dtype, final_state [B, C, W-1] float32 when
    output_final_state (width 1: [B, C, 0]), else None).
    Raises TypeError for a non-float x or an output_final_state that is not a bool, ValueError for mismatched
    shapes or NaN/inf in a CPU input."""
    _check_float_input(x, "short_conv")
    check_conv_weight(weight, "short_conv")
    output_final_state = check_flag(output_final_state, "output_final_state", "short_conv")
    w = _f32(weight).reshape(weight.shape[0], -1)
    C, W = w.shape
    if x.dim() != 3 or x.shape[-1] != C:
        raise ValueError(f"short_conv: x must be [B, T, {C}], got {list(x.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (x.shape[0], C, W - 1):
        raise ValueError(f"short_conv: initial_state must be [B, C, W-1] = {[x.shape[0], C, W - 1]}, got "
                         f"{list(initial_state.shape)}")
    check_finite_cpu("short_conv", x=x, weight=weight, initial_state=initial_state)
    if x.shape[1] == 0:
        final = (_f32(initial_state).clone() if initial_state is not None else
                 torch.zeros(x.shape[0], C, W - 1, device=x.device)) if output_final_state else None
        return x.clone(), final
    xt = _f32(x).transpose(1, 2)                                  # [B, C, T]
    prev = (torch.zeros(x.shape[0], C, W - 1, dtype=torch.float32, device=x.device) if initial_state is None
            else _f32(initial_state))
    xp = torch.cat([prev, xt], dim=-1)                             # [B, C, W-1+T]
    y = F.conv1d(xp, w.unsqueeze(1), groups=C)                     # [B, C, T]
    # (width 1: an empty [B, C, 0] state, so that a decoding loop can read its shape)
    final = xp[..., xp.shape[-1] - (W - 1):].clone() if output_final_state else None
    return y.transpose(1, 2).to(x.dtype), final


def _silu(x, out=None):
    return F.silu(x) if out is None else torch.ops.aten.silu.out(x, out=out)


def silu(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU x * sigmoid(x) (Elfwing et al. 2018), float32 math, x's shape and dtype. ``out``: a tensor to write
    the result into (x itself allowed), taken where :func:`writable`, else the result is a fresh tensor (so for
    every elementwise op here)."""
    xf = _f32(x)
    if writable(out, x.dtype, x):
        return _store(out, _silu, xf)
    return F.silu(xf).to(x.dtype)


def sigmoid(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """1 / (1 + e^-x), float32 math, x's shape and dtype; ``out`` as for :func:`silu`."""
    xf = _f32(x)
    if writable(out, x.dtype, x):
        return _store(out, torch.sigmoid, xf)
    return torch.sigmoid(xf).to(x.dtype)


def add(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """a + b (broadcasting as torch), float32 math, rounded to a's dtype (the residual add); ``out`` as for
    :func:`silu` (a or b itself allowed)."""
    af, bf = _f32(a), _f32(b)
    if writable(out, a.dtype, a, b):
        return _store(out, torch.add, af, bf)
    return (af + bf).to(a.dtype)


def mul(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """a * b (broadcasting as torch), float32 math, rounded to a's dtype (gates, e.g. MLA's output gate); ``out``
    as for :func:`add`."""
    af, bf = _f32(a), _f32(b)
    if writable(out, a.dtype, a, b):
        return _store(out, torch.mul, af, bf)
    return (af * bf).to(a.dtype)


def check_attention_args(q, k, v, scale, where: str, causal=True) -> None:
    """mla_attention's argument checks (shared with the Triton backend): float tensors q, k [B, T, H, Dqk] and
    v [B, T, H, Dv] on one device, a finite number as scale, a bool (or 0-d bool tensor) as causal. Raises
    TypeError / ValueError."""
    check_flag(causal, "causal", where)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{where}: {name} must be [B, T, H, D], got shape {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{where}: {name} is on {t.device} but q is on {q.device}")
    if q.shape != k.shape or q.shape[:3] != v.shape[:3]:
        raise ValueError(f"{where}: q {list(q.shape)} and k {list(k.shape)} must be equal and share [B, T, H] "
                         f"with v {list(v.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{where}: scale must be a real number (Python or numpy), got {type(scale).__name__} "
                        f"{scale!r}")
    if not abs(scale) < float("inf"):
        raise ValueError(f"{where}: scale must be finite, got {scale!r}")


def check_attention_finite(q, k, v, where: str) -> None:
    """ValueError naming the first of q, k, v that holds NaN or inf (a NaN query would give NaN rows here and
    zeros in torch's fused CPU kernel: neither is a result)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: {name} holds NaN or inf")


def mla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                  cu_seqlens: torch.Tensor | None = None, check_finite=None) -> torch.Tensor:
    """Softmax attention core of (gated) MLA: o = softmax(q k^T * scale + mask) v, softmax in float32.

    q, k [B, T, H, Dqk]; v [B, T, H, Dv] (Dqk may differ from Dv: 192 and 128 in K3). cu_seqlens int
    [N+1] for packed sequences (B == 1): attention never crosses a sequence boundary. check_finite: the Triton
    backend's option, accepted so that a call runs on either backend unchanged (the reference always checks).
    Returns o [B, T, H, Dv] in v's dtype. Vaswani et al. 2017, eq. 1; DeepSeek-V2 (MLA).
    Raises TypeError (non-float tensors, a non-numeric scale, a causal that is not a bool, bad cu_seqlens dtype)
    and ValueError (shapes that are not [B, T, H, D] or disagree, cu_seqlens with B != 1 or not offsets 0 ... T,
    NaN / inf in q, k or v). Logits past float32's range (huge q or k) are formed in float64 for their rows: the
    result is the softmax's, finite."""
    where = "mla_attention"
    check_attention_args(q, k, v, scale, where, causal)
    check_attention_finite(q, k, v, where)
    B, T, H, _ = q.shape
    qf, kf, vf = (_f32(t).transpose(1, 2) for t in (q, k, v))   # [B, H, T, D]
    seq = None
    if cu_seqlens is not None:
        from .kda import check_cu_seqlens
        seq = torch.zeros(T, dtype=torch.long, device=q.device)
        for i, (a, b) in enumerate(check_cu_seqlens(cu_seqlens, B, T, where)):
            seq[a:b] = i
    o = torch.empty(B, H, T, vf.shape[-1], dtype=torch.float32, device=q.device)
    # queries in blocks of at most MLA_SCORE_ELEMENTS scores (each row's softmax is its own: the same result as one
    # [B, H, T, T] block, in bounded memory)
    rows = mla_query_rows(B, H, T)
    cols = torch.arange(T, device=q.device)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        qb = qf[:, :, r0:r1]
        s = (qb @ kf.transpose(-1, -2)) * scale                      # [B, H, rows, T]
        allowed = torch.ones(r1 - r0, T, dtype=torch.bool, device=q.device)
        if causal:
            allowed = cols[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
        if seq is not None:
            allowed = allowed & (seq[r0:r1, None] == seq[None, :])
        s = s.masked_fill(~allowed, float("-inf"))
        # rows whose float32 logits overflowed (inf, or NaN from inf - inf: the inputs are finite, checked above)
        over = ~torch.isfinite(s.masked_fill(~allowed, 0.0)).all(dim=-1, keepdim=True)   # [B, H, rows, 1]
        if bool(over.any()):
            p = _overflow_rows_softmax(qb, kf, scale, allowed, over, s, where)
        else:
            p = torch.softmax(s, dim=-1)
        o[:, :, r0:r1] = p @ vf
    return o.transpose(1, 2).to(v.dtype).contiguous()


#: the most attention scores the reference mla_attention holds in one query block ([B, H, rows, T] float32)
MLA_SCORE_ELEMENTS = 1 << 22


def mla_query_rows(B: int, H: int, T: int) -> int:
    """Query rows per block of the reference mla_attention: as many as keep B H rows T scores within
    MLA_SCORE_ELEMENTS (at least one)."""
    return max(1, min(T, MLA_SCORE_ELEMENTS // max(1, B * H * T)))


def _overflow_rows_softmax(qf, kf, scale, allowed, over, s, where: str) -> torch.Tensor:
    """softmax(q k^T * scale) [B, H, T, T] where the rows ``over`` overflowed float32: those rows from float64
    logits (a product of two float32 values, summed over Dqk, cannot overflow float64; the softmax of huge
    logits is well defined: the largest ones take the weight), the others as the float32 path computes them.
    ValueError when even float64 overflows (a scale past ~1e230)."""
    s64 = ((qf.double() @ kf.double().transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
    if not bool(torch.isfinite(s64.masked_fill(~allowed, 0.0)).all()):
        raise ValueError(f"{where}: the logits q k^T * scale overflow float64 too (scale {scale!r})")
    p64 = torch.softmax(s64, dim=-1).float()
    # (the float32 rows that overflowed are replaced by zeros before their softmax: no NaN in the backward)
    return torch.where(over, p64, torch.softmax(s.masked_fill(over, 0.0), dim=-1))
