"""Phase 2 of the two-phase Block AttnRes: the online-softmax merge of one query's bank result with the in-block
partial source (plus the fused output RMSNorm).

* ``_merge_rows_kernel``: one program per tile of whole rows (tiles under ``pipelined_tile`` elements, and the
  interpreter);
* ``_merge_persistent_kernel``: wider tiles on the GPU, a persistent grid with the rows' loads software-pipelined.

The backward recomputes through the float32 reference (correct, not fast).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from ..guard import cdiv, no_create_graph
from .common import INTERPRET, SUPPORTED, check_device, flat, num_sms, ref, row_tile
from .config import current


@triton.jit
def _merge_rows(a, x, mb, sb, qw, eps, D: tl.constexpr, HAS_PART: tl.constexpr):
    # the phase-2 merge of rows along the last axis (a: the bank's acc, x: the partial, qw: q*w, both broadcast to
    # a row; mb, sb: each row's softmax max and sum from phase 1, shaped to broadcast against a row statistic
    # ([BT, 1], or scalars for one row)): the online-softmax merge of the bank with the partial, or acc / s
    if HAS_PART:
        lp = tl.sum(x * qw, axis=-1, keep_dims=True) * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
        big = tl.maximum(mb, lp)
        ea = tl.exp(mb - big)
        eb = tl.exp(lp - big)
        o = (a * ea + x * eb) * (1.0 / (sb * ea + eb))
    else:
        o = a * (1.0 / sb)
    return o


@triton.jit
def _merge_rows_kernel(
    acc, m_in, s_in, part, q, w, ow, out,
    N, eps,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_PART: tl.constexpr, HAS_ONORM: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BT + tl.arange(0, BT).to(tl.int64)
    cols = tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * D + cols[None, :]
    a = tl.load(acc + tile, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    mb = tl.load(m_in + rows, mask=rmask, other=0.0).to(tl.float32)
    sb = tl.load(s_in + rows, mask=rmask, other=1.0).to(tl.float32)
    x = a                                       # (placeholders where there is no partial: unused then)
    if HAS_PART:
        x = tl.load(part + tile, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    o = _merge_rows(a, x, mb[:, None], sb[:, None], qw[None, :] if HAS_PART else a, eps, D, HAS_PART)
    if HAS_ONORM:
        ro = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
        o = o * ro[:, None] * tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out + tile, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _merge_persistent_kernel(
    acc, m_in, s_in, part, q, w, ow, out,
    N, eps, TPP, TSTEP,
    D: tl.constexpr, BD: tl.constexpr, HAS_PART: tl.constexpr, HAS_ONORM: tl.constexpr, NS: tl.constexpr,
):
    # _merge_rows_kernel's math on a persistent grid: program p merges the rows p, p + TSTEP, ... (TSTEP: the grid;
    # with one program, TSTEP = 1 and t0 = 0 either way), one row per step of a software-pipelined loop (cp.async
    # into shared memory, NS - 1 rows of acc and partial in flight), as the pipelined forward's schedule. q*w is
    # held in registers; the output-norm weight is loaded under a runtime branch, which keeps it out of the
    # pipeline's shared memory (re-read from L1 each row)
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cmask = cols < D
    if HAS_PART:
        qw = tl.load(q + cols, mask=cmask, other=0.0).to(tl.float32) * \
            tl.load(w + cols, mask=cmask, other=0.0).to(tl.float32)
    t0 = tl.where(TSTEP == 1, pid * TPP, pid)
    for k in tl.range(0, TPP, num_stages=NS):
        row = t0 + k * TSTEP
        ok = row < N
        mask = (cmask & ok) != 0                # `!= 0`: a bool mask under the triton 3.9 interpreter (forward.py)
        a = tl.load(acc + row * D + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        mb = tl.load(m_in + row, mask=ok, other=0.0).to(tl.float32)
        sb = tl.load(s_in + row, mask=ok, other=1.0).to(tl.float32)
        x = a                                   # (placeholders where there is no partial: unused then)
        if HAS_PART:
            x = tl.load(part + row * D + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        o = _merge_rows(a, x, mb, sb, qw if HAS_PART else a, eps, D, HAS_PART)
        if HAS_ONORM:
            ro = tl.rsqrt(tl.sum(o * o) / D + eps)
            if ok:
                o = o * ro * tl.load(ow + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out + row * D + cols, o.to(out.dtype.element_ty), mask=mask)


class _MergeFn(torch.autograd.Function):
    """Triton forward; backward by recomputation through the float32 reference (correct, not fast)."""

    @staticmethod
    def forward(ctx, acc, m, s, partial, query, w, ow, eps, out_dtype):
        ctx.save_for_backward(acc, m, s, partial, query, w, ow)
        ctx.eps = eps
        n, d = acc.shape
        out = torch.empty((n, d), dtype=out_dtype, device=acc.device)
        if n > 0:
            bt, bd, nw = row_tile(d, n)
            cfg = current()
            persistent = cfg.merge_persistent
            if persistent is None:
                persistent = bd * bt >= cfg.pipelined_tile and not INTERPRET
            args = (acc, m, s, partial if partial is not None else acc, query, w, ow if ow is not None else query,
                    out, n, float(eps))
            if persistent:
                pps = cfg.merge_progs_per_sm
                ns = cfg.merge_ns
                # the pipeline holds ns - 1 rows of acc and partial per program: with float32 ones two programs
                # would not fit an SM's shared memory at 3 stages (a second wave of programs), so fewer stages
                row_bytes = bd * (acc.element_size() + (partial.element_size() if partial is not None else 0))
                while ns > 2 and pps * (ns - 1) * row_bytes > 200 * 1024:
                    ns -= 1
                tpp = max(1, cdiv(n, pps * num_sms(acc.device)))
                grid = cdiv(n, tpp)
                _merge_persistent_kernel[(grid,)](*args, tpp, grid, D=d, BD=bd, HAS_PART=partial is not None,
                                                  HAS_ONORM=ow is not None, NS=ns, num_warps=cfg.merge_num_warps)
            else:
                _merge_rows_kernel[(cdiv(n, bt),)](*args, D=d, BT=bt, BD=bd, HAS_PART=partial is not None,
                                                   HAS_ONORM=ow is not None, num_warps=nw)
        return out

    @staticmethod
    def backward(ctx, dout):
        no_create_graph("backends.triton.attn_residual_merge")
        saved = ctx.saved_tensors
        with torch.enable_grad():
            ins = [None if t is None else t.detach().requires_grad_(t.dtype.is_floating_point) for t in saved]
            acc, m, s, partial, query, w, ow = ins
            out = ref.attn_residual_merge(acc, m, s, partial, query, w, eps=ctx.eps, output_rms_weight=ow,
                                           out_dtype=torch.float32)
            used = [t for t in ins if t is not None]
            g = torch.autograd.grad(out, used, dout.float(), allow_unused=True)
        it = iter(g)
        grads = []
        for t in ins:
            if t is None:
                grads.append(None)
            else:
                gi = next(it)
                grads.append(None if gi is None else gi.to(t.dtype))
        return (*grads, None, None)


@on_tensor_device
def attn_residual_merge(acc: torch.Tensor, m: torch.Tensor, s: torch.Tensor, partial: Optional[torch.Tensor],
                        query: torch.Tensor, rms_weight: torch.Tensor, *, eps: float = 1e-6,
                        output_rms_weight: Optional[torch.Tensor] = None,
                        out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Phase 2 of the two-phase Block AttnRes: merge one query's bank result with the in-block partial.

    Math: online-softmax merge (flash-attention), spec/OPS.md "Two-phase form":
    ``l_p = <query, RMSNorm(partial; rms_weight, eps)>``, ``M = max(m, l_p)``,
    ``out = (exp(m-M) acc + exp(l_p-M) partial) / (exp(m-M) s + exp(l_p-M))`` (``acc / s`` without a
    partial), then the optional output RMSNorm; one read of acc and partial, one write, float32 math.
    Equals ``attn_residual(query, bank + [partial], rms_weight, ...)``.

    Args:
        acc: [..., d] one query's phase-1 result ``acc[q]`` (float32, or the reduced acc_dtype).
        m, s: [...] float32, ``m[q]``, ``s[q]`` from phase 1.
        partial: [..., d] the in-block partial source, or None.
        query, rms_weight: [d], row q of phase 1's queries / rms_weights.
        eps: RMSNorm epsilon, > 0. output_rms_weight: optional [d] fused output-norm weight.
        out_dtype: result dtype; default partial's dtype, or acc's dtype without a partial.

    Returns:
        out: [..., d] in ``out_dtype``. Differentiable (backward through the float32 reference).

    Raises:
        ValueError / TypeError: mismatched shapes, non-float tensors, bad eps, unsupported dtypes, CPU
            tensors without the interpreter, a CPU result that overflows. CPU inputs past 2^40 give the
            reference's result (as attn_residual).
    """
    tok, d = ref.check_merge_args(acc, m, s, partial, query, rms_weight, eps, output_rms_weight)
    check_device(acc, "attn_residual_merge")
    if partial is not None:
        check_device(partial, "attn_residual_merge")
    if out_dtype is None:
        out_dtype = partial.dtype if partial is not None else acc.dtype
    if out_dtype not in SUPPORTED:
        raise TypeError(f"attn_residual_merge: out_dtype {out_dtype} is not float32/float16/bfloat16")
    if ref.needs_safe_path(query, [acc] + ([partial] if partial is not None else []), rms_weight):
        # values past 2^40 (CPU inputs): the reference's exactly scaled rows, as attn_residual
        return ref.attn_residual_merge(acc, m, s, partial, query, rms_weight, eps=eps,
                                        output_rms_weight=output_rms_weight, out_dtype=out_dtype)
    out = _MergeFn.apply(flat(acc, d), m.reshape(-1).float().contiguous(), s.reshape(-1).float().contiguous(),
                         flat(partial, d) if partial is not None else None,
                         query.contiguous(), rms_weight.contiguous(),
                         output_rms_weight.contiguous() if output_rms_weight is not None else None,
                         float(eps), out_dtype)
    out = out.view(*tok, d)
    ref.check_two_phase_result("attn_residual_merge", out=out)
    return out
