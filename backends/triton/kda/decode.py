"""One KDA layer's decode step (one token per row) as one Triton kernel, on the inference cache's states in place.

A KDA layer (Kimi Linear, arXiv 2510.26692, Sec. 3; dsl/ops/kda.py ``kda_layer``) runs, per token, between its
projections:

    q = l2norm(silu(short_conv(x_q)));  k = l2norm(silu(short_conv(x_k)));  v = silu(short_conv(x_v))
    g = kda_gate(f, A_log, dt_bias);  beta = sigmoid(b)
    S' = diag(exp(g)) S;  S' += beta k (v - S'^T k)^T;  o = scale S'^T q              (kda_step, spec/OPS.md)
    y = rmsnorm(o, w_o) * sigmoid(gl)                                                 (per head, over V)

where x_q, x_k, x_v, f, b, gl are the projections' outputs for this token and each short_conv reads the cached last
``W - 1`` inputs before the new one. ``kda_decode_step`` does all of it in one launch, one program per (row, head):
it reads the projections once, updates the three conv states and the recurrent state S of the cache rows in place
(each program reads its own block before it writes it; the conv state shift waits on a barrier between the reads
and the writes), and writes y. Math in float32 with no intermediate rounding (the per-op path rounds q, k, v, beta
and o to the model's dtype in between: identical in float32, within bf16 rounding otherwise).

This is an internal entry point of the inference session (backends/inference.py); the public op ``kda_step``
(spec/OPS.md) keeps its contract (the state is not modified).
"""
from __future__ import annotations

import numbers

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device

from ..guard import check_forward_only, check_kernel_device, next_power_of_2

__all__ = ["kda_decode_step", "decode_tiles"]


@triton.jit
def _conv_silu(x, cs, w, b, r, C, ch, cm, W: tl.constexpr, WP: tl.constexpr):
    """silu(sum_j w[c, j] xe[j, c]) over channels ``ch`` of batch row b, where xe = [the W - 1 cached inputs of cache
    row r, the new input]; then the cache row holds the last W - 1 of xe. Returns the float32 activations."""
    xv = tl.load(x + b.to(tl.int64) * C + ch, mask=cm, other=0.0)
    acc = xv.to(tl.float32) * tl.load(w + ch * W + (W - 1), mask=cm, other=0.0).to(tl.float32)
    if W > 1:
        jj = tl.arange(0, WP)
        jm = jj < W - 1
        m2 = jm[:, None] & cm[None, :]
        sp = cs + r * (W - 1) * C + jj[:, None] * C + ch[None, :]
        old = tl.load(sp, mask=m2, other=0.0)
        wt = tl.load(w + ch[None, :] * W + jj[:, None], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(old.to(tl.float32) * wt, axis=0)
        # the shift: row j takes row j + 1 (the last row the new input); every thread's reads come first
        nxt = tl.load(sp + C, mask=m2 & (jj < W - 2)[:, None], other=0.0)
        tl.debug_barrier()
        nxt = tl.where((jj == W - 2)[:, None], xv[None, :].to(nxt.dtype), nxt)
        tl.store(sp, nxt.to(cs.dtype.element_ty), mask=m2)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def _decode_kernel(xq, xk, xv, cq, ck, cv, wq, wk, wv, f, A_log, dt_bias, bx, S, rows, gl, wo, o,
                   H, scale, lb, eps_q, eps_k, eps_o,
                   K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
                   W: tl.constexpr, WP: tl.constexpr, SOFTPLUS: tl.constexpr, NORM: tl.constexpr):
    """Program (batch row b, head h): K channels of q, k, g in one block of KP (a power of two; channels >= K masked:
    zero q, k, no state); the V columns in NVB blocks of BV."""
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    r = tl.load(rows + b).to(tl.int64)
    dk = tl.arange(0, KP)
    km = dk < K
    chk = h * K + dk
    CK = H * K
    CV = H * V
    qv = _conv_silu(xq, cq, wq, b, r, CK, chk, km, W, WP)
    qv = qv * tl.rsqrt(tl.sum(qv * qv, axis=0) + eps_q)
    kv = _conv_silu(xk, ck, wk, b, r, CK, chk, km, W, WP)
    kv = kv * tl.rsqrt(tl.sum(kv * kv, axis=0) + eps_k)
    z = tl.load(f + b.to(tl.int64) * CK + chk, mask=km, other=0.0).to(tl.float32)
    z += tl.load(dt_bias + chk, mask=km, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    if SOFTPLUS:
        gv = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    else:
        az = a * z
        e = tl.exp(-tl.abs(az))                 # sigmoid without overflow
        gv = lb * tl.where(az >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    gv = tl.where(km, gv, 0.0)
    bz = tl.load(bx + b.to(tl.int64) * H + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-bz))
    decay = tl.exp(gv)
    sbase = (r * H + h) * K * V
    obase = b.to(tl.int64) * CV + h * V
    ssq = 0.0
    for vb in tl.static_range(NVB):
        cols = vb * BV + tl.arange(0, BV)
        cm = cols < V
        vv = _conv_silu(xv, cv, wv, b, r, CV, h * V + cols, cm, W, WP)
        m2 = km[:, None] & cm[None, :]
        soff = sbase + dk[:, None] * V + cols[None, :]
        St = tl.load(S + soff, mask=m2, other=0.0) * decay[:, None]
        u = vv - tl.sum(St * kv[:, None], axis=0)
        St = St + beta * kv[:, None] * u[None, :]
        tl.store(S + soff, St, mask=m2)
        ov = scale * tl.sum(St * qv[:, None], axis=0)
        if NORM:
            if NVB == 1:
                rstd = tl.rsqrt(tl.sum(tl.where(cm, ov * ov, 0.0), axis=0) / V + eps_o)
                gz = tl.load(gl + obase + cols, mask=cm, other=0.0).to(tl.float32)
                wv_ = tl.load(wo + cols, mask=cm, other=0.0).to(tl.float32)
                ov = ov * rstd * wv_ / (1.0 + tl.exp(-gz))
            else:
                ssq += tl.sum(tl.where(cm, ov * ov, 0.0), axis=0)
        tl.store(o + obase + cols, ov.to(o.dtype.element_ty), mask=cm)
    if NORM:
        if NVB > 1:
            # (the norm over V spans the blocks: the raw o of every block first, then normalised in place)
            tl.debug_barrier()
            rstd = tl.rsqrt(ssq / V + eps_o)
            for vb in tl.static_range(NVB):
                cols = vb * BV + tl.arange(0, BV)
                cm = cols < V
                ov = tl.load(o + obase + cols, mask=cm, other=0.0).to(tl.float32)
                gz = tl.load(gl + obase + cols, mask=cm, other=0.0).to(tl.float32)
                wv_ = tl.load(wo + cols, mask=cm, other=0.0).to(tl.float32)
                tl.store(o + obase + cols, (ov * rstd * wv_ / (1.0 + tl.exp(-gz))).to(o.dtype.element_ty), mask=cm)


#: the most float32 state elements one program holds at once (its [KP, BV] block)
STATE_TILE = 128 * 128


def decode_tiles(K: int, V: int) -> tuple[int, int, int]:
    """(KP, BV, num_warps) of kda_decode_step for head dims K, V: KP = K rounded up to a power of two, BV the
    largest power of two <= V's with KP * BV <= STATE_TILE (at least 16), 8 warps for a full tile."""
    KP = next_power_of_2(K)
    BV = max(16, min(next_power_of_2(V), STATE_TILE // KP))
    return KP, BV, 8 if KP * BV >= 8192 else 4


def _tensor(name, t, shape, where, dtype=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} must be {list(shape)}, got {list(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{where}: {name} must be {dtype}, got {t.dtype}")
    if not t.is_floating_point() and dtype is None:
        raise TypeError(f"{where}: {name} must be a float tensor, got {t.dtype}")


@on_tensor_device
def kda_decode_step(xq, xk, xv, conv_q, conv_k, conv_v, w_q, w_k, w_v, f, A_log, dt_bias, b, state, rows, *,
                    scale: float, gate: str = "sigmoid", lower_bound: float | None = -5.0, eps_q: float = 1e-6,
                    eps_k: float = 1e-6, norm=None):
    """One decode step of a KDA layer for B rows of the cache, in one launch (see the module docstring).

    Args:
        xq, xk: [B, H*K] the q / k projections of the new token; xv: [B, H*V]; f: [B, H*K] the gate projection
            (kda_gate's x); b: [B, H] beta's pre-activation. Any float dtype (one dtype for xq, xk, xv).
        conv_q, conv_k: [N, W-1, H*K], conv_v: [N, W-1, H*V] the conv states (the last W-1 inputs), contiguous, in
            xq's dtype; updated in place at rows ``rows``.
        w_q, w_k: [H*K, W] (or [H*K, 1, W]) conv taps; w_v: [H*V, W].
        A_log: [H]; dt_bias: [H*K]: kda_gate's parameters; gate "sigmoid" (with ``lower_bound`` < 0) or "softplus".
        state: [N, H, K, V] float32, contiguous: the recurrent states, updated in place at rows ``rows``.
        rows: int64 [B], distinct indices in [0, N): batch row i is cache row rows[i].
        scale: kda_step's scale; eps_q, eps_k: the l2norm epsilons of q and k.
        norm: None (y = o), or (w_o [V], gl [B, H*V], eps): y = rmsnorm(o, w_o, eps) * sigmoid(gl) per head.
    Returns:
        y [B, H*V] in xv's dtype.
    Raises:
        TypeError / ValueError: a non-tensor, a shape, dtype or layout that does not match the above, an unknown
        gate, rows that are not distinct indices of the cache (checked for CPU rows; on the GPU the caller
        guarantees them). RuntimeError when autograd records a gradient for an input (forward only).
    """
    where = "triton.kda_decode_step"
    if not isinstance(state, torch.Tensor) or state.dim() != 4:
        raise ValueError(f"{where}: state must be [N, H, K, V], got "
                         + (str(list(state.shape)) if isinstance(state, torch.Tensor) else type(state).__name__))
    N, H, K, V = state.shape
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1 or rows.numel() > N:
        raise ValueError(f"{where}: rows must be an int64 [B] tensor, B <= {N}")
    B = rows.numel()
    if not isinstance(conv_q, torch.Tensor) or conv_q.dim() != 3:
        raise ValueError(f"{where}: conv_q must be [N, W-1, H*K]")
    W = conv_q.shape[1] + 1
    _tensor("state", state, (N, H, K, V), where, torch.float32)
    for name, t, C in (("xq", xq, H * K), ("xk", xk, H * K), ("xv", xv, H * V), ("f", f, H * K)):
        _tensor(name, t, (B, C), where)
    _tensor("b", b, (B, H), where)
    for name, t, C in (("conv_q", conv_q, H * K), ("conv_k", conv_k, H * K), ("conv_v", conv_v, H * V)):
        _tensor(name, t, (N, W - 1, C), where, xq.dtype)
        if not t.is_contiguous():
            raise ValueError(f"{where}: {name} must be contiguous (updated in place)")
    w = []
    for name, t, C in (("w_q", w_q, H * K), ("w_k", w_k, H * K), ("w_v", w_v, H * V)):
        if not isinstance(t, torch.Tensor) or t.numel() != C * W:
            raise ValueError(f"{where}: {name} must be [{C}, {W}] (or [{C}, 1, {W}])")
        w.append(t.reshape(C, W).float().contiguous())
    _tensor("A_log", A_log, (H,), where)
    _tensor("dt_bias", dt_bias.reshape(-1) if isinstance(dt_bias, torch.Tensor) else dt_bias, (H * K,), where)
    if xk.dtype != xq.dtype or xv.dtype != xq.dtype:
        raise ValueError(f"{where}: xq, xk, xv must share one dtype, got {xq.dtype}, {xk.dtype}, {xv.dtype}")
    if not state.is_contiguous():
        raise ValueError(f"{where}: state must be contiguous (updated in place)")
    if gate not in ("sigmoid", "softplus"):
        raise ValueError(f"{where}: gate must be 'sigmoid' or 'softplus', got {gate!r}")
    if gate == "sigmoid" and (not isinstance(lower_bound, numbers.Real) or not lower_bound < 0):
        raise ValueError(f"{where}: the sigmoid gate needs lower_bound < 0, got {lower_bound!r}")
    if norm is not None:
        w_o, gl, eps_o = norm
        _tensor("w_o", w_o, (V,), where)
        _tensor("gl", gl, (B, H * V), where)
    else:
        w_o, gl, eps_o = state, state, 1.0                   # (not read)
    if not rows.is_cuda:
        rl = rows.tolist()
        if len(set(rl)) != len(rl) or any(not 0 <= i < N for i in rl):
            raise ValueError(f"{where}: rows must be distinct indices in [0, {N}), got {rl}")
    check_forward_only(where, xq, xk, xv, f, b, state, *w)
    check_kernel_device(where, xq=xq, xk=xk, xv=xv, f=f, b=b, state=state, rows=rows, conv_q=conv_q,
                        conv_k=conv_k, conv_v=conv_v, A_log=A_log, dt_bias=dt_bias)
    y = torch.empty(B, H * V, dtype=xv.dtype, device=xv.device)
    if B * H == 0:
        return y
    KP, BV, warps = decode_tiles(K, V)
    c = [t.contiguous() for t in (xq, xk, xv, f, b, gl, w_o)]
    _decode_kernel[(B * H,)](c[0], c[1], c[2], conv_q, conv_k, conv_v, w[0], w[1], w[2], c[3],
                             A_log.contiguous(), dt_bias.reshape(-1).contiguous(), c[4], state, rows, c[5], c[6], y,
                             H, float(scale), float(lower_bound if gate == "sigmoid" else 0.0), float(eps_q),
                             float(eps_k), float(eps_o), K=K, V=V, KP=KP, BV=BV, NVB=triton.cdiv(V, BV), W=W,
                             WP=next_power_of_2(max(1, W - 1)), SOFTPLUS=gate == "softplus", NORM=norm is not None,
                             num_warps=warps)
    return y
