"""Phase 1 of the two-phase Block AttnRes: all Q queries of a block against the completed bank.

* ``_phase1_logits_kernel``: the logits of all Q queries against every bank source from one read of the bank,
  a tensor-core product [tokens, d] x [d, Q], float32-accurate: 3xTF32 on the float32 tile, or for bf16 banks
  on the GPU bf16 MMAs of the tile as loaded against queries * rms_weights split into three bf16 parts (``SPLIT``),
  each step's sum promoted to an IEEE float32 accumulator.
* ``_phase1_stats_kernel``: the softmax max m and sum s per (token, query), with exp(logit - m) written over the
  logits.
* the weighted sums acc_q = sum_i exp(logit_qi - m_q) x_i: ``_phase1_mix_bank_kernel`` per (token, d-chunk) for
  every query, the bank's chunks held in registers (banks of up to ``mix_bank_max_sources`` sources and
  ``mix_bank_max_queries`` queries: AttnResConfig), else ``_phase1_mix_groups_kernel`` per (token, d-chunk,
  query group), a single pipelined loop of independent loads.
* a bank of one source needs no mix: acc_q = x_0 exactly (s = 1), returned as a view.

The backward recomputes through the float32 reference (correct, not fast).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from ..guard import cdiv, next_power_of_2, no_create_graph
from .common import INTERPRET, check_device, flat, offset_table, ref
from .config import current


@triton.jit
def _phase1_logits_kernel(
    base, offs,                   # bank (base + int64 element offsets [L])
    qwT,                          # [D, QP] f32: (queries * rms_weights)^T, zero-padded to QP columns
    logit_buf,                    # [L, N, QP] f32 out
    N,
    D: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, QP: tl.constexpr, VEC: tl.constexpr, eps,
    NS: tl.constexpr, SPLIT: tl.constexpr = False,
):
    # program (token tile, bank source i): logits of all queries for BT tokens of source i, one read.
    # SPLIT (bf16 banks): qwT is bf16 [D, 3 QP], queries * rms_weights split into three bf16 parts (hi, mid,
    # lo: 24 significant bits, float32's) in column blocks [0, QP), [QP, 2 QP), [2 QP, 3 QP); the bf16 tile
    # as loaded times each part is exact, and each step's three MMAs go into a fresh accumulator that is
    # added to the running sum in IEEE float32 (the tensor cores' own accumulation over the 7168-long
    # reduction loses ~3e-5 relative: measured on the H200 with the sum carried through the MMAs)
    pid = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    rows = pid * BT + tl.arange(0, BT).to(tl.int64)
    rmask = rows < N
    kk = tl.arange(0, BK)
    qq = tl.arange(0, QP)
    off = tl.multiple_of(tl.load(offs + i), VEC)
    ptr = base + off + rows[:, None] * D
    dots = tl.zeros([BT, QP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    QW: tl.constexpr = 3 * QP if SPLIT else QP
    for k0 in tl.range(0, D, BK, num_stages=NS):
        cols = k0 + kk
        cm = cols < D
        x = tl.load(ptr + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        if SPLIT:
            bp = qwT + cols[:, None] * QW + qq[None, :]
            part = tl.dot(x, tl.load(bp + 2 * QP, mask=cm[:, None], other=0.0))
            part = tl.dot(x, tl.load(bp + QP, mask=cm[:, None], other=0.0), part)
            part = tl.dot(x, tl.load(bp, mask=cm[:, None], other=0.0), part)
            dots += part
        else:
            b = tl.load(qwT + cols[:, None] * QW + qq[None, :], mask=cm[:, None], other=0.0)
            dots = tl.dot(xf, b, dots, input_precision="tf32x3")
    lg = dots * tl.rsqrt(ss / D + eps)[:, None]                     # [BT, QP]
    dst = logit_buf + (i.to(tl.int64) * N + rows[:, None]) * QP + qq[None, :]
    tl.store(dst, lg, mask=rmask[:, None])


@triton.jit
def _phase1_stats_kernel(
    logit_buf,                    # [L, N, QP] f32: logits in, softmax numerators exp(logit - m) out (in place)
    m_out, s_out,                 # [Q, N] f32 out (softmax max and sum per query and token)
    N, NQP, L, Q,
    QP: tl.constexpr, BN: tl.constexpr, NS: tl.constexpr,
):
    # the softmax statistics over the bank, once per (token, query), so that the mix kernel needs no
    # max loop and no exp: [BN tokens, QP queries] per program, two passes over the L logit planes
    pid = tl.program_id(0).to(tl.int64)
    nn = pid * BN + tl.arange(0, BN).to(tl.int64)
    qq = tl.arange(0, QP)
    mask = (nn < N)[:, None] & (qq < Q)[None, :]
    ptr = logit_buf + nn[:, None] * QP + qq[None, :]
    mq = tl.full([BN, QP], float("-inf"), tl.float32)
    p = ptr
    for i in tl.range(0, L, num_stages=NS):
        mq = tl.maximum(mq, tl.load(p, mask=mask, other=0.0))
        p += NQP                                                    # 64-bit pointer arithmetic
    sq = tl.zeros([BN, QP], tl.float32)
    p = ptr
    for i in tl.range(0, L, num_stages=NS):
        e = tl.exp(tl.load(p, mask=mask, other=0.0) - mq)
        tl.store(p, e, mask=mask)
        sq += e
        p += NQP
    dst = qq[None, :].to(tl.int64) * N + nn[:, None]
    tl.store(m_out + dst, mq, mask=mask)
    tl.store(s_out + dst, sq, mask=mask)


@triton.jit
def _phase1_mix_groups_kernel(
    base, offs, wts,              # bank, softmax numerators [L, N, QP] f32 (from _phase1_stats_kernel)
    acc,                          # [Q, N, D] out (float32 or a lower precision)
    N, NQP, L, Q,
    D: tl.constexpr, BC: tl.constexpr, QP: tl.constexpr, QB: tl.constexpr, NG: tl.constexpr,
    VEC: tl.constexpr, NS: tl.constexpr,
):
    # acc_q = sum_i wts[i, n, q] x_i over one (token, d-chunk, query group) tile: a single pipelined loop
    # of independent loads (no max loop, no exp), query group fastest in the flat grid
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (D + BC - 1) // BC
    g = pid % NG
    c = (pid // NG) % NC
    n = pid // (NG * NC)
    cols = c * BC + tl.arange(0, BC)
    cm = cols < D
    qq = g * QB + tl.arange(0, QB)
    qm = qq < Q
    a = tl.zeros([QB, BC], tl.float32)
    row = n * D + cols
    wp = wts + n * QP + qq
    for i in tl.range(0, L, num_stages=NS):
        off = tl.multiple_of(tl.load(offs + i), VEC)
        x = tl.load(base + off + row, mask=cm, other=0.0).to(tl.float32)
        e = tl.load(wp, mask=qm, other=0.0)
        wp += NQP
        a += e[:, None] * x[None, :]
    dst = acc + (qq[:, None].to(tl.int64) * N + n) * D + cols[None, :]
    tl.store(dst, a.to(acc.dtype.element_ty), mask=qm[:, None] & cm[None, :])


@triton.jit
def _phase1_mix_bank_kernel(
    base, offs, wts,              # bank, softmax numerators [L, N, QP] f32 (from _phase1_stats_kernel)
    acc,                          # [Q, N, D] out (float32 or a lower precision)
    N, NQP, L,
    D: tl.constexpr, BC: tl.constexpr, QP: tl.constexpr, LB: tl.constexpr, Q: tl.constexpr,
    VEC: tl.constexpr,
):
    # acc_q = sum_i wts[i, n, q] x_i for one (token, d-chunk) and EVERY query: the chunks of all L <= LB bank
    # sources are loaded at once ([LB, BC], all in flight together; no shared-memory pipeline), held in
    # registers, and each query's row is a thread-local sum over the LB axis, stored as it is formed
    pid = tl.program_id(0).to(tl.int64)
    NC: tl.constexpr = (D + BC - 1) // BC
    c = pid % NC
    n = pid // NC
    cols = c * BC + tl.arange(0, BC)
    cm = cols < D
    ll = tl.arange(0, LB)
    lm = ll < L
    off = tl.multiple_of(tl.load(offs + ll, mask=lm, other=0), VEC)
    x = tl.load(base + off[:, None] + (n * D + cols)[None, :], mask=lm[:, None] & cm[None, :],
                other=0.0).to(tl.float32)                                        # [LB, BC]
    wp = wts + ll.to(tl.int64) * NQP + n * QP
    for q in tl.static_range(Q):
        e = tl.load(wp + q, mask=lm, other=0.0)                                  # [LB]
        a = tl.sum(e[:, None] * x, axis=0)                                       # [BC]
        tl.store(acc + (q * N + n) * D + cols, a.to(acc.dtype.element_ty), mask=cm)


def phase1_launch(queries, xs, rms_weights, eps, acc_dtype, logits_only=False):
    """(acc [Q, N, d] acc_dtype, m [Q, N], s [Q, N] float32) of the bank xs [N, d]. logits_only: stop after the
    logits kernel (benchmarks/attn_residual.py times it alone); acc, m, s are then unset."""
    L = len(xs)
    n, d = xs[0].shape
    Q = queries.shape[0]
    dev = xs[0].device
    base, offs, vec = offset_table(xs, "attn_residual_phase1")
    QP = max(16, next_power_of_2(Q))
    cfg = current()
    if INTERPRET:
        # small tiles, so that the interpreter runs several of them
        bt, bk, p1_ns, p1_nw = 16, min(64, next_power_of_2(d)), 1, 4
        bc, qb, mix_ns, mix_nw = min(64, next_power_of_2(d)), min(8, next_power_of_2(Q)), 1, 4
        bank_bc, bank_nw = min(64, next_power_of_2(d)), 4
    else:
        bt, bk, p1_ns, p1_nw = cfg.p1_bt, min(cfg.p1_bk, next_power_of_2(d)), cfg.p1_ns, cfg.p1_nw
        bc, qb = min(cfg.mix_groups_bc, next_power_of_2(d)), min(cfg.mix_groups_qb, next_power_of_2(Q))
        mix_ns, mix_nw = cfg.mix_groups_ns, cfg.mix_groups_nw
        bank_bc, bank_nw = min(cfg.mix_bank_bc, next_power_of_2(d)), cfg.mix_bank_nw
    qw = (queries.float() * rms_weights.float()).t()                 # [d, Q]
    # bf16 banks: the three-part bf16 split (not under the interpreter: its bf16 dot is unreliable; the GPU tests
    # cover this path)
    split = xs[0].dtype == torch.bfloat16 and not INTERPRET
    if split:
        qwT = torch.zeros((d, 3 * QP), dtype=torch.bfloat16, device=dev)
        rest = qw
        for j in range(3):                                           # hi, mid, lo: 8 significant bits each
            qwT[:, j * QP:j * QP + Q] = rest
            rest = rest - qwT[:, j * QP:j * QP + Q].float()
    else:
        qwT = torch.zeros((d, QP), dtype=torch.float32, device=dev)
        qwT[:, :Q] = qw
    logit = torch.empty((L, n, QP), dtype=torch.float32, device=dev)
    m = torch.empty((Q, n), dtype=torch.float32, device=dev)
    s = torch.empty((Q, n), dtype=torch.float32, device=dev)
    one = L == 1 and not logits_only
    if one:
        # one source: logit = m, exp(logit - m) = 1, so s = 1 and acc_q = x_0 for every query, exactly. acc
        # is x_0 broadcast over the queries (a view; a converted copy when acc_dtype is not x_0's dtype)
        x0 = xs[0] if xs[0].dtype == acc_dtype else xs[0].to(acc_dtype)
        acc = x0.unsqueeze(0).expand(Q, n, d)
        s.fill_(1.0)
    else:
        acc = torch.empty((Q, n, d), dtype=acc_dtype, device=dev)
    if n == 0:
        return acc, m, s
    _phase1_logits_kernel[(cdiv(n, bt), L)](
        base, offs, qwT, logit, n, D=d, BT=bt, BK=bk, QP=QP, VEC=vec, eps=float(eps),
        NS=p1_ns, SPLIT=split, num_warps=p1_nw)
    if one:
        m.copy_(logit[0, :, :Q].t())
        return acc, m, s
    if logits_only:
        return acc, m, s
    bn = 16 if INTERPRET else 64
    _phase1_stats_kernel[(cdiv(n, bn),)](logit, m, s, n, n * QP, L, Q, QP=QP, BN=bn,
                                         NS=1 if INTERPRET else 2, num_warps=4)
    if next_power_of_2(L) <= cfg.mix_bank_max_sources and Q <= cfg.mix_bank_max_queries:
        _phase1_mix_bank_kernel[(n * cdiv(d, bank_bc),)](
            base, offs, logit, acc, n, n * QP, L, D=d, BC=bank_bc, QP=QP, LB=next_power_of_2(L), Q=Q, VEC=vec,
            num_warps=max(1, min(bank_nw, bank_bc // 256)))          # >= 8 columns per thread
    else:
        # the bank's chunks would not fit in registers, or too many unrolled queries
        ng = cdiv(Q, qb)
        _phase1_mix_groups_kernel[(n * cdiv(d, bc) * ng,)](
            base, offs, logit, acc, n, n * QP, L, Q, D=d, BC=bc, QP=QP, QB=qb, NG=ng, VEC=vec,
            NS=mix_ns, num_warps=mix_nw)
    return acc, m, s


class _Phase1Fn(torch.autograd.Function):
    """Triton forward; backward by recomputation through the float32 reference (correct, not fast)."""

    @staticmethod
    def forward(ctx, queries, rms_weights, eps, acc_dtype, *xs):
        ctx.save_for_backward(queries, rms_weights, *xs)
        ctx.eps = eps
        acc, m, s = phase1_launch(queries, xs, rms_weights, eps, acc_dtype)
        return acc, m, s

    @staticmethod
    def backward(ctx, dacc, dm, ds):
        no_create_graph("backends.triton.attn_residual_phase1")
        queries, rms_weights, *xs = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in (queries, rms_weights, *xs)]
            acc, m, s = ref.attn_residual_phase1(ins[0], ins[2:], ins[1], eps=ctx.eps)
            outs, gs = [], []
            for o, g in ((acc, dacc), (m, dm), (s, ds)):
                if g is not None:
                    outs.append(o)
                    gs.append(g.float())
            grads = torch.autograd.grad(outs, ins, gs, allow_unused=True)
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grads, ins)]
        return (grads[0], grads[1], None, None, *grads[2:])


@on_tensor_device
def attn_residual_phase1(queries: torch.Tensor, bank: Sequence[torch.Tensor], rms_weights: torch.Tensor, *,
                         eps: float = 1e-6, acc_dtype: torch.dtype = torch.float32):
    """Phase 1 of the two-phase Block AttnRes: all Q queries of a block against the completed bank.

    Math: spec/OPS.md "Two-phase form" (online softmax, flash-attention merge rule). For query q and
    bank source i: ``logit_qi = <queries[q], RMSNorm(bank_i; rms_weights[q], eps)>``, ``m_q = max_i logit_qi``,
    ``s_q = sum_i exp(logit_qi - m_q)``, ``acc_q = sum_i exp(logit_qi - m_q) bank_i``.
    Kernels: the logits of all Q queries come from one read of the bank (a [tokens, d] x [d, Q]
    tensor-core product, float32-accurate: 3xTF32, or for bf16 banks the tile against queries * rms_weights in
    three bf16 parts), then the softmax max and sum per token and query; the weighted sums are formed per
    (token, d-chunk) tile for every query (banks of up to AttnResConfig.mix_bank_max_sources sources; larger
    ones per (token, d-chunk, query-group) tile) and written once.

    Args:
        queries: [Q, d] float tensor; rms_weights: [Q, d].
        bank: list/tuple of L >= 1 tensors [..., d], same shape/dtype (float32/float16/bfloat16), CUDA
            (or CPU under TRITON_INTERPRET=1).
        eps: RMSNorm epsilon, > 0.
        acc_dtype: dtype of ``acc``; float32 (the contract, default) or the bank's dtype to halve the
            bytes written and read by the merges (acc is then rounded once; m and s stay float32).

    Returns:
        (acc [Q, ..., d] acc_dtype, m [Q, ...] float32, s [Q, ...] float32), as the reference.
        For a bank of one source, acc is that source broadcast over the Q queries (a read-only expanded
        view, or of its copy in acc_dtype): the same values, Q - 1 fewer [..., d] tensors written.
        Differentiable (the backward recomputes through the float32 reference: correct but not fast).

    Raises:
        ValueError / TypeError: as the reference (empty bank, mismatched shapes or dtypes, bad eps, a CPU
            result that overflows), unsupported dtypes, CPU tensors without the interpreter. CPU inputs past
            2^40 give the reference's result (as attn_residual).
    """
    shape, dtype, Q, d = ref.check_phase1_args(queries, bank, rms_weights, eps, acc_dtype=acc_dtype)
    check_device(bank[0], "attn_residual_phase1")
    if ref.needs_safe_path(queries, bank, rms_weights):
        # values past 2^40 (CPU inputs): the reference's exactly scaled rows, as attn_residual
        return ref.attn_residual_phase1(queries, bank, rms_weights, eps=eps, acc_dtype=acc_dtype)
    xs = [flat(b, d) for b in bank]
    acc, m, s = _Phase1Fn.apply(queries.contiguous(), rms_weights.contiguous(), float(eps), acc_dtype, *xs)
    tok = shape[:-1]
    acc, m, s = acc.view(Q, *tok, d), m.view(Q, *tok), s.view(Q, *tok)
    ref.check_two_phase_result("attn_residual_phase1", m=m, s=s, acc=acc)
    return acc, m, s
