"""kda_step: one KDA decoding step (the token recurrence on the state) as a Triton kernel (forward only).

``kda_step`` is the public op (spec/OPS.md: the state is not modified, a new one is returned); ``kda_step_rows``
is the internal in-place form the inference session uses: it updates rows ``rows`` of the cache's state tensor
where they lie (no gathered copy, no new state, no scatter back)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from backends.reference import kda as _ref

from ..guard import cdiv, check_forward_only, check_kernel_device, next_power_of_2, scan_values


@triton.jit
def _step_kernel(q, k, v, g, beta, S_in, S_out, o, rows, H, scale, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr):
    """One (batch x head, V block): KP = K rounded up to a power of two (channels >= K masked, read as
    zero: no state, no decay), BV a power of two (value columns >= V masked). ROWS: the state of batch row b is
    row rows[b] of S_in / S_out (of any number of rows), else row b. Each program reads its [K, BV] block of
    the state before it writes it, so S_in and S_out may be one tensor (the update in place)."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    dk = tl.arange(0, KP)
    km = dk < K
    cols = vb * BV + tl.arange(0, BV)
    cm = cols < V
    m2 = km[:, None] & cm[None, :]
    base = bh.to(tl.int64)
    if ROWS:
        sbase = tl.load(rows + bh // H).to(tl.int64) * H + bh % H
    else:
        sbase = base
    soff = (sbase * K + dk[:, None]) * V + cols[None, :]
    S = tl.load(S_in + soff, mask=m2, other=0.0).to(tl.float32)
    qv = tl.load(q + base * K + dk, mask=km, other=0.0).to(tl.float32)
    kv = tl.load(k + base * K + dk, mask=km, other=0.0).to(tl.float32)
    gv = tl.load(g + base * K + dk, mask=km, other=0.0).to(tl.float32)
    vv = tl.load(v + base * V + cols, mask=cm, other=0.0).to(tl.float32)
    b = tl.load(beta + bh).to(tl.float32)
    S = S * tl.exp(gv)[:, None]
    u = vv - tl.sum(S * kv[:, None], axis=0)
    S = S + b * kv[:, None] * u[None, :]
    ov = scale * tl.sum(S * qv[:, None], axis=0)
    tl.store(S_out + soff, S, mask=m2)
    tl.store(o + base * V + cols, ov.to(o.dtype.element_ty), mask=cm)


@on_tensor_device
def kda_step(q, k, v, g, beta, state, *, scale=None, check_finite=None):
    """One KDA decoding step as a Triton kernel; same contract as backends.reference.kda.kda_step.

    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] (any float dtype, used as float32; not
    modified); any K, V >= 1.  Returns (o [B, H, V] in v's dtype, new_state float32).  Raises TypeError /
    ValueError like the reference (same checks; the NaN/inf and g <= 0 scan on CPU tensors, or always with
    check_finite=True: it costs a host sync on the GPU, and then a result that overflowed from finite inputs is
    the reference's ValueError too), ValueError for CPU tensors without TRITON_INTERPRET=1,
    and RuntimeError when autograd records a gradient for an input: forward only (decoding); use the reference
    kda_step for gradients.
    """
    where = "triton.kda_step"
    B, H, K, V = _ref.check_step_args(q, k, v, g, beta, state, where)
    _ref.check_scale(scale, where)
    check_forward_only(where, q, k, v, g, beta, state)
    check_kernel_device(where, q=q)
    scan = scan_values(check_finite, q)
    if scan:
        _ref.check_step_finite(q, k, v, g, beta, state, where)
    scale = K ** -0.5 if scale is None else float(scale)
    S_in = state.float().contiguous()
    S_out = torch.empty_like(S_in)
    o = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    BV = min(64, next_power_of_2(V))
    if B * H:
        _step_kernel[(B * H, cdiv(V, BV))](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                           beta.contiguous(), S_in, S_out, o, S_in, H, scale, K=K, V=V, BV=BV,
                                           KP=next_power_of_2(K), ROWS=False)
    if scan:
        _ref.check_result_finite(o, S_out, k, beta, where)     # (as the reference and kda_chunk)
    return o, S_out


@on_tensor_device
def kda_step_rows(q, k, v, g, beta, state, rows, *, scale=None, check_finite=None):
    """kda_step on rows ``rows`` of a state tensor, updated in place (the inference cache's decode step).

    q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [N, H, K, V] float32, contiguous (the cache's tensor, N >=
    B rows); rows int64 [B], distinct indices into state's first dimension: batch row b reads and writes
    state[rows[b]]. Math and checks as kda_step (the finite scan of the inputs and of the rows read, and of the
    result, under the same condition); the other rows of state are not touched.

    Returns o [B, H, V] in v's dtype; ``state[rows]`` holds the new states. Raises what kda_step raises, and
    ValueError for a state that is not float32 contiguous [N, H, K, V] or rows that are not B distinct int64
    indices in [0, N) (checked on CPU rows; on the GPU the caller guarantees them: a host read per step).
    """
    where = "triton.kda_step_rows"
    if not isinstance(state, torch.Tensor) or state.dtype != torch.float32 or state.dim() != 4 \
            or not state.is_contiguous():
        raise ValueError(f"{where}: state must be a contiguous float32 [N, H, K, V] tensor (the cache's), got "
                         + (f"{state.dtype} {list(state.shape)}" if isinstance(state, torch.Tensor)
                            else type(state).__name__))
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.int64 or rows.dim() != 1 \
            or rows.device != state.device:
        raise ValueError(f"{where}: rows must be an int64 [B] tensor on {state.device}, got "
                         + (f"{rows.dtype} {list(rows.shape)} on {rows.device}" if isinstance(rows, torch.Tensor)
                            else type(rows).__name__))
    N = state.shape[0]
    if rows.numel() > N:
        raise ValueError(f"{where}: {rows.numel()} rows of a state with {N}")
    B = rows.numel()
    _ref.check_step_args(q, k, v, g, beta, state[:B], where)      # (q, k, v, g, beta against [B, H, K, V])
    if not rows.is_cuda:
        r = rows.tolist()
        if len(set(r)) != len(r) or any(not 0 <= i < N for i in r):
            raise ValueError(f"{where}: rows must be distinct indices in [0, {N}), got {r}")
    _ref.check_scale(scale, where)
    check_forward_only(where, q, k, v, g, beta, state)
    check_kernel_device(where, q=q)
    H, K, V = state.shape[1:]
    scan = scan_values(check_finite, q)
    if scan:
        _ref.check_step_finite(q, k, v, g, beta, state[rows], where)
    scale = K ** -0.5 if scale is None else float(scale)
    o = torch.empty(B, H, V, dtype=v.dtype, device=v.device)
    BV = min(64, next_power_of_2(V))
    if B * H:
        _step_kernel[(B * H, cdiv(V, BV))](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                           beta.contiguous(), state, state, o, rows, H, scale, K=K, V=V, BV=BV,
                                           KP=next_power_of_2(K), ROWS=True)
    if scan:
        _ref.check_result_finite(o, state[rows], k, beta, where)
    return o
