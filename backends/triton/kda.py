"""Triton Kimi Delta Attention: kda_gate, kda_chunk (forward + backward), kda_step.

Same signatures and results as backends/reference/kda.py (spec/OPS.md); math from Kimi Linear
(arXiv 2510.26692, eqs. 1-8, WY/UT representation of the chunked delta rule).

Kernel plan (chunks of C = 64 tokens, sub-tiles of 16, state S [K, V] float32 between chunks):

(The default forward, ``INTRA_IMPL = "v5"``, splits step 1 into ``_chunk_cumsum_kernel`` (G), ``_fwd_strip32_kernel``
(Akk and P on 32-row pairs where the gate allows, else ``_fwd_strip5_kernel``'s 16-row blocks),
``_fwd_solve4_kernel`` ((I + Akk)^-1) and ``_fwd_wu_kernel``; v2 / v3 below are the earlier forms
of the same math. Step 2's BV is ``H_CFG["bv"]``: 32, or 64 when 32-column programs would take two waves; in a
forward without autograd 16 when 16-column programs fit one per SM, which then run unsplit with 3 pipeline stages.)

1. intra-chunk step (parallel over chunks x heads).  Cumulative log decay G inside the chunk; the
   two causal 64x64 matrices  Akk_ij = beta_i sum_d k_id k_jd e^(G_id - G_jd)  (j < i)  and
   P_ij = sum_d q_id k_jd e^(G_id - G_jd)  (j <= i)  row-block by row-block: for the 16-row block r with
   anchor row m, ONE dense ``tl.dot`` of  (x_i e^(G_i - G_m))  with  (k_j e^(G_m - G_j))  covers every
   causal tile of that row block, the diagonal one included.  With a lower-bounded gate (g >= L >= -10)
   the anchor is the block's middle row and every factor stays within e^(+-80) (float32/bf16 range).
   The bound is CHECKED per chunk in the kernel (min of g); a chunk that breaks it, and every chunk when
   no bound is promised (``lower_bound=None``, e.g. the softplus gate), takes the safe path: the anchor
   moves to the block's first row, the dense dot covers only the strictly-earlier tiles (all exponents
   <= 0) and the diagonal 16x16 tile is summed token pair by token pair with exponents G_i - G_j <= 0.
   (I + Akk)^-1 by forward substitution on the 16x16 diagonal blocks and blocked merges (dots); then
   Wk = T diag(beta) (K e^G), U = T diag(beta) V, and the decayed operands q e^G, k e^(G_C - G), e^(G_C).
   ``INTRA_IMPL = "v3"`` runs ``_fwd_intra3_kernel`` instead of ``_fwd_intra2_kernel`` +
   ``_fwd_wu_kernel`` (the current successors of step 1): one program per (chunk, head) with 4 warps, the
   channels in slices of BK, Akk and P accumulated as four 16-row strips [16, 64] (an mma tile with 16 rows
   spreads its columns over the warps; 16x16 tiles are replicated in every warp), the bound checked per row
   block and channel slice, T formed strip by strip, and Wk, U written directly (no float32 T buffer).
2. ``_fwd_h_kernel`` (serial over the chunks of a segment; grid V/BV x heads x segments, BV = 16, 32 or 64, 4
   warps, the state a K x BV float32 register tile): per chunk it stores the chunk-entry state h_c to
   HB [N_chunks, H, K, V] (input dtype), forms W = U - Wk S (stored as VN, the "new values"), and updates
   S <- diag(e^(G_C)) S + (k e^(G_C - G))^T W.  Nothing else sits on the serial path; its tile addresses
   are affine in the loop counter, so the compiler prefetches chunk j+1 (cp.async) while chunk j computes.
   ``_fwd_o_kernel`` (fully parallel over chunks x heads) then forms O = (q e^G) h_c + P W.
3. Long context: the sequence is cut into segments (count from a wave model of the serial passes,
   ``_seg_chunks_for``).  Per segment, in parallel, ``_fwd_h_kernel`` run on the augmented state [M | D]
   (K x (K+V), starting from [I | 0], values [0 | U]) gives the affine segment map S_out = M S_in + D
   (context-parallel algebra for linear attention); ``_combine_kernel`` chains the maps serially (one
   K x K x V product per segment), and then every segment runs step 2 in parallel from its own entry state.
   A forward without autograd of one long unsplit sequence (from ``PIPE_CFG["min_chunks"]`` chunks) runs
   as a pipeline instead (``_fwd_pipelined``): the sequence is cut into pieces of ~256 chunks; piece p's
   step 1 runs on the caller's stream while piece p-1's step 2 (its chain on a high-priority stream, 32
   state columns, so it holds half the SMs) and piece p-2's output kernel run beside it on two more streams
   (with ``PIPE_CFG["fuse_o"]``, the default, the state pass forms the output itself: two streams, no HB / VN).
   Same arithmetic; the chain, latency-bound, hides behind the parallel work (H200, H = 16, 1M: 54.8 ms on one
   stream -> 48.2 with the output kernel on its own stream -> 42.5 with it fused into the state pass).
4. Backward: the state gradient obeys the transposed recurrence
   dS_prev = (diag(e^(G_C)) - Wk^T Kd) dS + (q e^G)^T dO - Wk^T P^T dO, computed with the same segment
   algebra in reverse (``_bwd_state_kernel`` MODE 1 for the segment maps).  ``BWD_IMPL = "v2"`` (the
   default) then keeps only the chain itself on the serial path: ``_bwd_dh_kernel`` (grid V/BV x heads x
   segments, like step 2) stores each chunk's exit-state gradient (DHB), the gradient of the new values
   dW = P^T dO + Kd dS and the decay gradient's partial sums; ``_bwd_chunk_kernel`` (parallel over chunks x
   heads) forms the products that sum over V (gradients of P, q e^G, k e^(G_C - G), Wk).  The intra-chunk
   backward is two parallel kernels: ``_bwd_ut_kernel`` per chunk (UT transform backward from the T and
   Bm the forward kept: dv, dbeta, and the gradients of Akk and of k e^G) and ``_bwd_pair_kernel`` per
   (chunk, head, 32-channel slice) (the pairwise-decay products backward with the same anchored dense
   dots, dq, dk, and the reverse cumsum for dg; slices within the bound and the others in two launches).
   ``"v1"``: ``_bwd_state_kernel`` MODE 0 does the chain and the per-chunk products in one program per
   (segment, head), and ``_bwd_intra_kernel`` the whole intra backward per chunk (it spills registers).
"""
from __future__ import annotations

import contextlib
import functools
import math
import numbers

import numpy as np
import torch
import triton
import triton.language as tl

from backends.cuda_device import on_tensor_device
from backends.reference import kda as _ref
from backends.reference.ops import check_finite_cpu, check_flag
from .guard import (DeviceTableCache, cdiv, check_forward_only, check_interpreter_dot_dtype, check_kernel_device,
                    check_kernel_dtype, device_table, interpreted, mark_phase, next_power_of_2, no_create_graph,
                    scan_values, sm_count)

__all__ = ["kda_gate", "kda_chunk", "kda_step", "FAST_LOWER_BOUND_LIMIT"]

CHUNK = 64
# the most negative promised bound for which the dense diagonal tiles stay in range (8 * 10 = 80 < 88)
FAST_LOWER_BOUND_LIMIT = -10.0
# the same for float16 operands: the anchored factors reach e^(8 |L|) and float16 ends at 65504 ~ e^11.09, so
# the dense tiles need L >= -1.25 there; a lower bound below that runs the safe path (same result)
FP16_FAST_LOWER_BOUND_LIMIT = -1.25
# _fwd_strip32_kernel's dense 32-row pairs: G may fall by at most this much across a pair (exponents within +-80.5
# about its middle); 32 gates at the bound -5 fall by 160, the slack absorbs the rounding of the float32 G
_SPAN32 = tl.constexpr(161.0)


# ----------------------------------------------------------------------------------------------------
# small register-tile helpers
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _get_rows(X, r, NB: tl.constexpr, BR: tl.constexpr, NC: tl.constexpr):
    """X [NB*BR, NC] -> rows r*BR .. r*BR+BR-1 as [BR, NC]."""
    X3 = tl.reshape(X, [NB, BR, NC])
    idx = tl.arange(0, NB)
    return tl.sum(tl.where(idx[:, None, None] == r, X3, 0.0), axis=0)


@triton.jit
def _put_rows(X, blk, r, NB: tl.constexpr, BR: tl.constexpr, NC: tl.constexpr):
    """X [NB*BR, NC] with rows r*BR.. replaced by blk [BR, NC]."""
    X3 = tl.reshape(X, [NB, BR, NC])
    idx = tl.arange(0, NB)
    X3 = tl.where(idx[:, None, None] == r, blk[None, :, :], X3)
    return tl.reshape(X3, [NB * BR, NC])


@triton.jit
def _get_cols(X, r, NR: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr):
    """X [NR, NB*BC] -> columns r*BC .. r*BC+BC-1 as [NR, BC]."""
    X3 = tl.reshape(X, [NR, NB, BC])
    idx = tl.arange(0, NB)
    return tl.sum(tl.where(idx[None, :, None] == r, X3, 0.0), axis=1)


@triton.jit
def _add_cols(X, blk, r, NR: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr):
    """X [NR, NB*BC] plus blk [NR, BC] added into columns r*BC.."""
    X3 = tl.reshape(X, [NR, NB, BC])
    idx = tl.arange(0, NB)
    X3 = X3 + tl.where(idx[None, :, None] == r, blk[:, None, :], 0.0)
    return tl.reshape(X3, [NR, NB * BC])


@triton.jit
def _row_of(X, rows, i):
    return tl.sum(tl.where(rows[:, None] == i, X, 0.0), axis=0)


@triton.jit
def _inv_unit_lower16(D):
    """(I + D)^-1 for a strictly lower-triangular D [16, 16], by forward substitution (float32)."""
    r16 = tl.arange(0, 16)
    Ti = tl.where(r16[:, None] == r16[None, :], 1.0, 0.0)
    for i in range(1, 16):
        row = tl.sum(tl.where(r16[:, None] == i, D, 0.0), axis=0)          # D[i, :]
        t = tl.sum(row[:, None] * Ti, axis=0)                               # sum_m D[i,m] Ti[m,:]
        Ti = tl.where(r16[:, None] == i, Ti - t[None, :], Ti)
    return Ti


@triton.jit
def _diag_pair(a_r, b_r, G_r):
    """Safe diagonal tile: M[i,j] = sum_d a_id b_jd exp(G_id - G_jd) for j <= i (exponents <= 0)."""
    r16 = tl.arange(0, 16)
    M = tl.zeros([16, 16], dtype=tl.float32)
    for j in range(16):
        bj = _row_of(b_r, r16, j)
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        col = tl.sum(a_r * bj[None, :] * e, axis=1)
        M = tl.where(r16[None, :] == j, col[:, None], M)
    return M


@triton.jit
def _diag_da(dM, b_r, G_r):
    """Safe diagonal tile backward, row side: da_i = sum_{j<=i} dM_ij b_j exp(G_i - G_j)."""
    r16 = tl.arange(0, 16)
    da = tl.zeros_like(b_r)
    for j in range(16):
        bj = _row_of(b_r, r16, j)
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        dmj = tl.sum(tl.where(r16[None, :] == j, dM, 0.0), axis=1)
        da += dmj[:, None] * bj[None, :] * e
    return da


@triton.jit
def _diag_db(dM, a_r, G_r):
    """Safe diagonal tile backward, column side: db_j = sum_{i>=j} dM_ij a_i exp(G_i - G_j)."""
    r16 = tl.arange(0, 16)
    db = tl.zeros_like(a_r)
    for j in range(16):
        Gj = _row_of(G_r, r16, j)
        e = tl.exp(tl.where(r16[:, None] >= j, G_r - Gj[None, :], float("-inf")))
        dmj = tl.sum(tl.where(r16[None, :] == j, dM, 0.0), axis=1)
        row = tl.sum(dmj[:, None] * a_r * e, axis=0)
        db = tl.where(r16[:, None] == j, row[None, :], db)
    return db


@triton.jit
def _dt(a, b, DT: tl.constexpr):
    """dot with both operands cast to DT (the input dtype: bf16/fp16 tensor cores, or float32)."""
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _chunk_intra(qq, kk, G, bb, fast, K: tl.constexpr, NEED_B: tl.constexpr):
    """T = (I + Akk)^-1, P (lower incl. diagonal, unscaled), B (strictly lower, before beta) for one chunk.

    qq, kk, G [64, K] float32 (rows past the chunk end: q = k = 0, G constant); bb [64]; fast: int32
    scalar, 1 = the chunk's gate is within the bound (dense diagonal tiles), 0 = safe diagonal tiles.
    """
    rows = tl.arange(0, 64)
    r16 = tl.arange(0, 16)
    T = tl.zeros([64, 64], dtype=tl.float32)
    P = tl.zeros([64, 64], dtype=tl.float32)
    Bm = tl.zeros([64, 64], dtype=tl.float32)
    for r in tl.static_range(4):
        a = r * 16
        m = a + 8 * fast                        # anchor row: block middle (fast) or block start (safe)
        Gm = _row_of(G, rows, m)
        q_r = _get_rows(qq, r, 4, 16, K)
        k_r = _get_rows(kk, r, 4, 16, K)
        G_r = _get_rows(G, r, 4, 16, K)
        b_r = tl.sum(tl.where(tl.arange(0, 4)[:, None] == r, tl.reshape(bb, [4, 16]), 0.0), axis=0)
        er = tl.exp(G_r - Gm[None, :])
        lim = a + 16 * fast
        kb = kk * tl.exp(tl.where(rows[:, None] < lim, Gm[None, :] - G, float("-inf")))
        A_r = tl.dot(k_r * er, tl.trans(kb))
        P_r = tl.dot(q_r * er, tl.trans(kb))
        if fast == 0:
            A_r = _add_cols(A_r, _diag_pair(k_r, k_r, G_r), r, 16, 4, 16)
            P_r = _add_cols(P_r, _diag_pair(q_r, k_r, G_r), r, 16, 4, 16)
        rows_r = a + r16
        A_r = tl.where(rows[None, :] < rows_r[:, None], A_r, 0.0)
        P_r = tl.where(rows[None, :] <= rows_r[:, None], P_r, 0.0)
        Ab = A_r * b_r[:, None]
        Dinv = _inv_unit_lower16(_get_cols(Ab, r, 16, 4, 16))
        A_off = tl.where(rows[None, :] < a, Ab, 0.0)
        E_r = tl.where(rows[None, :] == rows_r[:, None], 1.0, 0.0)
        X = E_r - tl.dot(A_off, T)
        T_r = tl.dot(Dinv, X)
        T = _put_rows(T, T_r, r, 4, 16, 64)
        P = _put_rows(P, P_r, r, 4, 16, 64)
        if NEED_B:
            Bm = _put_rows(Bm, A_r, r, 4, 16, 64)
    return T, P, Bm


@triton.jit
def _load_chunk(q, k, g, beta, t0, L, h, H, K: tl.constexpr, FAST: tl.constexpr, lb):
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    rm = rows < L
    offk = (t0 + rows).to(tl.int64)[:, None] * (H * K) + h * K + dk[None, :]
    qq = tl.load(q + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    kk = tl.load(k + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    gg = tl.load(g + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    bb = tl.load(beta + (t0 + rows).to(tl.int64) * H + h, mask=rm, other=0.0).to(tl.float32)
    G = tl.cumsum(gg, axis=0)
    if FAST:
        gmin = tl.min(tl.min(gg, axis=1), axis=0)
        fast = (gmin >= lb).to(tl.int32)
    else:
        fast = tl.zeros([], dtype=tl.int32)
    return qq, kk, G, bb, fast, offk, rm


# ----------------------------------------------------------------------------------------------------
# forward intra-chunk kernel, tile by tile (no 64x64 register tiles, no row extraction by reduction)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _inv16(N):
    """_inv16p in float32 (ieee) precision."""
    return _inv16p(N, "ieee")


@triton.jit
def _inv16p(N, PREC: tl.constexpr):
    """(I + N)^-1 for a strictly lower-triangular N [16, 16] (float32), by recursive block doubling:
    with T the inverse of the diagonal s-blocks, the inverse of the 2s-blocks is T - T (N restricted to
    the lower-left s-blocks inside each 2s-block) T.  Eight 16x16 products (tl.dot input precision PREC),
    no per-row loop."""
    i = tl.arange(0, 16)
    lower1 = ((i[:, None] // 2) == (i[None, :] // 2)) & (i[:, None] > i[None, :])
    T = tl.where(i[:, None] == i[None, :], 1.0, 0.0) - tl.where(lower1, N, 0.0)
    for lvl in tl.static_range(1, 4):
        m = ((i[:, None] >> (lvl + 1)) == (i[None, :] >> (lvl + 1))) & ((i[:, None] >> lvl) > (i[None, :] >> lvl))
        Nm = tl.where(m, N, 0.0)
        T = T - tl.dot(tl.dot(T, Nm, input_precision=PREC), T, input_precision=PREC)
    return T


@triton.jit
def _blk(ptr, t0, L, h, H, R: tl.constexpr, W: tl.constexpr):
    """Rows R*16 .. R*16+15 of one chunk of a [N, H, W] tensor as [16, W] float32 (0 past the end)."""
    rows = R * 16 + tl.arange(0, 16)
    d = tl.arange(0, W)
    off = (t0 + rows).to(tl.int64)[:, None] * (H * W) + h * W + d[None, :]
    return tl.load(ptr + off, mask=(rows < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _put(ptr, x, t0, L, h, H, R: tl.constexpr, W: tl.constexpr, C0: tl.constexpr):
    """Store x [16, CW] into rows R*16.. and columns C0.. of one chunk of a [N, H, W] tensor."""
    rows = R * 16 + tl.arange(0, 16)
    d = C0 + tl.arange(0, x.shape[1])
    off = (t0 + rows).to(tl.int64)[:, None] * (H * W) + h * W + d[None, :]
    tl.store(ptr + off, x.to(ptr.dtype.element_ty), mask=(rows < L)[:, None])


@triton.jit
def _gsum(g, t0, L, h, H, R: tl.constexpr, K: tl.constexpr):
    """Sum over the 16 rows of block R of g ([K]) and the block's minimum (rows past the end read 0)."""
    x = _blk(g, t0, L, h, H, R, K)
    return tl.sum(x, axis=0), tl.min(tl.min(x, axis=1), axis=0)


@triton.jit
def _rowblock(q, k, v, g, beta, QG, KD, t0, L, h, H, cl, ch, cend, fast, scale,
              R: tl.constexpr, K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    """Everything of row block R that needs no other block: anchored row operands, the diagonal tiles of
    Akk (strictly lower, times beta) and P (lower incl. diagonal), and the per-token outputs.

    cl, ch [K]: G at the rows before / at the end of the block; cend [K]: G at the chunk end.  Anchor
    c = midpoint of [ch, cl] per channel when the chunk is within the bound (fast), else cl."""
    r16 = tl.arange(0, 16)
    gg = _blk(g, t0, L, h, H, R, K)
    kk = _blk(k, t0, L, h, H, R, K)
    qq = _blk(q, t0, L, h, H, R, K)
    rows = R * 16 + r16
    bb = tl.load(beta + (t0 + rows).to(tl.int64) * H + h, mask=rows < L, other=0.0).to(tl.float32)
    G = cl[None, :] + tl.cumsum(gg, axis=0)
    if FAST:
        c = cl + 0.5 * (ch - cl) * fast.to(tl.float32)
    else:
        c = cl
    er = tl.exp(G - c[None, :])
    X = (kk * er).to(DT)
    Q = (qq * er).to(DT)
    if FAST:
        if fast != 0:
            kc = (kk * tl.exp(c[None, :] - G)).to(DT)
            Ad = tl.dot(X, tl.trans(kc))
            Pd = tl.dot(Q, tl.trans(kc))
        else:
            Ad = _diag_pair(kk, kk, G)
            Pd = _diag_pair(qq, kk, G)
    else:
        Ad = _diag_pair(kk, kk, G)
        Pd = _diag_pair(qq, kk, G)
    Nd = tl.where(r16[:, None] > r16[None, :], Ad * bb[:, None], 0.0)
    Pd = tl.where(r16[:, None] >= r16[None, :], Pd, 0.0)
    eG = tl.exp(G)
    _put(QG, qq * eG * scale, t0, L, h, H, R, K, 0)
    _put(KD, kk * tl.exp(cend[None, :] - G), t0, L, h, H, R, K, 0)
    kend = (kk * tl.exp(ch[None, :] - G)).to(DT)          # k_j e^(G_blockend - G_j), all exponents <= 0
    return X, Q, c, bb, Nd, Pd, kend


@triton.jit
def _off(X, Q, bb, kend, c, ch_j):
    """Off-diagonal tiles (row block r, column block j < r): N_rj = beta_r (X kj^T), P_rj = Q kj^T with the
    column operand k_j e^(c - G_j) = kend_j e^(c - G_end(j)) (both factors <= 1)."""
    col = (kend.to(tl.float32) * tl.exp(c - ch_j)[None, :]).to(X.dtype)
    A = tl.dot(X, tl.trans(col))
    P = tl.dot(Q, tl.trans(col))
    return A * bb[:, None], P


@triton.jit
def _mm(a, b):
    return _mmp(a, b, "ieee")


@triton.jit
def _mmp(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _fwd_intra2_kernel(q, k, v, g, beta, cstart, clen, TB, QG, KD, AQK, GAM, scale, lb, H,
                       K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    """One (chunk, head), in 16x16 tiles (row blocks in order): AQK = scale P (64x64, lower incl.
    diagonal; zero above), TB = T = (I + diag(beta) Akk)^-1 (the 10 lower tiles only), QG = scale q e^G,
    KD = k e^(G_C - G), GAM = e^(G_C).  _fwd_wu_kernel then forms Wk and U from T."""
    c_ = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    dk = tl.arange(0, K)
    s0, m0 = _gsum(g, t0, L, h, H, 0, K)
    s1, m1 = _gsum(g, t0, L, h, H, 1, K)
    s2, m2 = _gsum(g, t0, L, h, H, 2, K)
    s3, m3 = _gsum(g, t0, L, h, H, 3, K)
    c0 = tl.zeros([K], dtype=tl.float32)
    c1 = s0
    c2 = c1 + s1
    c3 = c2 + s2
    c4 = c3 + s3
    if FAST:
        gmin = tl.minimum(tl.minimum(m0, m1), tl.minimum(m2, m3))
        fast = (gmin >= lb).to(tl.int32)
    else:
        fast = tl.zeros([], dtype=tl.int32)
    tl.store(GAM + (tl.cast(c_, tl.int64) * H + h) * K + dk, tl.exp(c4))
    zero = tl.zeros([16, 16], dtype=tl.float32)
    # ---- phase 1, row block 0
    X, Q, c, bb, N00, P00, kend0 = _rowblock(q, k, v, g, beta, QG, KD, t0, L, h, H, c0, c1, c4, fast,
                                                     scale, 0, K, V, FAST, DT)
    T00 = _inv16(N00)
    _put(AQK, P00 * scale, t0, L, h, H, 0, 64, 0)
    _put(AQK, zero, t0, L, h, H, 0, 64, 16)
    _put(AQK, tl.zeros([16, 32], dtype=tl.float32), t0, L, h, H, 0, 64, 32)
    # ---- row block 1
    X, Q, c, bb, N11, P11, kend1 = _rowblock(q, k, v, g, beta, QG, KD, t0, L, h, H, c1, c2, c4, fast,
                                                     scale, 1, K, V, FAST, DT)
    N10, P10 = _off(X, Q, bb, kend0, c, c1)
    T11 = _inv16(N11)
    T10 = -_mm(T11, _mm(N10, T00))
    _put(AQK, P10 * scale, t0, L, h, H, 1, 64, 0)
    _put(AQK, P11 * scale, t0, L, h, H, 1, 64, 16)
    _put(AQK, tl.zeros([16, 32], dtype=tl.float32), t0, L, h, H, 1, 64, 32)
    # ---- row block 2
    X, Q, c, bb, N22, P22, kend2 = _rowblock(q, k, v, g, beta, QG, KD, t0, L, h, H, c2, c3, c4, fast,
                                                     scale, 2, K, V, FAST, DT)
    N20, P20 = _off(X, Q, bb, kend0, c, c1)
    N21, P21 = _off(X, Q, bb, kend1, c, c2)
    T22 = _inv16(N22)
    T21 = -_mm(T22, _mm(N21, T11))
    T20 = -_mm(T22, _mm(N20, T00) + _mm(N21, T10))
    _put(AQK, P20 * scale, t0, L, h, H, 2, 64, 0)
    _put(AQK, P21 * scale, t0, L, h, H, 2, 64, 16)
    _put(AQK, P22 * scale, t0, L, h, H, 2, 64, 32)
    _put(AQK, zero, t0, L, h, H, 2, 64, 48)
    # ---- row block 3
    X, Q, c, bb, N33, P33, kend3 = _rowblock(q, k, v, g, beta, QG, KD, t0, L, h, H, c3, c4, c4, fast,
                                                     scale, 3, K, V, FAST, DT)
    N30, P30 = _off(X, Q, bb, kend0, c, c1)
    N31, P31 = _off(X, Q, bb, kend1, c, c2)
    N32, P32 = _off(X, Q, bb, kend2, c, c3)
    T33 = _inv16(N33)
    T32 = -_mm(T33, _mm(N32, T22))
    T31 = -_mm(T33, _mm(N31, T11) + _mm(N32, T21))
    T30 = -_mm(T33, _mm(N30, T00) + _mm(N31, T10) + _mm(N32, T20))
    _put(AQK, P30 * scale, t0, L, h, H, 3, 64, 0)
    _put(AQK, P31 * scale, t0, L, h, H, 3, 64, 16)
    _put(AQK, P32 * scale, t0, L, h, H, 3, 64, 32)
    _put(AQK, P33 * scale, t0, L, h, H, 3, 64, 48)
    _put(TB, T00, t0, L, h, H, 0, 64, 0)
    _put(TB, T10, t0, L, h, H, 1, 64, 0)
    _put(TB, T11, t0, L, h, H, 1, 64, 16)
    _put(TB, T20, t0, L, h, H, 2, 64, 0)
    _put(TB, T21, t0, L, h, H, 2, 64, 16)
    _put(TB, T22, t0, L, h, H, 2, 64, 32)
    _put(TB, T30, t0, L, h, H, 3, 64, 0)
    _put(TB, T31, t0, L, h, H, 3, 64, 16)
    _put(TB, T32, t0, L, h, H, 3, 64, 32)
    _put(TB, T33, t0, L, h, H, 3, 64, 48)


@triton.jit
def _chunk_head(HM: tl.constexpr, S: tl.constexpr = 1):
    """(chunk, head, sub-program) of a per-(chunk, head) kernel with S programs per (chunk, head): grid (NC, H, S),
    or head-major (HM) (H * S, NC), a chunk's heads (and their S programs) next to each other (_ch_grid)."""
    if HM:
        c = tl.program_id(1)
        h = tl.program_id(0) // S
        sub = tl.program_id(0) % S
    else:
        c = tl.program_id(0)
        h = tl.program_id(1)
        sub = tl.program_id(2)
    return c, h, sub


@triton.jit
def _fwd_wu_kernel(k, v, g, beta, cstart, clen, TB, WK, U, H, K: tl.constexpr, V: tl.constexpr, DT: tl.constexpr,
                   CUMSUM: tl.constexpr = False, KGB_IN: tl.constexpr = False, HM: tl.constexpr = False):
    """One (chunk, head): Wk = T (beta k e^G), U = T (beta v) with T [64, 64] from _fwd_intra2_kernel
    (lower block-triangular; the blocks above the diagonal are never written and are masked here; float32
    or the input dtype: it is rounded to the input dtype for the dots either way).
    CUMSUM: ``g`` already holds the in-chunk cumulative gate G (_chunk_cumsum_kernel's output).
    KGB_IN: ``k`` already holds beta k e^G (_fwd_strip5_kernel's KGB; ``g`` is not read)."""
    c_, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows = tl.arange(0, 64)
    rm = rows < L
    tok = (t0.to(tl.int64) * H + h)
    bb = tl.load(beta + tok + rows * H, mask=rm, other=0.0).to(tl.float32)
    T = tl.load(TB + tok * 64 + rows[:, None] * (H * 64) + rows[None, :],
                mask=rm[:, None] & ((rows[None, :] // 16) <= (rows[:, None] // 16)), other=0.0)
    T = T.to(DT)
    # [64, K] / [64, V] tiles of the chunk's rows (rows past L masked: zero loads, no stores), 64-bit offsets:
    # plain pointers, as the compiler rewrites block pointers (triton 3.9 removed tl.make_block_ptr)
    rows64 = rows.to(tl.int64)[:, None]
    ok = tok * K + rows64 * (H * K) + tl.arange(0, K)[None, :]
    ov = tok * V + rows64 * (H * V) + tl.arange(0, V)[None, :]
    m2 = rm[:, None]
    if KGB_IN:
        kg = tl.load(k + ok, mask=m2, other=0.0).to(DT)
    else:
        if CUMSUM:
            G = tl.load(g + ok, mask=m2, other=0.0)
        else:
            G = tl.cumsum(tl.load(g + ok, mask=m2, other=0.0), axis=0)
        kg = (tl.load(k + ok, mask=m2, other=0.0).to(tl.float32) * tl.exp(G) * bb[:, None]).to(DT)
    tl.store(WK + ok, tl.dot(T, kg).to(WK.dtype.element_ty), mask=m2)
    vb = (tl.load(v + ov, mask=m2, other=0.0).to(tl.float32) * bb[:, None]).to(DT)
    tl.store(U + ov, tl.dot(T, vb).to(U.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------------------------------
# forward intra-chunk kernel v3: 16-row strips [16, 64] (no 16x16 accumulators), channels in slices of BK,
# the w/u step merged in (no float32 T scratch)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _blk3(ptr, t0, L, h, H, R: tl.constexpr, W: tl.constexpr, c0, BW: tl.constexpr):
    """Rows R*16 .. R*16+15, columns c0 .. c0+BW-1 of one chunk of a [N, H, W] tensor as [16, BW] float32
    (0 past the chunk end)."""
    rows = R * 16 + tl.arange(0, 16)
    d = c0 + tl.arange(0, BW)
    base = ptr + (t0.to(tl.int64) * H + h) * W          # 64-bit scalar base, 32-bit offsets in the chunk
    return tl.load(base + rows[:, None] * (H * W) + d[None, :], mask=(rows < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _put3(ptr, x, t0, L, h, H, R: tl.constexpr, W: tl.constexpr, c0):
    """Store x [16, BW] into rows R*16.. and columns c0.. of one chunk of a [N, H, W] tensor."""
    rows = R * 16 + tl.arange(0, 16)
    d = c0 + tl.arange(0, x.shape[1])
    base = ptr + (t0.to(tl.int64) * H + h) * W
    tl.store(base + rows[:, None] * (H * W) + d[None, :], x.to(ptr.dtype.element_ty), mask=(rows < L)[:, None])


@triton.jit
def _chunk3(ptr, t0, L, h, H, W: tl.constexpr, c0, BW: tl.constexpr):
    """The 64 rows, columns c0 .. c0+BW-1 of one chunk of a [N, H, W] tensor as [64, BW] float32."""
    rows = tl.arange(0, 64)
    d = c0 + tl.arange(0, BW)
    base = ptr + (t0.to(tl.int64) * H + h) * W          # 64-bit scalar base, 32-bit offsets in the chunk
    return tl.load(base + rows[:, None] * (H * W) + d[None, :], mask=(rows < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _put_chunk3(ptr, x, t0, L, h, H, W: tl.constexpr, c0):
    rows = tl.arange(0, 64)
    d = c0 + tl.arange(0, x.shape[1])
    base = ptr + (t0.to(tl.int64) * H + h) * W
    tl.store(base + rows[:, None] * (H * W) + d[None, :], x.to(ptr.dtype.element_ty), mask=(rows < L)[:, None])


@triton.jit
def _strip3(q, k, g, QG, kk64, G64, cl, t0, L, h, H, ks, lb, scale, R: tl.constexpr, K: tl.constexpr,
            BK: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr, DO_A: tl.constexpr, DO_P: tl.constexpr):
    """Row block R, channels ks .. ks+BK-1: this slice's contribution to the strips Akk[R] and P[R] ([16, 64]
    float32, every column block, unmasked) and G at the block end; stores QG = scale q e^G (DO_P).

    Row operand x_i e^(G_i - c), column operand k_j e^(c - G_j) (kk64, G64: the chunk's k and G [64, BK]).
    The anchor c is the block's middle row when FAST and this block's slice of the gate is >= lb (checked
    here, per row block and channel slice): one dense dot then covers the diagonal tile as well, every
    exponent within 8 |lb| <= 80; otherwise c = G before the block (all exponents <= 0), the dot covers the
    earlier column blocks only and the diagonal tile is summed token pair by token pair."""
    gg = _blk3(g, t0, L, h, H, R, K, ks, BK)
    kk = _blk3(k, t0, L, h, H, R, K, ks, BK)
    if DO_P:
        qq = _blk3(q, t0, L, h, H, R, K, ks, BK)
    else:
        qq = kk
    G = _get_rows(G64, R, 4, 16, BK)             # the rows of G64 (exactly: one scan feeds both operands)
    ch = _row_of(G, tl.arange(0, 16), 15)
    if FAST:
        fr = (tl.min(tl.min(gg, axis=1), axis=0) >= lb).to(tl.int32)
    else:
        fr = tl.zeros([], dtype=tl.int32)
    c = cl + 0.5 * (ch - cl) * fr.to(tl.float32)
    er = tl.exp(G - c[None, :])
    lim = R * 16 + 16 * fr
    rows64 = tl.arange(0, 64)
    col = (kk64 * tl.exp(tl.where(rows64[:, None] < lim, c[None, :] - G64, float("-inf")))).to(DT)
    a = tl.zeros([16, 64], dtype=tl.float32)
    p = tl.zeros([16, 64], dtype=tl.float32)
    if DO_A:
        a = tl.dot((kk * er).to(DT), tl.trans(col))
    if DO_P:
        p = tl.dot((qq * er).to(DT), tl.trans(col))
        _put3(QG, qq * tl.exp(G) * scale, t0, L, h, H, R, K, ks)
    if fr == 0:
        if DO_A:
            a = _add_cols(a, _diag_pair(kk, kk, G), R, 16, 4, 16)
        if DO_P:
            p = _add_cols(p, _diag_pair(qq, kk, G), R, 16, 4, 16)
    return a, p, ch


@triton.jit
def _beta16(beta, t0, L, h, H, R: tl.constexpr):
    rows = R * 16 + tl.arange(0, 16)
    return tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)


@triton.jit
def _tstrip(Dinv, Er, acc):
    """Row strip of T: Dinv (E_r - acc), acc = sum_{j<r} N_rj T_j (float32)."""
    return tl.dot(Dinv, Er - acc, input_precision="ieee")


@triton.jit
def _fwd_intra3_kernel(q, k, v, g, beta, cstart, clen, WK, U, QG, KD, AQK, GAM, scale, lb, H,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       FAST: tl.constexpr, DT: tl.constexpr, PART: tl.constexpr):
    """One (chunk, head): the intra-chunk matrices and the w/u step in one program (no float32 T scratch),
    everything in 16-row strips [16, 64] (an mma tile of 16 rows spreads its 64 columns over the warps;
    16x16 accumulators would be replicated in every warp).

    Pass 1 over channel slices of BK: accumulates the strips Akk[r] and P[r] (r = 0..3, float32) from dots
    with DT operands (_strip3), stores QG = scale q e^G and GAM = e^(G_C).  Then AQK = scale P (lower incl.
    diagonal, zero above) and, by blocked forward substitution on strips, T = (I + diag(beta) Akk)^-1:
    T[r] = (I + N_rr)^-1 (E_r - sum_{j<r} N_rj T[j]).  Pass 2 over channel slices: WK = T (beta k e^G) and
    KD = k e^(G_C - G); pass 3 over value slices of BV: U = T (beta v), one [16, 64] x [64, B] dot per strip.

    PART = 0: everything in one program; PART = 1: only the Akk side (T, WK, KD, U); PART = 2: only the P
    side (AQK, QG, GAM); two launches with PART = 1 and 2 give the same outputs with half the live strips."""
    DO_A: tl.constexpr = PART != 2
    DO_P: tl.constexpr = PART != 1
    c_ = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    z = tl.zeros([16, 64], dtype=tl.float32)
    A0, A1, A2, A3, P0, P1, P2, P3 = z, z, z, z, z, z, z, z
    for ks in range(0, K, BK):
        kk64 = _chunk3(k, t0, L, h, H, K, ks, BK)
        G64 = tl.cumsum(_chunk3(g, t0, L, h, H, K, ks, BK), axis=0)
        c0 = tl.zeros([BK], dtype=tl.float32)
        a, p, c1 = _strip3(q, k, g, QG, kk64, G64, c0, t0, L, h, H, ks, lb, scale, 0, K, BK, FAST, DT, DO_A, DO_P)
        A0 += a
        P0 += p
        a, p, c2 = _strip3(q, k, g, QG, kk64, G64, c1, t0, L, h, H, ks, lb, scale, 1, K, BK, FAST, DT, DO_A, DO_P)
        A1 += a
        P1 += p
        a, p, c3 = _strip3(q, k, g, QG, kk64, G64, c2, t0, L, h, H, ks, lb, scale, 2, K, BK, FAST, DT, DO_A, DO_P)
        A2 += a
        P2 += p
        a, p, c4 = _strip3(q, k, g, QG, kk64, G64, c3, t0, L, h, H, ks, lb, scale, 3, K, BK, FAST, DT, DO_A, DO_P)
        A3 += a
        P3 += p
        if DO_P:
            tl.store(GAM + (tl.cast(c_, tl.int64) * H + h) * K + ks + tl.arange(0, BK), tl.exp(c4))
    r16 = tl.arange(0, 16)
    cols = tl.arange(0, 64)
    if DO_P:
        _put3(AQK, tl.where(cols[None, :] <= r16[:, None], P0, 0.0) * scale, t0, L, h, H, 0, 64, 0)
        _put3(AQK, tl.where(cols[None, :] <= 16 + r16[:, None], P1, 0.0) * scale, t0, L, h, H, 1, 64, 0)
        _put3(AQK, tl.where(cols[None, :] <= 32 + r16[:, None], P2, 0.0) * scale, t0, L, h, H, 2, 64, 0)
        _put3(AQK, tl.where(cols[None, :] <= 48 + r16[:, None], P3, 0.0) * scale, t0, L, h, H, 3, 64, 0)
    if DO_A:
        b0 = _beta16(beta, t0, L, h, H, 0)
        b1 = _beta16(beta, t0, L, h, H, 1)
        b2 = _beta16(beta, t0, L, h, H, 2)
        b3 = _beta16(beta, t0, L, h, H, 3)
        N0 = tl.where(cols[None, :] < r16[:, None], A0, 0.0) * b0[:, None]
        N1 = tl.where(cols[None, :] < 16 + r16[:, None], A1, 0.0) * b1[:, None]
        N2 = tl.where(cols[None, :] < 32 + r16[:, None], A2, 0.0) * b2[:, None]
        N3 = tl.where(cols[None, :] < 48 + r16[:, None], A3, 0.0) * b3[:, None]
        T0 = _add_cols(z, _inv16(_get_cols(N0, 0, 16, 4, 16)), 0, 16, 4, 16)
        acc = _mm(_get_cols(N1, 0, 16, 4, 16), T0)
        T1 = _tstrip(_inv16(_get_cols(N1, 1, 16, 4, 16)), tl.where(cols[None, :] == 16 + r16[:, None], 1.0, 0.0),
                     acc)
        acc = _mm(_get_cols(N2, 0, 16, 4, 16), T0) + _mm(_get_cols(N2, 1, 16, 4, 16), T1)
        T2 = _tstrip(_inv16(_get_cols(N2, 2, 16, 4, 16)), tl.where(cols[None, :] == 32 + r16[:, None], 1.0, 0.0),
                     acc)
        acc = _mm(_get_cols(N3, 0, 16, 4, 16), T0) + _mm(_get_cols(N3, 1, 16, 4, 16), T1) + \
            _mm(_get_cols(N3, 2, 16, 4, 16), T2)
        T3 = _tstrip(_inv16(_get_cols(N3, 3, 16, 4, 16)), tl.where(cols[None, :] == 48 + r16[:, None], 1.0, 0.0),
                     acc)
        S0, S1, S2, S3 = T0.to(DT), T1.to(DT), T2.to(DT), T3.to(DT)
        rows64 = tl.arange(0, 64)
        bb = tl.load(beta + (t0.to(tl.int64) * H + h) + rows64 * H, mask=rows64 < L, other=0.0).to(tl.float32)
        for ks in range(0, K, BK):
            kk64 = _chunk3(k, t0, L, h, H, K, ks, BK)
            G64 = tl.cumsum(_chunk3(g, t0, L, h, H, K, ks, BK), axis=0)
            GC = tl.sum(tl.where(rows64[:, None] == 63, G64, 0.0), axis=0)
            _put_chunk3(KD, kk64 * tl.exp(GC[None, :] - G64), t0, L, h, H, K, ks)
            x = (kk64 * tl.exp(G64) * bb[:, None]).to(DT)
            _put3(WK, tl.dot(S0, x), t0, L, h, H, 0, K, ks)
            _put3(WK, tl.dot(S1, x), t0, L, h, H, 1, K, ks)
            _put3(WK, tl.dot(S2, x), t0, L, h, H, 2, K, ks)
            _put3(WK, tl.dot(S3, x), t0, L, h, H, 3, K, ks)
        for vs in range(0, V, BV):
            y = (_chunk3(v, t0, L, h, H, V, vs, BV) * bb[:, None]).to(DT)
            _put3(U, tl.dot(S0, y), t0, L, h, H, 0, V, vs)
            _put3(U, tl.dot(S1, y), t0, L, h, H, 1, V, vs)
            _put3(U, tl.dot(S2, y), t0, L, h, H, 2, V, vs)
            _put3(U, tl.dot(S3, y), t0, L, h, H, 3, V, vs)


# ----------------------------------------------------------------------------------------------------
# forward intra-chunk v4: three small kernels with many programs in flight instead of one heavy program
#   _fwd_strip4_kernel  (chunk, head, row block r), 2 warps: the strips Akk[r], P[r] [16, 64]
#   _fwd_solve4_kernel  (chunk, head), 1 warp: T = (I + N)^-1 on 16x16 tiles (no replicated mma tiles)
#   _fwd_wu_kernel      (chunk, head): Wk = T (beta k e^G), U = T (beta v), [64, 64] x [64, K] dots
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _strip_program(R_FAST: tl.constexpr):
    """(chunk, row block, head) of a strip program: grid (NC, H, 4), or with R_FAST (4 NC, H), the 4 row blocks
    of a chunk as consecutive programs."""
    if R_FAST:
        c_ = tl.program_id(0) // 4
        R = tl.program_id(0) % 4
    else:
        c_ = tl.program_id(0)
        R = tl.program_id(2)
    return c_, R, tl.program_id(1)


@triton.jit
def _strip_rows(cstart, clen, c_, h, R, H, K: tl.constexpr, ROWS: tl.constexpr = 16):
    """The row geometry of strip program (chunk c_, head h, row block R of ROWS rows): (t0, L, rows64, rows, base,
    m64, mr) = chunk start and length, the chunk's 64 rows and the block's ROWS, the 64-bit element base of
    (t0, h) and the in-chunk row masks of both."""
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows64 = tl.arange(0, 64)
    rows = R * ROWS + tl.arange(0, ROWS)
    base = (t0.to(tl.int64) * H + h) * K                 # 64-bit scalar base, 32-bit offsets in the chunk
    return t0, L, rows64, rows, base, (rows64 < L)[:, None], (rows < L)[:, None]


@triton.jit
def _ex(x, FTZ: tl.constexpr):
    """e^x (float32). FTZ: the log2(e) multiply and one ex2.approx.ftz.f32 (MUFU.EX2); results below 2^-126 flush
    to 0. tl.exp keeps denormal results, which costs a compare and two predicated multiplies per call on sm_90
    (the strip kernel's sm_90a SASS: 1120 -> 1032 instructions, MUFU count unchanged). GPU only (inline PTX)."""
    if FTZ:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


@triton.jit
def _strip_slice(a, p, qr, kr, k64, G64, Gr, GC, cl, ch, fr, R, rows64, orr, mr, d, base, QG, KD, GAM, c_, h, H,
                 scale, K: tl.constexpr, DT: tl.constexpr, FTZ: tl.constexpr = False, ROWS: tl.constexpr = 16):
    """One channel slice of a strip program (_fwd_strip4_kernel / _fwd_strip5_kernel / _fwd_strip32_kernel),
    given the slice's operands and cumulative gates: G64 [64, BK] of the chunk, Gr [ROWS, BK] of row block R,
    GC / cl / ch [BK] at the chunk's last row / before the block / the block's last row, fr = 1 when the block is
    dense (its gates are >= lb; always 1 for ROWS = 32).  Adds the slice's share to the strips a (Akk) and p (P)
    [ROWS, 64] and stores its QG, KD (and GAM for R = 0); returns (a, p, e^Gr). FTZ: the exponentials through
    _ex's flush-to-zero form (GPU only)."""
    if ROWS == 16:
        c = cl + 0.5 * (ch - cl) * fr.to(tl.float32)
        lim = R * 16 + 16 * fr
    else:
        c = cl + 0.5 * (ch - cl)
        lim = R * ROWS + ROWS
    er = _ex(Gr - c[None, :], FTZ)
    col = (k64 * _ex(tl.where(rows64[:, None] < lim, c[None, :] - G64, float("-inf")), FTZ)).to(DT)
    a += tl.dot((kr * er).to(DT), tl.trans(col))
    p += tl.dot((qr * er).to(DT), tl.trans(col))
    if ROWS == 16:
        if fr == 0:
            a = _add_cols(a, _diag_pair(kr, kr, Gr), R, 16, 4, 16)
            p = _add_cols(p, _diag_pair(qr, kr, Gr), R, 16, 4, 16)
    eG = _ex(Gr, FTZ)
    tl.store(QG + base + orr, (qr * eG * scale).to(QG.dtype.element_ty), mask=mr)
    tl.store(KD + base + orr, (kr * _ex(GC[None, :] - Gr, FTZ)).to(KD.dtype.element_ty), mask=mr)
    if R == 0:
        tl.store(GAM + (tl.cast(c_, tl.int64) * H + h) * K + d, tl.exp(GC))
    return a, p, eG


@triton.jit
def _strip_store(NB, AQK, beta, t0, L, h, H, rows, mr, a, p, scale, BM, SAVE_B: tl.constexpr):
    """A strip program's outputs: NB = diag(beta) Akk (strictly lower) and AQK = scale P (lower incl. the
    diagonal) for the 16 rows of its block; with SAVE_B also BM = Akk before beta (for the backward)."""
    bb = tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)
    cols = tl.arange(0, 64)
    ob = (t0.to(tl.int64) * H + h) * 64 + rows[:, None] * (H * 64) + cols[None, :]
    a = tl.where(cols[None, :] < rows[:, None], a, 0.0)
    tl.store(NB + ob, (a * bb[:, None]).to(NB.dtype.element_ty), mask=mr)
    if SAVE_B:
        tl.store(BM + ob, a, mask=mr)
    tl.store(AQK + ob, (tl.where(cols[None, :] <= rows[:, None], p, 0.0) * scale).to(AQK.dtype.element_ty),
             mask=mr)


@triton.jit
def _fwd_strip4_kernel(q, k, g, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, lb, H,
                       K: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr,
                       R_FAST: tl.constexpr = False):
    """One (chunk, head, row block R): NB[rows of R] = diag(beta) Akk (strictly lower, float32, 64 columns),
    AQK[rows of R] = scale P (lower incl. diagonal), QG = scale q e^G and KD = k e^(G_C - G) for the rows of R,
    GAM = e^(G_C) (R = 0 only).

    Per channel slice of BK: the chunk's k and g [64, BK] (L2-resident; four programs share them), G = the
    in-chunk cumulative gate.  The anchor c of row block R is the middle of its G range when FAST and the
    block's slice of g is >= lb (checked here): row operand x_i e^(G_i - c), column operand k_j e^(c - G_j),
    one dense [16, BK] x [BK, 64] dot covers every causal tile of the strip, the diagonal one included, all
    exponents within 8 |lb|.  Otherwise c = G before the block (exponents <= 0), the dot covers the earlier
    blocks and the diagonal tile is summed token pair by token pair (_diag_pair).
    Grid (NC, H, 4), or with R_FAST (4 * NC, H) (as _fwd_strip5_kernel's: the 4 programs that load the same
    [64, BK] k and g slices run next to each other, so 3 of them find them in L2)."""
    c_, R, h = _strip_program(R_FAST)
    t0, L, rows64, rows, base, m64, mr = _strip_rows(cstart, clen, c_, h, R, H, K)
    a = tl.zeros([16, 64], dtype=tl.float32)
    p = tl.zeros([16, 64], dtype=tl.float32)
    for ks in range(0, K, BK):
        d = ks + tl.arange(0, BK)
        o64 = rows64[:, None] * (H * K) + d[None, :]
        orr = rows[:, None] * (H * K) + d[None, :]
        g64 = tl.load(g + base + o64, mask=m64, other=0.0).to(tl.float32)
        k64 = tl.load(k + base + o64, mask=m64, other=0.0).to(tl.float32)
        gr = tl.load(g + base + orr, mask=mr, other=0.0).to(tl.float32)
        kr = tl.load(k + base + orr, mask=mr, other=0.0).to(tl.float32)
        qr = tl.load(q + base + orr, mask=mr, other=0.0).to(tl.float32)
        # one scan feeds every G below (row and column operands agree to the last bit: the exponents of
        # the diagonal entries are exactly 0 and no rounding mismatch enters the decay ratios)
        G64 = tl.cumsum(g64, axis=0)
        cl = tl.sum(tl.where(rows64[:, None] == R * 16 - 1, G64, 0.0), axis=0)
        Gr = _get_rows(G64, R, 4, 16, BK)
        ch = tl.sum(tl.where(rows64[:, None] == R * 16 + 15, G64, 0.0), axis=0)
        GC = tl.sum(tl.where(rows64[:, None] == 63, G64, 0.0), axis=0)
        if FAST:
            fr = (tl.min(tl.min(gr, axis=1), axis=0) >= lb).to(tl.int32)
        else:
            fr = tl.zeros([], dtype=tl.int32)
        a, p, _ = _strip_slice(a, p, qr, kr, k64, G64, Gr, GC, cl, ch, fr, R, rows64, orr, mr, d, base, QG, KD, GAM,
                               c_, h, H, scale, K, DT)
    _strip_store(NB, AQK, beta, t0, L, h, H, rows, mr, a, p, scale, NB, False)


@triton.jit
def _chunk_cumsum_kernel(g, cstart, clen, GCS, FB, lb, H, K: tl.constexpr, FAST: tl.constexpr,
                         ROWS32: tl.constexpr = False, NS: tl.constexpr = 1, HM: tl.constexpr = False):
    """One (chunk, head): GCS = the in-chunk cumulative gate G (float32 [N, H, K]; rows past the chunk's end
    not written) and FB[c, h, r] = 1 when every g of 16-row block r (all K channels) is >= lb (the dense
    diagonal tile is in range), else 0 (always 0 without FAST); ROWS32: plus 2 in both blocks of a 32-row pair
    when both have bit 0 and G falls by at most _SPAN32 (161) across the pair in every channel
    (_fwd_strip32_kernel's dense pair: exponents within +-80.5 about the pair's middle).
    NS: grid (NC, H, NS), each program one slice of K / NS channels; FB [NC, H, NS * 4] then holds each slice's
    flags at s * 4 + r (_fb ANDs them).  HM (head-major): grid (H * NS, NC) instead."""
    c_, h, sl = _chunk_head(HM, NS)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    rows = tl.arange(0, 64)
    if NS == 1:
        dk = tl.arange(0, K)
    else:
        dk = sl * (K // NS) + tl.arange(0, K // NS)
    off = (t0.to(tl.int64) * H + h) * K + rows[:, None] * (H * K) + dk[None, :]
    m = (rows < L)[:, None]
    gg = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    Gc = tl.cumsum(gg, axis=0)
    tl.store(GCS + off, Gc, mask=m)
    r4 = tl.arange(0, 4)
    if FAST:
        low = tl.min(tl.reshape(gg, [4, 16 * (K // NS)]), axis=1)       # padded rows read 0 >= lb
        fb = (low >= lb).to(tl.int32)
        if ROWS32:
            # bit 1 in both blocks of a 32-row pair: both blocks within lb and G falls by at most _SPAN32 over the
            # pair in every channel (padded rows add 0, so row 63 holds G at the chunk's end)
            G31 = tl.sum(tl.where(rows[:, None] == 31, Gc, 0.0), axis=0)
            G63 = tl.sum(tl.where(rows[:, None] == 63, Gc, 0.0), axis=0)
            fall0 = tl.min(G31, axis=0)
            fall1 = tl.min(G63 - G31, axis=0)
            okp = (tl.where(tl.arange(0, 2) == 0, fall0, fall1) >= -_SPAN32).to(tl.int32)
            okp = okp & tl.min(tl.reshape(fb, [2, 2]), axis=1)
            fb += 2 * tl.reshape(tl.broadcast_to(okp[:, None], [2, 2]), [4])
    else:
        fb = tl.zeros([4], dtype=tl.int32)
    tl.store(FB + (tl.cast(c_, tl.int64) * H + h) * (4 * NS) + sl * 4 + r4, fb)


@triton.jit
def _fb(FB, c_, h, H, r, NS: tl.constexpr):
    """The flags of 16-row block r of chunk c_, head h from _chunk_cumsum_kernel's FB [NC, H, NS * 4]: the AND
    over its NS channel slices."""
    ptr = FB + (tl.cast(c_, tl.int64) * H + h) * (4 * NS) + r
    f = tl.load(ptr)
    for s in tl.static_range(1, NS):
        f = f & tl.load(ptr + 4 * s)
    return f


@triton.jit
def _strip_block(q, k, GCS, fr, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, H, K: tl.constexpr,
                 BK: tl.constexpr, DT: tl.constexpr, BM, SAVE_B: tl.constexpr, KGB, WRITE_KGB: tl.constexpr,
                 LIM_ROWS: tl.constexpr, FTZ: tl.constexpr, ROWS: tl.constexpr = 16):
    """The strip kernels' work for row block R (ROWS = 16 or 32 rows) of chunk c_ and head h.  ROWS = 16: fr = 1
    when the block's gates are >= lb (the dense diagonal tile), 0 for the safe path.  ROWS = 32 (fr = 1): a
    dense pair, when G falls by at most _SPAN32 across it in every channel (FB bit 1): the anchor c is the middle
    of the pair's G range, so |G_i - c| <= 80.5 on its rows (e^80.5 ~ 9e34, within float32 / bf16 range), and
    every causal tile of the strip, the two diagonal 16x16 tiles and the one between them included, is one dense
    [32, BK] x [BK, 64] dot."""
    t0, L, rows64, rows, base, m64, mr = _strip_rows(cstart, clen, c_, h, R, H, K, ROWS)
    if LIM_ROWS:
        m64 = m64 & (rows64 < R * ROWS + ROWS)[:, None]
    if WRITE_KGB:
        bkg = tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)
    # rows past the chunk's end have G = G of its last row (as a scan of zero-padded gates gives)
    last = L - 1
    row_lo = tl.minimum(R * ROWS - 1, last)
    row_hi = tl.minimum(R * ROWS + ROWS - 1, last)
    a = tl.zeros([ROWS, 64], dtype=tl.float32)
    p = tl.zeros([ROWS, 64], dtype=tl.float32)
    for ks in range(0, K, BK):
        d = ks + tl.arange(0, BK)
        o64 = rows64[:, None] * (H * K) + d[None, :]
        orr = rows[:, None] * (H * K) + d[None, :]
        G64 = tl.load(GCS + base + o64, mask=m64, other=0.0)
        k64 = tl.load(k + base + o64, mask=m64, other=0.0).to(tl.float32)
        kr = tl.load(k + base + orr, mask=mr, other=0.0).to(tl.float32)
        qr = tl.load(q + base + orr, mask=mr, other=0.0).to(tl.float32)
        # `!= 0` keeps a mask with a scalar term bool under the triton 3.9 interpreter (its loads and stores take
        # only bool masks, and it broadcasts a scalar comparison as int32); the compiler folds it away
        cl = tl.load(GCS + base + row_lo * (H * K) + d, mask=((R > 0) & (d < K)) != 0, other=0.0)
        ch = tl.load(GCS + base + row_hi * (H * K) + d)
        GC = tl.load(GCS + base + last * (H * K) + d)
        Gr = tl.load(GCS + base + orr, mask=mr, other=0.0)
        Gr = tl.where(mr, Gr, ch[None, :])
        a, p, eG = _strip_slice(a, p, qr, kr, k64, G64, Gr, GC, cl, ch, fr, R, rows64, orr, mr, d, base, QG, KD,
                                GAM, c_, h, H, scale, K, DT, FTZ, ROWS)
        if WRITE_KGB:
            tl.store(KGB + base + orr, (kr * eG * bkg[:, None]).to(KGB.dtype.element_ty), mask=mr)
    if ROWS == 16:
        ok = 1
    else:
        # the 32-row tile scales q and k by up to e^80.5: entries of |q| or |k| beyond ~3e3 overflow it to inf /
        # NaN in the causal entries (never to a wrong finite value); then nothing is stored and the caller redoes
        # the pair as two 16-row blocks (e^40.5 at most)
        cols = tl.arange(0, 64)
        fin = (tl.abs(a) < float("inf")) & (tl.abs(p) < float("inf"))
        fin = tl.where(cols[None, :] <= rows[:, None], fin, True)
        ok = tl.min(tl.min(fin.to(tl.int32), axis=1), axis=0)
    if ok != 0:
        _strip_store(NB, AQK, beta, t0, L, h, H, rows, mr, a, p, scale, BM, SAVE_B)
    return ok


@triton.jit
def _fwd_strip5_kernel(q, k, GCS, FB, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, H,
                       K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, R_FAST: tl.constexpr = False,
                       BM=None, SAVE_B: tl.constexpr = False, KGB=None, WRITE_KGB: tl.constexpr = False,
                       LIM_ROWS: tl.constexpr = False, FTZ: tl.constexpr = False, NS: tl.constexpr = 1):
    """_fwd_strip4_kernel's outputs from the precomputed in-chunk cumulative gate (GCS, FB of
    _chunk_cumsum_kernel): no scan and no row extraction in the kernel, only loads.  The anchor c of row
    block R: the middle of its G range when FB says the block's gates are >= lb (then one dense
    [16, BK] x [BK, 64] dot covers every causal tile, the diagonal one included), else G before the block
    (exponents <= 0; the diagonal tile token pair by token pair).
    Grid (NC, H, 4), or with R_FAST (4 * NC, H): the 4 row blocks of a chunk as consecutive programs, so
    that the [64, K] column operands (k, G) the 4 programs each load are still in L2 for 3 of them.
    WRITE_KGB: also store KGB = diag(beta) (k e^G) (input dtype) for the block's rows, the w/u kernel's
    operand (it then loads neither k nor G).  LIM_ROWS: load only the column-operand rows that row block R
    uses (rows < 16 R + 16; the others are masked to 0 in the dot anyway), 160 of the 256 row loads of a
    chunk's 4 programs.  FTZ: the dense path's exponentials as ex2.approx.ftz (see _ex; GPU only).  NS: the
    cumsum kernel's channel slices (FB [NC, H, NS * 4], ANDed by _fb)."""
    c_, R, h = _strip_program(R_FAST)
    fr = _fb(FB, c_, h, H, R, NS) & 1
    _strip_block(q, k, GCS, fr, beta, cstart, clen, c_, R, h, NB, QG, KD, AQK, GAM, scale, H, K, BK, DT, BM, SAVE_B,
                 KGB, WRITE_KGB, LIM_ROWS, FTZ)


@triton.jit
def _fwd_strip32_kernel(q, k, GCS, FB, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, H,
                        K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, BM=None, SAVE_B: tl.constexpr = False,
                        KGB=None, WRITE_KGB: tl.constexpr = False, LIM_ROWS: tl.constexpr = False,
                        FTZ: tl.constexpr = False, NS: tl.constexpr = 1, HM: tl.constexpr = False):
    """_fwd_strip5_kernel's outputs with one program per (chunk, head, 32-row pair RR): grid (2 NC, H) (HM,
    head-major: (2 H, NC)), the two
    pairs of a chunk as consecutive programs.  When FB bit 1 says both blocks keep the bound and G falls by at
    most _SPAN32 across the pair, it is one dense 32-row strip (_strip_block with ROWS = 32: the [64, BK] column
    operand k_j e^(c - G_j) and its exponentials are formed twice per chunk instead of four times); otherwise, and
    when that strip overflows (|q| or |k| entries beyond ~3e3), its two 16-row blocks run as in
    _fwd_strip5_kernel, one after the other, each dense or safe by its own FB bit 0."""
    if HM:
        c_ = tl.program_id(1)
        h = tl.program_id(0) // 2
    else:
        c_ = tl.program_id(0) // 2
        h = tl.program_id(1)
    RR = tl.program_id(0) % 2
    f0 = _fb(FB, c_, h, H, 2 * RR, NS)
    ok = tl.zeros([], dtype=tl.int32)
    if (f0 & 2) != 0:
        ok = _strip_block(q, k, GCS, 1, beta, cstart, clen, c_, RR, h, NB, QG, KD, AQK, GAM, scale, H, K, BK,
                          DT, BM, SAVE_B, KGB, WRITE_KGB, LIM_ROWS, FTZ, 32)
    # (also keeps the 16-row blocks' work below from being scheduled into the dense pair's: 177 registers
    # without it, 127 with it, ptxas sm_90a)
    tl.debug_barrier()
    if ok == 0:
        # (a dense pair that overflowed stored the same QG, KD, KGB and GAM as the 16-row blocks store again)
        _strip_block(q, k, GCS, f0 & 1, beta, cstart, clen, c_, 2 * RR, h, NB, QG, KD, AQK, GAM, scale, H, K, BK,
                     DT, BM, SAVE_B, KGB, WRITE_KGB, LIM_ROWS, FTZ)
        f1 = _fb(FB, c_, h, H, 2 * RR + 1, NS) & 1
        _strip_block(q, k, GCS, f1, beta, cstart, clen, c_, 2 * RR + 1, h, NB, QG, KD, AQK, GAM, scale, H, K,
                     BK, DT, BM, SAVE_B, KGB, WRITE_KGB, LIM_ROWS, FTZ)


@triton.jit
def _fwd_tiles4_kernel(q, k, g, beta, cstart, clen, NB, QG, KD, AQK, GAM, scale, lb, H,
                       K: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    """Same outputs as _fwd_strip4_kernel (one (chunk, head, row block R)), with only [16, BK] operand tiles
    and [16, 16] accumulators (the diagonal tile and the column blocks 0..2 before it), to keep registers
    low (ptxas, sm_90, BK 16, 1 warp: no [64, BK] tiles in registers).  Per channel slice: the gate prefix
    before R (block sums), the anchor c as in _fwd_strip4_kernel, then per column block j < R one
    [16, BK] x [BK, 16] dot with the column operand k_j e^(c - G_j) (exponents <= 0) and the diagonal tile
    dense (bound holds) or token pair by token pair (_diag_pair)."""
    c_ = tl.program_id(0)
    h = tl.program_id(1)
    R = tl.program_id(2)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    r16 = tl.arange(0, 16)
    rows = R * 16 + r16
    base = (t0.to(tl.int64) * H + h) * K                 # 64-bit scalar base, 32-bit offsets in the chunk
    mr = (rows < L)[:, None]
    aD = tl.zeros([16, 16], dtype=tl.float32)
    pD = tl.zeros([16, 16], dtype=tl.float32)
    a0 = tl.zeros([16, 16], dtype=tl.float32)
    a1 = tl.zeros([16, 16], dtype=tl.float32)
    a2 = tl.zeros([16, 16], dtype=tl.float32)
    p0 = tl.zeros([16, 16], dtype=tl.float32)
    p1 = tl.zeros([16, 16], dtype=tl.float32)
    p2 = tl.zeros([16, 16], dtype=tl.float32)
    for ks in range(0, K, BK):
        d = ks + tl.arange(0, BK)
        orr = rows[:, None] * (H * K) + d[None, :]
        cl = tl.zeros([BK], dtype=tl.float32)
        for j in tl.static_range(3):
            if j < R:
                rj = j * 16 + r16
                oj = rj[:, None] * (H * K) + d[None, :]
                cl += tl.sum(tl.load(g + base + oj, mask=(rj < L)[:, None], other=0.0).to(tl.float32), axis=0)
        gr = tl.load(g + base + orr, mask=mr, other=0.0).to(tl.float32)
        kr = tl.load(k + base + orr, mask=mr, other=0.0).to(tl.float32)
        qr = tl.load(q + base + orr, mask=mr, other=0.0).to(tl.float32)
        Gr = cl[None, :] + tl.cumsum(gr, axis=0)
        ch = cl + tl.sum(gr, axis=0)
        if FAST:
            fr = (tl.min(tl.min(gr, axis=1), axis=0) >= lb).to(tl.int32)
        else:
            fr = tl.zeros([], dtype=tl.int32)
        c = cl + 0.5 * (ch - cl) * fr.to(tl.float32)
        er = tl.exp(Gr - c[None, :])
        X = (kr * er).to(DT)
        Q = (qr * er).to(DT)
        if fr != 0:
            colR = (kr * tl.exp(c[None, :] - Gr)).to(DT)
            aD += tl.dot(X, tl.trans(colR))
            pD += tl.dot(Q, tl.trans(colR))
        else:
            aD += _diag_pair(kr, kr, Gr)
            pD += _diag_pair(qr, kr, Gr)
        pre = tl.zeros([BK], dtype=tl.float32)
        for j in tl.static_range(3):
            if j < R:
                rj = j * 16 + r16
                oj = rj[:, None] * (H * K) + d[None, :]
                gj = tl.load(g + base + oj, mask=(rj < L)[:, None], other=0.0).to(tl.float32)
                kj = tl.load(k + base + oj, mask=(rj < L)[:, None], other=0.0).to(tl.float32)
                col = (kj * tl.exp(c[None, :] - pre[None, :] - tl.cumsum(gj, axis=0))).to(DT)
                pre += tl.sum(gj, axis=0)
                if j == 0:
                    a0 += tl.dot(X, tl.trans(col))
                    p0 += tl.dot(Q, tl.trans(col))
                elif j == 1:
                    a1 += tl.dot(X, tl.trans(col))
                    p1 += tl.dot(Q, tl.trans(col))
                else:
                    a2 += tl.dot(X, tl.trans(col))
                    p2 += tl.dot(Q, tl.trans(col))
        tl.store(QG + base + orr, (qr * tl.exp(Gr) * scale).to(QG.dtype.element_ty), mask=mr)
        # G at the chunk end: the rest of the chunk's gate after block R
        GC = ch
        for j in tl.static_range(1, 4):
            if j > R:
                rj = j * 16 + r16
                oj = rj[:, None] * (H * K) + d[None, :]
                GC += tl.sum(tl.load(g + base + oj, mask=(rj < L)[:, None], other=0.0).to(tl.float32), axis=0)
        tl.store(KD + base + orr, (kr * tl.exp(GC[None, :] - Gr)).to(KD.dtype.element_ty), mask=mr)
        if R == 0:
            tl.store(GAM + (tl.cast(c_, tl.int64) * H + h) * K + d, tl.exp(GC))
    bb = tl.load(beta + (t0.to(tl.int64) * H + h) + rows * H, mask=rows < L, other=0.0).to(tl.float32)
    ob = (t0.to(tl.int64) * H + h) * 64 + rows[:, None] * (H * 64) + r16[None, :]
    ty = AQK.dtype.element_ty
    tl.store(NB + ob + R * 16, tl.where(r16[None, :] < r16[:, None], aD, 0.0) * bb[:, None], mask=mr)
    tl.store(AQK + ob + R * 16, (tl.where(r16[None, :] <= r16[:, None], pD, 0.0) * scale).to(ty), mask=mr)
    if R > 0:
        tl.store(NB + ob, a0 * bb[:, None], mask=mr)
        tl.store(AQK + ob, (p0 * scale).to(ty), mask=mr)
    if R > 1:
        tl.store(NB + ob + 16, a1 * bb[:, None], mask=mr)
        tl.store(AQK + ob + 16, (p1 * scale).to(ty), mask=mr)
    if R > 2:
        tl.store(NB + ob + 32, a2 * bb[:, None], mask=mr)
        tl.store(AQK + ob + 32, (p2 * scale).to(ty), mask=mr)
    zero = tl.zeros([16, 16], dtype=ty)
    for j in tl.static_range(1, 4):
        if j > R:
            tl.store(AQK + ob + j * 16, zero, mask=mr)


@triton.jit
def _tile16(ptr, t0, L, h, H, R: tl.constexpr, C: tl.constexpr):
    """The 16x16 tile (row block R, column block C) of one chunk of a [N, H, 64] float32 tensor."""
    r16 = tl.arange(0, 16)
    rows = R * 16 + r16
    off = (t0.to(tl.int64) * H + h) * 64 + rows[:, None] * (H * 64) + C * 16 + r16[None, :]
    return tl.load(ptr + off, mask=(rows < L)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _fwd_solve4_kernel(NB, cstart, clen, TB, H, PREC: tl.constexpr = "ieee", HM: tl.constexpr = False):
    """One (chunk, head): TB = T = (I + N)^-1 (float32, the 10 lower 16x16 tiles) from N = NB (float32 or
    bfloat16, computed in float32), by inverting
    the diagonal tiles (_inv16) and blocked forward substitution T_rj = -T_rr sum_{j<=m<r} N_rm T_mj.
    PREC: the 16x16 products' tl.dot input precision ("ieee": float32 FMAs; "tf32x3": three TF32 tensor-core
    products, about float32 accuracy; "tf32": one, inputs rounded to 10 mantissa bits)."""
    c_, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c_)
    L = tl.load(clen + c_)
    T00 = _inv16p(_tile16(NB, t0, L, h, H, 0, 0), PREC)
    T11 = _inv16p(_tile16(NB, t0, L, h, H, 1, 1), PREC)
    N10 = _tile16(NB, t0, L, h, H, 1, 0)
    T10 = -_mmp(T11, _mmp(N10, T00, PREC), PREC)
    _put(TB, T00, t0, L, h, H, 0, 64, 0)
    _put(TB, T10, t0, L, h, H, 1, 64, 0)
    _put(TB, T11, t0, L, h, H, 1, 64, 16)
    T22 = _inv16p(_tile16(NB, t0, L, h, H, 2, 2), PREC)
    N21 = _tile16(NB, t0, L, h, H, 2, 1)
    N20 = _tile16(NB, t0, L, h, H, 2, 0)
    T21 = -_mmp(T22, _mmp(N21, T11, PREC), PREC)
    T20 = -_mmp(T22, _mmp(N20, T00, PREC) + _mmp(N21, T10, PREC), PREC)
    _put(TB, T20, t0, L, h, H, 2, 64, 0)
    _put(TB, T21, t0, L, h, H, 2, 64, 16)
    _put(TB, T22, t0, L, h, H, 2, 64, 32)
    T33 = _inv16p(_tile16(NB, t0, L, h, H, 3, 3), PREC)
    N32 = _tile16(NB, t0, L, h, H, 3, 2)
    N31 = _tile16(NB, t0, L, h, H, 3, 1)
    N30 = _tile16(NB, t0, L, h, H, 3, 0)
    T32 = -_mmp(T33, _mmp(N32, T22, PREC), PREC)
    T31 = -_mmp(T33, _mmp(N31, T11, PREC) + _mmp(N32, T21, PREC), PREC)
    T30 = -_mmp(T33, _mmp(N30, T00, PREC) + _mmp(N31, T10, PREC) + _mmp(N32, T20, PREC), PREC)
    _put(TB, T30, t0, L, h, H, 3, 64, 0)
    _put(TB, T31, t0, L, h, H, 3, 64, 16)
    _put(TB, T32, t0, L, h, H, 3, 64, 32)
    _put(TB, T33, t0, L, h, H, 3, 64, 48)


@triton.jit
def _seg_range(seg_t0, seg_t1, seg_c0, seg_c1, s):
    """Segment s of the long-context split: (first token, end token) as int64 and (first chunk, end chunk)."""
    return (tl.load(seg_t0 + s).to(tl.int64), tl.load(seg_t1 + s).to(tl.int64), tl.load(seg_c0 + s),
            tl.load(seg_c1 + s))


@triton.jit
def _fwd_h_kernel(WK, U, KD, GAM, VN, HB, S_IN, S_OUT, seg_t0, seg_t1, seg_c0, seg_c1, H,
                  K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, SW: tl.constexpr,
                  MODE: tl.constexpr, STORE: tl.constexpr, STORE_VN: tl.constexpr, QG=None, AQK=None, O=None,
                  FUSE_O: tl.constexpr = False, MERGE_WQ: tl.constexpr = False):
    """The serial state chain of one segment, one head and BV state columns; nothing else on it.

    Per chunk c (tokens t0 .. t0+63 of the segment, rows past the segment end read as 0):
        HB[c] = S (the chunk-entry state, intermediate dtype)      [STORE]
        W = U - Wk S;  VN[rows] = W                                [STORE_VN]
        S <- diag(e^(G_C)) S + (k e^(G_C - G))^T W.
    FUSE_O (MODE 0): also the chunk's output columns, O[rows] = QG S + AQK W (the operands rounded as
    _fwd_o_kernel's from HB and VN), so that neither HB nor VN needs to be stored.
    MERGE_WQ (with FUSE_O): Wk S and QG S as one [128, K] x [K, BV] product, its operand's rows 0-63 from WK and
    64-127 from QG (the base pointer chosen per row): Triton waits for every wgmma group right after issuing it,
    so each product is a step of the chain's latency, and the merged one costs one wait where the two cost two.
    MODE 0: S [K, BV] starts from S_IN (width V), columns vb*BV..; MODE 1: the augmented transition
    [M | D] (width SW = K+V): columns < K start as the identity and see no U, columns >= K start at 0 and
    see U.  S_OUT gets the state after the segment.  The token addresses are affine in the loop counter
    (t0 = segment start + 64 j), so the loads of chunk j+1 are issued while chunk j computes."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ts, te, c0, c1 = _seg_range(seg_t0, seg_t1, seg_c0, seg_c1, s)
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    if MODE == 0:
        S = tl.load(S_IN + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
        ucol = cols
        umask = cols < V
    else:
        S = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)
        ucol = cols - K
        umask = cols >= K
    # scalar bases advanced per chunk + loop-invariant int32 tile offsets (no 64-bit pointer tiles carried)
    ok = rows[:, None] * (H * K) + dk[None, :]
    ou = rows[:, None] * (H * V) + ucol[None, :]
    oh = dk[:, None] * V + cols[None, :]
    bk = WK + (ts * H + h) * K
    bd = KD + (ts * H + h) * K
    bu = U + (ts * H + h) * V
    bn = VN + (ts * H + h) * V
    bg = GAM + (tl.cast(c0, tl.int64) * H + h) * K
    bh = HB + (tl.cast(c0, tl.int64) * H + h) * K * V
    nch = c1 - c0
    if FUSE_O:
        bq = QG + (ts * H + h) * K
        ba = AQK + (ts * H + h) * 64
        bo = O + (ts * H + h) * V
        oa = rows[:, None] * (H * 64) + rows[None, :]
    if MERGE_WQ:
        r2 = tl.arange(0, 128)
        okq = (r2 % 64)[:, None] * (H * K) + dk[None, :]
        upper = (r2 >= 64)[:, None]
    # `!= 0`: a bool mask under the triton 3.9 interpreter (see _strip_block)
    gam = tl.load(bg + dk, mask=((dk < K) & (nch > 0)) != 0, other=1.0)
    for j in range(0, nch):
        # the next chunk's decay is fetched a whole step ahead (the tiles are pipelined by the compiler)
        gnext = tl.load(bg + H * K + dk, mask=((dk < K) & (j + 1 < nch)) != 0, other=1.0)
        rm = (ts + j * 64 + rows) < te
        if STORE:
            tl.store(bh + oh, S.to(HB.dtype.element_ty))
        if MERGE_WQ:
            rmq = (ts + j * 64 + r2 % 64) < te
            wk = tl.load(tl.where(upper, bq, bk) + okq, mask=rmq[:, None], other=0.0)    # [Wk; QG] [128, K]
        else:
            wk = tl.load(bk + ok, mask=rm[:, None], other=0.0)
        uu = tl.load(bu + ou, mask=rm[:, None] & umask[None, :], other=0.0).to(tl.float32)
        Sb = S.to(wk.dtype)
        if MERGE_WQ:
            xs = tl.dot(wk, Sb)                                    # [Wk; QG] S, [128, BV]
            ws, qs = tl.split(tl.permute(tl.reshape(xs, [2, 64, BV]), (1, 2, 0)))
            W = uu - ws
        else:
            W = uu - tl.dot(wk, Sb)
        if STORE_VN:
            tl.store(bn + ou, W.to(VN.dtype.element_ty), mask=rm[:, None])
        kd = tl.load(bd + ok, mask=rm[:, None], other=0.0)
        Wb = W.to(kd.dtype)
        if FUSE_O:
            A = tl.load(ba + oa, mask=rm[:, None], other=0.0)
            if MERGE_WQ:
                oo = qs + tl.dot(A, Wb.to(A.dtype))
            else:
                qg = tl.load(bq + ok, mask=rm[:, None], other=0.0)
                oo = tl.dot(qg, Sb.to(qg.dtype)) + tl.dot(A, Wb.to(A.dtype))
            tl.store(bo + ou, oo.to(O.dtype.element_ty), mask=rm[:, None])
            bq += 64 * H * K
            ba += 64 * H * 64
            bo += 64 * H * V
        S = S * gam[:, None] + tl.dot(tl.trans(kd), Wb)
        gam = gnext
        bk += 64 * H * K
        bd += 64 * H * K
        bu += 64 * H * V
        bn += 64 * H * V
        bg += H * K
        bh += H * K * V
    tl.store(S_OUT + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * SW + cols[None, :], S)


@triton.jit
def _fwd_o_kernel(QG, AQK, VN, HB, O, cstart, clen, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                  HM: tl.constexpr = False):
    """All chunks at once: O = (scale q e^G) HB[c] + (scale P) VN for one (chunk, head, BV columns); grid
    (NC, H, V / BV), or head-major (HM) (H, NC, V / BV)."""
    c, h, _ = _chunk_head(HM)
    vb = tl.program_id(2)
    t0 = tl.load(cstart + c).to(tl.int64)
    L = tl.load(clen + c)
    rows = tl.arange(0, 64)
    rm = rows < L
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    tok = (t0 + rows)[:, None]
    qg = tl.load(QG + tok * (H * K) + h * K + dk[None, :], mask=rm[:, None], other=0.0)
    hb = tl.load(HB + ((tl.cast(c, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
    A = tl.load(AQK + tok * (H * 64) + h * 64 + rows[None, :], mask=rm[:, None], other=0.0)
    vn = tl.load(VN + tok * (H * V) + h * V + cols[None, :], mask=rm[:, None], other=0.0)
    o = tl.dot(qg, hb.to(qg.dtype)) + tl.dot(A, vn.to(A.dtype))
    tl.store(O + tok * (H * V) + h * V + cols[None, :], o.to(O.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _combine_kernel(MD, S_INIT, S_ENTRY, S_FIN, seq_s0, seq_s1, H, K: tl.constexpr, V: tl.constexpr,
                    BV: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr, PREC: tl.constexpr):
    """Chain the segment maps S <- M S + D (MD [NSEG,H,K,K+V]); store each segment's entry state.

    PREC: "tf32x3" on the GPU (three tensor-core tf32 products, about float32 accuracy; the float32 "ieee"
    FMA dot of a 128x128 M does not fit the registers: ptxas spilled ~14 KB per thread and one step took
    ~0.4 ms), "ieee" under the interpreter."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    s0 = tl.load(seq_s0 + n)
    s1 = tl.load(seq_s1 + n)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    if HAS_INIT:
        S = tl.load(S_INIT + ((tl.cast(n, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(0, s1 - s0):
        if REVERSE:
            i = s1 - 1 - j
        else:
            i = s0 + j
        tl.store(S_ENTRY + ((tl.cast(i, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :], S)
        base = MD + (tl.cast(i, tl.int64) * H + h) * K * (K + V)
        M = tl.load(base + dk[:, None] * (K + V) + dk[None, :])
        D = tl.load(base + dk[:, None] * (K + V) + K + cols[None, :])
        S = tl.dot(M, S, input_precision=PREC) + D
    tl.store(S_FIN + ((tl.cast(n, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :], S)


@triton.jit
def _bwd_state_kernel(WK, U, QG, KD, AQK, GAM, DO, HBUF, DS_END, DS_OUT, DU, DWK, DQG, DKD, DAQK, DGAM,
                      cstart, clen, seg_c0, seg_c1, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      SW: tl.constexpr, MODE: tl.constexpr):
    """Reverse state-gradient pass.  MODE 0: from DS_END (full V), per-chunk gradients; MODE 1: the
    augmented transition of dS over the segment ([N | E], width K+V, starting from [I | 0])."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    c0 = tl.load(seg_c0 + s)
    c1 = tl.load(seg_c1 + s)
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    if MODE == 0:
        X = tl.load(DS_END + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
        ocol = cols
        omask = cols < V
    else:
        X = tl.where(dk[:, None] == cols[None, :], 1.0, 0.0)
        ocol = cols - K
        omask = cols >= K
    for j in range(0, c1 - c0):
        c = c1 - 1 - j
        t0 = tl.load(cstart + c)
        L = tl.load(clen + c)
        rm = rows < L
        offk = (t0 + rows).to(tl.int64)[:, None] * (H * K) + h * K + dk[None, :]
        offo = (t0 + rows).to(tl.int64)[:, None] * (H * V) + h * V + ocol[None, :]
        offa = (t0 + rows).to(tl.int64)[:, None] * (H * 64) + h * 64 + rows[None, :]
        wk = tl.load(WK + offk, mask=rm[:, None], other=0.0)
        kd = tl.load(KD + offk, mask=rm[:, None], other=0.0)
        qg = tl.load(QG + offk, mask=rm[:, None], other=0.0)
        A = tl.load(AQK + offa, mask=rm[:, None], other=0.0)
        gam = tl.load(GAM + (tl.cast(c, tl.int64) * H + h) * K + dk)
        do = tl.load(DO + offo, mask=rm[:, None] & omask[None, :], other=0.0).to(wk.dtype)
        Xd = X.to(wk.dtype)
        dW = tl.dot(tl.trans(A), do) + tl.dot(kd, Xd)
        if MODE == 0:
            S0 = tl.load(HBUF + ((tl.cast(c, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
            uu = tl.load(U + offo, mask=rm[:, None], other=0.0).to(tl.float32)
            W = uu - tl.dot(wk, S0.to(wk.dtype))
            dA = tl.dot(do, tl.trans(W.to(wk.dtype)))
            dA = tl.where(rows[None, :] <= rows[:, None], dA, 0.0)
            tl.store(DAQK + offa, dA.to(DAQK.dtype.element_ty), mask=rm[:, None])
            S0d = S0.to(wk.dtype)
            dqg = tl.dot(do, tl.trans(S0d))
            dkd = tl.dot(W.to(wk.dtype), tl.trans(Xd))
            dwk = -tl.dot(dW.to(wk.dtype), tl.trans(S0d))
            dgam = tl.sum(S0.to(tl.float32) * X, axis=1)
            tl.store(DU + offo, dW.to(DU.dtype.element_ty), mask=rm[:, None])
            tl.store(DQG + offk, dqg.to(DQG.dtype.element_ty), mask=rm[:, None])
            tl.store(DKD + offk, dkd.to(DKD.dtype.element_ty), mask=rm[:, None])
            tl.store(DWK + offk, dwk.to(DWK.dtype.element_ty), mask=rm[:, None])
            tl.store(DGAM + (tl.cast(c, tl.int64) * H + h) * K + dk, dgam)
        X = X * gam[:, None] + tl.dot(tl.trans(qg), do) - tl.dot(tl.trans(wk), dW.to(wk.dtype))
    tl.store(DS_OUT + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * SW + cols[None, :], X)


@triton.jit
def _bwd_dh_kernel(QG, WK, KD, AQK, GAM, DO, HB, DS_END, DHB, DU, DGP, DS_OUT, seg_t0, seg_t1, seg_c0, seg_c1, H,
                   K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """The serial part of the backward (BWD_IMPL "v2"): the reverse chain of the state gradient dS of one
    segment, one head and BV columns of V, and only what needs dS on the way.

    Per chunk c, walked from the segment end (X = dS after the chunk, float32 [K, BV]):
        DHB[c] = X (intermediate dtype; the per-chunk gradients of _bwd_chunk_kernel read it)
        DGP[c, vb] = sum_v HB[c] * X          (the decay gradient, partial over this program's columns)
        dW = A^T dO + KD X;  DU[rows] = dW    (the gradient of the new values W = U - Wk S)
        X <- diag(gam) X + QG^T dO - Wk^T dW.
    Columns are independent here (every product keeps V's columns apart), so V / BV programs per head and
    segment run side by side; the products that sum over V (dA, dQG, dKD, dWk) are left to the parallel
    per-chunk kernel. Token addresses are affine in the chunk counter within a segment (as _fwd_h_kernel);
    rows past the segment end read as 0. DS_OUT gets dS at the segment start."""
    vb = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ts, te, c0, c1 = _seg_range(seg_t0, seg_t1, seg_c0, seg_c1, s)
    rows = tl.arange(0, 64)
    dk = tl.arange(0, K)
    cols = vb * BV + tl.arange(0, BV)
    NVB: tl.constexpr = V // BV
    X = tl.load(DS_END + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :])
    ok = rows[:, None] * (H * K) + dk[None, :]
    oo = rows[:, None] * (H * V) + cols[None, :]
    oa = rows[:, None] * (H * 64) + rows[None, :]
    oh = dk[:, None] * V + cols[None, :]
    nch = c1 - c0
    for jj in range(0, nch):
        j = nch - 1 - jj
        c = tl.cast(c0 + j, tl.int64)
        tb = ts + j * 64
        rm = (tb + rows) < te
        gam = tl.load(GAM + (c * H + h) * K + dk)
        A = tl.load(AQK + (tb * H + h) * 64 + oa, mask=rm[:, None], other=0.0)
        do = tl.load(DO + (tb * H + h) * V + oo, mask=rm[:, None], other=0.0)
        kd = tl.load(KD + (tb * H + h) * K + ok, mask=rm[:, None], other=0.0)
        S0 = tl.load(HB + (c * H + h) * K * V + oh).to(tl.float32)
        Xd = X.to(kd.dtype)
        tl.store(DHB + (c * H + h) * K * V + oh, X.to(DHB.dtype.element_ty))
        tl.store(DGP + ((c * H + h) * NVB + vb) * K + dk, tl.sum(S0 * X, axis=1))
        dW = tl.dot(tl.trans(A), do.to(A.dtype)) + tl.dot(kd, Xd)
        tl.store(DU + (tb * H + h) * V + oo, dW.to(DU.dtype.element_ty), mask=rm[:, None])
        qg = tl.load(QG + (tb * H + h) * K + ok, mask=rm[:, None], other=0.0)
        wk = tl.load(WK + (tb * H + h) * K + ok, mask=rm[:, None], other=0.0)
        X = X * gam[:, None] + tl.dot(tl.trans(qg), do.to(qg.dtype)) - tl.dot(tl.trans(wk), dW.to(wk.dtype))
    tl.store(DS_OUT + ((tl.cast(s, tl.int64) * H + h) * K + dk[:, None]) * V + cols[None, :], X)


@triton.jit
def _bwd_chunk_kernel(WK, U, QG, AQK, DO, HB, DHB, DU, DWK, DQG, DKD, DAQK, cstart, clen, H,
                      K: tl.constexpr, V: tl.constexpr, BVC: tl.constexpr, HM: tl.constexpr = False):
    """The per-chunk gradients that sum over V (BWD_IMPL "v2"), every (chunk, head) at once, from the
    chunk-entry state S0 = HB[c] and the chunk-exit state gradient X = DHB[c] of _bwd_dh_kernel:
        W = U - Wk S0;  dA = tril(dO W^T);  dQG = dO S0^T;  dKD = W X^T;  dWk = -dW S0^T,
    each a sum over V, taken in column blocks of BVC (= V up to K*V = 128*128; the [K, V] operands of larger
    heads would not fit the shared memory at once)."""
    c, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c).to(tl.int64)
    L = tl.load(clen + c)
    rows = tl.arange(0, 64)
    rm = rows < L
    dk = tl.arange(0, K)
    offk = (t0 + rows)[:, None] * (H * K) + h * K + dk[None, :]
    offa = (t0 + rows)[:, None] * (H * 64) + h * 64 + rows[None, :]
    wk = tl.load(WK + offk, mask=rm[:, None], other=0.0)
    dA = tl.zeros([64, 64], dtype=tl.float32)
    dqg = tl.zeros([64, K], dtype=tl.float32)
    dkd = tl.zeros([64, K], dtype=tl.float32)
    dwk = tl.zeros([64, K], dtype=tl.float32)
    for vs in tl.static_range(0, V, BVC):
        dv = vs + tl.arange(0, BVC)
        offo = (t0 + rows)[:, None] * (H * V) + h * V + dv[None, :]
        oh = ((tl.cast(c, tl.int64) * H + h) * K + dk[:, None]) * V + dv[None, :]
        S0 = tl.load(HB + oh).to(wk.dtype)
        uu = tl.load(U + offo, mask=rm[:, None], other=0.0).to(tl.float32)
        W = (uu - tl.dot(wk, S0)).to(wk.dtype)
        do = tl.load(DO + offo, mask=rm[:, None], other=0.0).to(wk.dtype)
        dA += tl.dot(do, tl.trans(W))
        dqg += tl.dot(do, tl.trans(S0))
        X = tl.load(DHB + oh).to(wk.dtype)
        dkd += tl.dot(W, tl.trans(X))
        dW = tl.load(DU + offo, mask=rm[:, None], other=0.0).to(wk.dtype)
        dwk -= tl.dot(dW, tl.trans(S0))
    dA = tl.where(rows[None, :] <= rows[:, None], dA, 0.0)
    tl.store(DAQK + offa, dA.to(DAQK.dtype.element_ty), mask=rm[:, None])
    tl.store(DQG + offk, dqg.to(DQG.dtype.element_ty), mask=rm[:, None])
    tl.store(DKD + offk, dkd.to(DKD.dtype.element_ty), mask=rm[:, None])
    tl.store(DWK + offk, dwk.to(DWK.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _bwd_ut_kernel(k, v, g, beta, cstart, clen, TB, BM, DU, DWK, DB, DKG, dv_, dbeta, H,
                   K: tl.constexpr, V: tl.constexpr, DT: tl.constexpr, HM: tl.constexpr = False):
    """Backward of the UT transform for one (chunk, head) (BWD_IMPL "v2", first of two intra kernels).

    From T = (I + diag(b) Bm)^-1 (TB) and Bm (BM, the strictly lower k-k decay products before beta), both
    float32 [64, 64] from the forward's strip and solve kernels, and the gradients of U = T diag(b) V and
    Wk = T diag(b) (k e^G):
        dT = dU (b v)^T + dWk (b k e^G)^T;  dv = b T^T dU;  dAkk = -tril_<(T^T dT T^T);
        dbeta = sum_v v T^T dU + sum_d k e^G T^T dWk + sum_j dAkk Bm;  DB = diag(b) dAkk (float32);
        DKG = diag(b) T^T dWk (float32 [64, K]: the gradient of Kg = k e^G through Wk).
    The channel-wise rest (the pair-product backward, dq, dk, dg) is _bwd_pair_kernel's."""
    c, h, _ = _chunk_head(HM)
    t0 = tl.load(cstart + c).to(tl.int64)
    L = tl.load(clen + c)
    rows = tl.arange(0, 64)
    rm = rows < L
    dk = tl.arange(0, K)
    dvv = tl.arange(0, V)
    offk = (t0 + rows)[:, None] * (H * K) + h * K + dk[None, :]
    offv = (t0 + rows)[:, None] * (H * V) + h * V + dvv[None, :]
    offa = (t0 + rows)[:, None] * (H * 64) + h * 64 + rows[None, :]
    bb = tl.load(beta + (t0 + rows) * H + h, mask=rm, other=0.0).to(tl.float32)
    # TB holds only T's lower 16x16 tiles (the solve kernel writes no others)
    T = tl.load(TB + offa, mask=rm[:, None] & (rows[None, :] <= rows[:, None]), other=0.0)
    Tt = tl.trans(T)
    vv = tl.load(v + offv, mask=rm[:, None], other=0.0).to(tl.float32)
    dU = tl.load(DU + offv, mask=rm[:, None], other=0.0)
    TtdU = _dt(Tt, dU, DT)
    tl.store(dv_ + offv, (TtdU * bb[:, None]).to(dv_.dtype.element_ty), mask=rm[:, None])
    dbo = tl.sum(vv * TtdU, axis=1)
    dT = _dt(dU, tl.trans(vv * bb[:, None]), DT)
    kk = tl.load(k + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    G = tl.cumsum(tl.load(g + offk, mask=rm[:, None], other=0.0).to(tl.float32), axis=0)
    Kg = kk * tl.exp(G)
    dWk = tl.load(DWK + offk, mask=rm[:, None], other=0.0)
    TtdW = _dt(Tt, dWk, DT)
    dbo += tl.sum(Kg * TtdW, axis=1)
    tl.store(DKG + offk, TtdW * bb[:, None], mask=rm[:, None])
    dT += _dt(dWk, tl.trans(Kg * bb[:, None]), DT)
    dAkk = -_dt(_dt(Tt, dT, DT), Tt, DT)
    dAkk = tl.where(rows[None, :] < rows[:, None], dAkk, 0.0)
    Bm = tl.load(BM + offa, mask=rm[:, None], other=0.0)
    dbo += tl.sum(dAkk * Bm, axis=1)
    tl.store(DB + offa, dAkk * bb[:, None], mask=rm[:, None])
    tl.store(dbeta + (t0 + rows) * H + h, dbo.to(dbeta.dtype.element_ty), mask=rm)


@triton.jit
def _bwd_pair_kernel(q, k, g, beta, cstart, clen, DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk_, dg, scale, lb, H,
                     K: tl.constexpr, BK: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr, SAFE: tl.constexpr,
                     HM: tl.constexpr = False):
    """The channel-wise part of the intra-chunk backward for one (chunk, head, BK channels) (BWD_IMPL "v2").

    The decay products M_ij = sum_d a_id b_jd e^(G_id - G_jd) (P: a = q, b = k; Bm: a = b = k) are sums over
    channels of per-channel terms, so given their gradients dP = scale AQK-gradient (DAQK) and dBm = DB
    [64, 64] each channel's da, db follow on its own: da_i = sum_j dM_ij b_j e^(G_i - G_j),
    db_j = sum_i dM_ij a_i e^(G_i - G_j), blocked by 16 rows with an anchor per block exactly as the
    forward (dense tensor-core tiles when this slice's gates are >= lb, else the diagonal tile pair by pair).
    Then the gradients through QG = scale q e^G, KD = k e^(G_C - G), GAM = e^(G_C) and Kg = k e^G (DKG, the
    gradient of Kg from Wk = T diag(b) Kg, from _bwd_ut_kernel), the cumulative gate's reverse sum, and the
    stores of dq, dk, dg for the slice.
    SAFE = False: only the slices whose gates are >= lb (dense diagonal tiles; the others return at once);
    SAFE = True: only the others (diagonal tiles pair by pair). Two launches, each compiled without the
    other's code. Addresses: 64-bit scalar bases of (chunk start, head) and 32-bit offsets inside the chunk
    (a [64, 64] tile of int64 offsets alone would take 64 registers per thread at 4 warps)."""
    c, h, ks = _chunk_head(HM, K // BK)
    ks = ks * BK
    t0 = tl.load(cstart + c).to(tl.int64)
    L = tl.load(clen + c)
    rows = tl.arange(0, 64)
    rm = rows < L
    d = ks + tl.arange(0, BK)
    bk_ = (t0 * H + h) * K                  # 64-bit element bases of the chunk's first row
    ba_ = (t0 * H + h) * 64
    ok_ = rows[:, None] * (H * K) + d[None, :]
    gg = tl.load(g + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    if FAST:
        ok = (tl.min(tl.min(gg, axis=1), axis=0) >= lb).to(tl.int32)
    else:
        ok = tl.zeros([], dtype=tl.int32)
    FASTC: tl.constexpr = 0 if SAFE else 1       # the kind of slice this launch takes
    if ok == FASTC:
        _pair_rest(q, k, gg, beta, DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk_, dg, scale, H, c, h, L, rows, rm, d, bk_,
                   ba_, ok_, K, BK, DT, FASTC)


@triton.jit
def _pair_rest(q, k, gg, beta, DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk_, dg, scale, H, c, h, L, rows, rm, d, bk_, ba_,
               ok_, K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, fast: tl.constexpr):
    """_bwd_pair_kernel after the gate's load, for one kind of slice (fast: dense diagonal tiles or not)."""
    qq = tl.load(q + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    kk = tl.load(k + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    G = tl.cumsum(gg, axis=0)
    r16 = tl.arange(0, 16)
    dq_p = tl.zeros([64, BK], dtype=tl.float32)
    dk_r = tl.zeros([64, BK], dtype=tl.float32)
    dk_c = tl.zeros([64, BK], dtype=tl.float32)
    for r in range(4):      # a loop, not unrolled: unrolled, the 4 blocks' loads are hoisted (255 registers)
        a = r * 16
        m = a + 8 * fast
        Gm = _row_of(G, rows, m)
        # the block's rows of G; the block's rows and columns of dP and dBm straight from memory (no [64, 64]
        # tile held across the loop)
        rb = a + r16
        rbm = rb < L
        G_r = _get_rows(G, r, 4, 16, BK)
        er = tl.exp(G_r - Gm[None, :])
        lim = a + 16 * fast
        kb = kk * tl.exp(tl.where(rows[:, None] < lim, Gm[None, :] - G, float("-inf")))
        orow = rb[:, None] * (H * 64) + rows[None, :]
        dP_r = tl.load(DAQK + ba_ + orow, mask=rbm[:, None], other=0.0).to(tl.float32) * scale
        dB_r = tl.load(DB + ba_ + orow, mask=rbm[:, None], other=0.0)
        dq_blk = er * _dt(dP_r, kb, DT)
        dkr_blk = er * _dt(dB_r, kb, DT)
        e = a + 15 - 8 * fast
        Ge = _row_of(G, rows, e)
        lo = a + 16 - 16 * fast
        xe = tl.exp(tl.where(rows[:, None] >= lo, G - Ge[None, :], float("-inf")))
        ocol = rows[:, None] * (H * 64) + rb[None, :]
        dP_c = tl.load(DAQK + ba_ + ocol, mask=rm[:, None], other=0.0).to(tl.float32) * scale
        dB_c = tl.load(DB + ba_ + ocol, mask=rm[:, None], other=0.0)
        ec = tl.exp(Ge[None, :] - G_r)
        dkc_blk = ec * (_dt(tl.trans(dP_c), qq * xe, DT) + _dt(tl.trans(dB_c), kk * xe, DT))
        if not fast:
            # the block's rows of q and k (reloaded: L1 hits) for the diagonal tile, pair by pair
            orb = rb[:, None] * (H * K) + d[None, :]
            q_r = tl.load(q + bk_ + orb, mask=rbm[:, None], other=0.0).to(tl.float32)
            k_r = tl.load(k + bk_ + orb, mask=rbm[:, None], other=0.0).to(tl.float32)
            odia = rb[:, None] * (H * 64) + rb[None, :]
            dP_rr = tl.load(DAQK + ba_ + odia, mask=rbm[:, None], other=0.0).to(tl.float32) * scale
            dB_rr = tl.load(DB + ba_ + odia, mask=rbm[:, None], other=0.0)
            dq_blk += _diag_da(dP_rr, k_r, G_r)
            dkr_blk += _diag_da(dB_rr, k_r, G_r)
            dkc_blk += _diag_db(dP_rr, q_r, G_r) + _diag_db(dB_rr, k_r, G_r)
        dq_p = _put_rows(dq_p, dq_blk, r, 4, 16, BK)
        dk_r = _put_rows(dk_r, dkr_blk, r, 4, 16, BK)
        dk_c = _put_rows(dk_c, dkc_blk, r, 4, 16, BK)
    eG = tl.exp(G)
    dG = qq * dq_p + kk * dk_r - kk * dk_c
    dqg = tl.load(DQG + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    dqo = dq_p + dqg * scale * eG
    dG += dqg * scale * qq * eG
    dKg = tl.load(DKG + bk_ + ok_, mask=rm[:, None], other=0.0)
    dko = dk_r + dk_c + dKg * eG
    dG += dKg * kk * eG
    GL = _row_of(G, rows, 63)
    ed = tl.exp(GL[None, :] - G)
    dkd = tl.load(DKD + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    dko += dkd * ed
    dG -= dkd * kk * ed
    dgam = tl.load(DGAM + (tl.cast(c, tl.int64) * H + h) * K + d)
    dGL = tl.sum(dkd * kk * ed, axis=0) + dgam * tl.exp(GL)
    dG += tl.where(rows[:, None] == 63, dGL[None, :], 0.0)
    dgo = tl.cumsum(dG, axis=0, reverse=True)
    tl.store(dq + bk_ + ok_, dqo.to(dq.dtype.element_ty), mask=rm[:, None])
    tl.store(dk_ + bk_ + ok_, dko.to(dk_.dtype.element_ty), mask=rm[:, None])
    tl.store(dg + bk_ + ok_, dgo.to(dg.dtype.element_ty), mask=rm[:, None])


@triton.jit
def _bwd_intra_kernel(q, k, v, g, beta, cstart, clen, DU, DWK, DQG, DKD, DAQK, DGAM,
                      dq, dk_, dv_, dg, dbeta, scale, lb, H,
                      K: tl.constexpr, V: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    t0 = tl.load(cstart + c)
    L = tl.load(clen + c)
    qq, kk, G, bb, fast, offk, rm = _load_chunk(q, k, g, beta, t0, L, h, H, K, FAST, lb)
    rows = tl.arange(0, 64)
    dvv = tl.arange(0, V)
    offv = (t0 + rows).to(tl.int64)[:, None] * (H * V) + h * V + dvv[None, :]
    vv = tl.load(v + offv, mask=rm[:, None], other=0.0).to(tl.float32)
    T, P, Bm = _chunk_intra(qq, kk, G, bb, fast, K, True)
    dU = tl.load(DU + offv, mask=rm[:, None], other=0.0).to(tl.float32)
    dWk = tl.load(DWK + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    dqg = tl.load(DQG + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    dkd = tl.load(DKD + offk, mask=rm[:, None], other=0.0).to(tl.float32)
    offa = (t0 + rows).to(tl.int64)[:, None] * (H * 64) + h * 64 + rows[None, :]
    dP = tl.load(DAQK + offa, mask=rm[:, None], other=0.0).to(tl.float32) * scale
    dkk = tl.arange(0, K)
    dgam = tl.load(DGAM + (tl.cast(c, tl.int64) * H + h) * K + dkk)
    eG = tl.exp(G)
    Kg = kk * eG
    bv = vv * bb[:, None]
    bK = Kg * bb[:, None]
    # UT transform backward:  U = T bV, Wk = T bKg, T = (I + Akk)^-1
    dT = _dt(dU, tl.trans(bv), DT) + _dt(dWk, tl.trans(bK), DT)
    TtdU = _dt(tl.trans(T), dU, DT)
    TtdW = _dt(tl.trans(T), dWk, DT)
    dvo = TtdU * bb[:, None]
    dbo = tl.sum(vv * TtdU, axis=1) + tl.sum(Kg * TtdW, axis=1)
    dKg = TtdW * bb[:, None]
    dAkk = -_dt(_dt(tl.trans(T), dT, DT), tl.trans(T), DT)
    dAkk = tl.where(rows[None, :] < rows[:, None], dAkk, 0.0)
    dbo += tl.sum(dAkk * Bm, axis=1)
    dB = dAkk * bb[:, None]
    # pairwise-decay products  M_ij = sum_d a_id b_jd e^(G_id - G_jd):  P (a=q, b=k) and B (a=k, b=k)
    dq_p = tl.zeros([64, K], dtype=tl.float32)
    dk_r = tl.zeros([64, K], dtype=tl.float32)
    dk_c = tl.zeros([64, K], dtype=tl.float32)
    for r in tl.static_range(4):
        a = r * 16
        m = a + 8 * fast
        Gm = _row_of(G, rows, m)
        q_r = _get_rows(qq, r, 4, 16, K)
        k_r = _get_rows(kk, r, 4, 16, K)
        G_r = _get_rows(G, r, 4, 16, K)
        # row side (row block r)
        er = tl.exp(G_r - Gm[None, :])
        lim = a + 16 * fast
        kb = kk * tl.exp(tl.where(rows[:, None] < lim, Gm[None, :] - G, float("-inf")))
        dP_r = _get_rows(dP, r, 4, 16, 64)
        dB_r = _get_rows(dB, r, 4, 16, 64)
        dq_blk = er * _dt(dP_r, kb, DT)
        dkr_blk = er * _dt(dB_r, kb, DT)
        # column side (column block r)
        e = a + 15 - 8 * fast
        Ge = _row_of(G, rows, e)
        lo = a + 16 - 16 * fast
        xe = tl.exp(tl.where(rows[:, None] >= lo, G - Ge[None, :], float("-inf")))
        dP_c = _get_cols(dP, r, 64, 4, 16)
        dB_c = _get_cols(dB, r, 64, 4, 16)
        ec = tl.exp(Ge[None, :] - G_r)
        dkc_blk = ec * (_dt(tl.trans(dP_c), qq * xe, DT) + _dt(tl.trans(dB_c), kk * xe, DT))
        if fast == 0:
            dP_rr = _get_cols(dP_r, r, 16, 4, 16)
            dB_rr = _get_cols(dB_r, r, 16, 4, 16)
            dq_blk += _diag_da(dP_rr, k_r, G_r)
            dkr_blk += _diag_da(dB_rr, k_r, G_r)
            dkc_blk += _diag_db(dP_rr, q_r, G_r) + _diag_db(dB_rr, k_r, G_r)
        dq_p = _put_rows(dq_p, dq_blk, r, 4, 16, K)
        dk_r = _put_rows(dk_r, dkr_blk, r, 4, 16, K)
        dk_c = _put_rows(dk_c, dkc_blk, r, 4, 16, K)
    dG = qq * dq_p + kk * dk_r - kk * dk_c
    dqo = dq_p + dqg * scale * eG
    dG += dqg * scale * qq * eG
    dko = dk_r + dk_c + dKg * eG
    dG += dKg * Kg
    GL = _row_of(G, rows, 63)
    ed = tl.exp(GL[None, :] - G)
    kdv = kk * ed
    dko += dkd * ed
    dG -= dkd * kdv
    dGL = tl.sum(dkd * kdv, axis=0) + dgam * tl.exp(GL)
    dG += tl.where(rows[:, None] == 63, dGL[None, :], 0.0)
    dgo = tl.cumsum(dG, axis=0, reverse=True)
    tl.store(dq + offk, dqo.to(dq.dtype.element_ty), mask=rm[:, None])
    tl.store(dk_ + offk, dko.to(dk_.dtype.element_ty), mask=rm[:, None])
    tl.store(dv_ + offv, dvo.to(dv_.dtype.element_ty), mask=rm[:, None])
    tl.store(dg + offk, dgo.to(dg.dtype.element_ty), mask=rm[:, None])
    tl.store(dbeta + (t0 + rows).to(tl.int64) * H + h, dbo.to(dbeta.dtype.element_ty), mask=rm)


@triton.jit
def _gate_kernel(x, A_log, dt_bias, g, n_rows, H, lb, K: tl.constexpr, BR: tl.constexpr,
                 SOFTPLUS: tl.constexpr, KP: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    dk = tl.arange(0, KP)                       # KP = K rounded up to a power of two; columns >= K masked
    rm = rows < n_rows
    m2 = rm[:, None] & (dk < K)[None, :]
    hh = rows % H
    off = rows.to(tl.int64)[:, None] * K + dk[None, :]
    z = tl.load(x + off, mask=m2, other=0.0).to(tl.float32)
    z += tl.load(dt_bias + hh[:, None] * K + dk[None, :], mask=m2, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_log + hh, mask=rm, other=0.0).to(tl.float32))[:, None]
    if SOFTPLUS:
        sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        out = -a * sp
    else:
        az = a * z
        e = tl.exp(-tl.abs(az))                 # sigmoid without overflow (the interpreter warns on exp(+big))
        out = lb * tl.where(az >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(g + off, out, mask=m2)


@triton.jit
def _step_kernel(q, k, v, g, beta, S_in, S_out, o, scale, K: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, KP: tl.constexpr):
    """One (batch x head, V block): KP = K rounded up to a power of two (channels >= K masked, read as
    zero: no state, no decay), BV a power of two (value columns >= V masked)."""
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    dk = tl.arange(0, KP)
    km = dk < K
    cols = vb * BV + tl.arange(0, BV)
    cm = cols < V
    m2 = km[:, None] & cm[None, :]
    base = bh.to(tl.int64)
    soff = (base * K + dk[:, None]) * V + cols[None, :]
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


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------
def _pow2(n):
    return n >= 16 and (n & (n - 1)) == 0


#: chunk/segment tables already on the device, keyed by (device, B, T, sequence bounds, segment length):
#: a training or benchmark loop calls with the same geometry every step, so only the first call builds them
#: (11 host-to-device copies and the numpy work). Small (16 entries): a 1M-token table set is ~0.7 MB.
_TABLE_CACHE = DeviceTableCache(16)


def _tables(B, T, bounds, seg_chunks, device):
    """Chunk and segment tables of B sequences of T tokens (bounds None) or of the packed sequences
    [(start, end), ...] (bounds).  Returns a dict of int32 / int64 device tensors plus host counts; cached
    (_TABLE_CACHE), so the dict and its tensors are shared: read only."""
    key = (str(device), B, T, None if bounds is None else tuple(bounds), int(seg_chunks))
    return _TABLE_CACHE.get(key, lambda: _build_tables(B, T, bounds, seg_chunks, device), device)


def _build_tables(B, T, bounds, seg_chunks, device):
    if bounds is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    cst, cln, seg0, seg1, segseq, sq0, sq1, st0, st1 = [], [], [], [], [], [], [], [], []
    nc = 0
    for n, (s, e) in enumerate(bounds):
        starts = np.arange(s, e, CHUNK, dtype=np.int64)
        cst.append(starts)
        cln.append(np.minimum(CHUNK, e - starts))
        m = len(starts)
        sq0.append(len(seg0))
        if m == 0:
            seg0.append(nc), seg1.append(nc), segseq.append(n), st0.append(s), st1.append(s)
        for a in range(0, m, seg_chunks):
            seg0.append(nc + a)
            seg1.append(nc + min(m, a + seg_chunks))
            segseq.append(n)
            st0.append(s + a * CHUNK)
            st1.append(min(e, s + (a + seg_chunks) * CHUNK))
        sq1.append(len(seg0))
        nc += m
    cst = np.concatenate(cst) if nc else np.zeros(0, np.int64)
    cln = np.concatenate(cln) if nc else np.zeros(0, np.int64)

    def dev(x, dt=np.int32):              # host table -> device, without a stream synchronisation
        return device_table(np.asarray(x, dtype=dt), torch.int32 if dt == np.int32 else torch.int64, device)

    sq0a, sq1a = np.asarray(sq0), np.asarray(sq1)
    return dict(cstart=dev(cst), clen=dev(cln), seg_c0=dev(seg0), seg_c1=dev(seg1), seg_t0=dev(st0),
                seg_t1=dev(st1), seg_seq=dev(segseq, np.int64),
                seq_s0=dev(sq0), seq_s1=dev(sq1), n_chunks=nc, n_seg=len(seg0), n_seq=len(bounds),
                first_seg=dev(sq0a, np.int64), last_seg=dev(sq1a - 1, np.int64),
                segmented=bool((sq1a - sq0a > 1).any()), seq_bounds=tuple((int(s), int(e)) for s, e in bounds))


def _seg_chunks_for(n_chunks_longest, BH, K, V, BV, device, seg_chunks, grad=True):
    """Segment length (in chunks) for the long-context split, from a wave model of the serial passes.

    Every program of a state pass walks its whole segment, so a pass over NS segments takes
    ceil(n / NS) steps per wave, and ceil(programs / slots) waves (slots = SMs x H_CFG["ctas_per_sm"]).
    Unsplit (NS = 1) the forward has one pass of BH * V/BV programs over n steps; split, it adds the
    augmented transition pass (BH * (K+V)/BV programs) and NS serial combine steps.  Step costs (us) from
    the H200 phase timings at H=16, K=V=128, BV=32 (benchmarks/results/kda.md): state pass ~2.4 per
    step and wave, transition pass ~1.4; a combine step is an estimate (~10).  A forward without
    autograd (grad False) whose unsplit pass has at most one program per SM runs it with
    H_CFG["stages_one_wave"] pipeline stages at H_CFG["w_one_wave"] us per step (H200, 11th session: 1.1;
    forward at T = 1M, H = 16, BV = 32: unsplit 58.6 ms against 61.7 split into 33 segments; BV = 16,
    which _value_block then picks: unsplit 55.2, split 68.6-77.6).  With autograd the backward's passes
    share the split (its unsplit dS chain was slower: fwd+bwd at H=16, T=256K 74.4 ms against 66.8), and the
    2.4 us model stays.  The NS with the lowest modelled time wins (1 << 30 = no split)."""
    if seg_chunks is not None:
        return max(1, int(seg_chunks))
    if device.type != "cuda" or n_chunks_longest <= 1:
        return 1 << 30
    sms = sm_count(device)
    w_un = None if grad or BH * (V // BV) > sms else float(H_CFG["w_one_wave"])
    return _seg_model(n_chunks_longest, BH, K, V, BV, sms * H_CFG["ctas_per_sm"], w_un)


def _pass_stages(programs, device):
    """Pipeline stages of a serial state pass with this many programs: H_CFG["stages_one_wave"] when they
    fit one per SM (latency-bound: loads issued two chunks ahead), else H_CFG["num_stages"] (two programs
    per SM share the bandwidth and the shared memory)."""
    if device.type == "cuda" and programs <= sm_count(device):
        return H_CFG["stages_one_wave"]
    return H_CFG["num_stages"]


@functools.lru_cache(maxsize=256)
def _seg_model(n_chunks_longest, BH, K, V, BV, slots, w_unsplit=None):
    """_seg_chunks_for's wave model (memoised: ~20-40 us of Python per call otherwise); w_unsplit: the step
    cost of the unsplit pass when it differs from the split passes' (us)."""
    w0, w1, wc = 2.4, 1.4, 10.0
    p0, p1 = BH * (V // BV), BH * ((K + V) // BV)
    best, best_ns = n_chunks_longest * (w_unsplit or w0) * math.ceil(p0 / slots), 1
    for ns in range(2, min(256, n_chunks_longest) + 1):
        steps = math.ceil(n_chunks_longest / ns)
        cost = steps * (w0 * math.ceil(ns * p0 / slots) + w1 * math.ceil(ns * p1 / slots)) + wc * ns
        if cost < best:
            best, best_ns = cost, ns
    return 1 << 30 if best_ns == 1 else math.ceil(n_chunks_longest / best_ns)


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _interm_dtype(x):
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32


# set to a list to record (phase name, CUDA event) pairs at the forward's phase boundaries (benchmarks only)
PROFILE = None


def _mark(name):
    mark_phase(PROFILE, name)


# which forward intra-chunk implementation _fwd runs: "v5" (default) = v4 with the in-chunk cumulative gate
# precomputed by _chunk_cumsum_kernel (float32, plus the per-block bound flags) and _fwd_strip5_kernel and
# _fwd_wu_kernel, which only load it (ptxas sm_90a, 1 warp, BK 16: 2024 SASS instructions and 130 shuffles
# vs strip4's 4096 and 423, 220 vs 243 registers; launch settings INTRA5_CFG); "v4" = _fwd_strip4_kernel
# (or _fwd_tiles4_kernel) + _fwd_solve4_kernel + _fwd_wu_kernel; "v2" = _fwd_intra2_kernel + _fwd_wu_kernel; "v3" = _fwd_intra3_kernel
# (channel-sliced, w/u merged in).  All give the same results up to rounding; the benchmark's --intra flag times
# them side by side (H200, H=16, T=1M forward: v2 106.7 ms, v3 96-127 ms by setting, v4 79.8 ms, v5 69.7 ms).
INTRA_IMPL = "v5"
# launch configuration of _fwd_intra3_kernel: channel slice BK, value slice BV (powers of two >= 16); split =
# two launches (the Akk side with T, WK, KD, U, then the P side with AQK, QG, GAM) instead of one; maxnreg =
# a register cap per thread for ptxas (None: none; ptxas -v for sm_90a at the defaults: 255 registers, 0-20 B
# of spill stores, i.e. 2 CTAs of 4 warps per SM; a cap of 168 allows 3, 128 allows 4, at the cost of spills)
INTRA3_CFG = dict(BK=32, BV=32, num_warps=4, num_stages=1, split=False, maxnreg=None)
# launch configuration of the v4 kernels: channel slice BK and warps of _fwd_strip4_kernel, warps of
# _fwd_solve4_kernel and of _fwd_wu_kernel
# (tiles: _fwd_tiles4_kernel in place of _fwd_strip4_kernel; maxnreg: register cap of that kernel)
# (defaults: the best of benchmarks/kda.py --intra4-sweep on the H200, 2026-11-29: intra+solve 42.4 ms at
# H=16, T=1M against 49.4 at BK=32 / 2 warps and 67.1 for v2's intra kernel)
# r_fast (strip kernel only, not tiles): the 4 row blocks of a chunk as consecutive programs, as in INTRA5_CFG.
# v4 with r_fast, wider slices and more warps is v5 without the cumsum kernel and its float32 G round trip
# (~17 GB of the ~26 GB of v5's extra traffic at H=16, T=1M; cumsum phase 4.8 ms at 1M, 0.08 ms at 8K). Timed on
# the H200 (8th session, BK 64 / 8 warps / r_fast): 174.8 ms at 1M (strip phase 132.5 ms) against v5's 63.2; the
# in-kernel scan over [64, 64] slices does not fit that launch
INTRA4_CFG = dict(BK=16, nw_strip=1, nw_solve=1, nw_wu=4, ns_strip=1, tiles=False, maxnreg=None, r_fast=False,
                  solve_prec="ieee")
# launch configuration of the v5 kernels (same keys, tiles unused, plus the warps of _chunk_cumsum_kernel).
# Defaults: the best of benchmarks/kda.py --intra5-sweep on the H200 (2026-11-29, H=16, T=1M forward):
# BK 64 / 4 warps 69.7 ms (strip 22.2 ms) against BK 32 / 4 warps 72.9, BK 16 / 1 warp 80.8 (strip 33.7)
# and v4 at its best setting 79.8 (strip 35.5): with the gate's cumulative sum precomputed the strip
# kernel is no longer register-bound, so wider channel slices and more warps pay
# (second sweep: BK 128 / 8 warps 68.5, BK 64 / 4 warps 69.2, 2 stages 71.6; the cumsum kernel with 4
# warps instead of 8: 4.85 ms instead of 5.64, in both sweeps)
# r_fast: launch the strip kernel's 4 row blocks of a chunk as consecutive programs (grid (4 NC, H)
# instead of (NC, H, 4), where they run NC * H programs apart). Each of the 4 loads the chunk's [64, K]
# k (bf16) and G (float32), 48 KB per (chunk, head); apart they miss L2, so at H=16, T=1M the kernel moves
# ~67 GB of loads + 15 GB of stores against ~32 GB once each (~20 ms vs ~8 ms at 4.2 TB/s; measured
# strip phase 22 ms). Timed on the H200 (5th session, --intra5-sweep, H=16, T=1M forward, fla 65.5 ms):
# r_fast off 68.7 ms (strip 22.9), on 64.1 (strip 18.2), on + 8 strip warps 63.4 (strip 17.8), on + BK 128 /
# 8 warps 64.0, on + BK 32 64.5: the default is now r_fast with 8 strip warps
# solve_prec: tl.dot input precision of the solve kernel's 16x16 products ("ieee" = float32 FMAs; "tf32x3" =
# three TF32 tensor-core products, about float32 accuracy). H200 (8th session, --intra5-sweep, H=16, T=1M):
# "ieee" 63.43 ms (solve phase 5.93), "tf32x3" 62.96 (5.51), "tf32x3" with 4 solve warps 73.18 (15.69); the
# bf16 T=4096 GPU test passes with it (tests/test_kda_triton.py v5-tf32solve): the default is now "tf32x3"
# (the interpreter always runs "ieee")
# kgb: the strip kernel stores diag(beta) k e^G (input dtype, into WK's buffer) and the w/u kernel reads it in place
# of k and the float32 G (768 -> 256 B read per token and head); lim_rows: the strip kernel loads only the column-
# operand rows each row block uses; tb_lowp: T in the input dtype when the backward does not keep it (the w/u
# kernel rounds it to that dtype for its dots anyway: same results, half the bytes).  H200, 11th session, forward
# phases (ms) at H=16 T=1M / H=96 T=64K: w/u 7.51 -> 5.03 / 2.90 -> 1.98, solve 5.56 -> 5.20 / 2.09 -> 1.96, strip
# 17.7 -> 19.1 / 6.8 -> 7.3 (the KGB stores; lim_rows alone saved 0.45 / 0.2); kgb off alone: 1M 56.42 against
# 55.39 ms.  Tried and dropped the same session: one strip program per (chunk, head) looping over the 4 row blocks
# (the [64, BK] column operands loaded once instead of 4 times): 240 registers at 8 warps, strip phase 33.1 ms at
# 1M (25.7 at BK 32 / 4 warps) against 19.0.  Also dropped: the column operand k_j e^(E_b - G_j) (bf16, E_b = G at the
# end of j's row block) written by the cumsum kernel, so that the strip kernel loads 2 bytes per element instead of
# 6 and takes 4 x BK exponentials per slice instead of 64 x BK: cumsum 4.8 -> 11.4 ms at 1M (255 registers), strip
# 19.2 -> 23.3 (18.4 with maxnreg 80), o error 3.6e-3 -> 4.0e-3 against fla; forward 66.6 against 56.0 ms.
# ftz: the strip kernel's dense-path exponentials as ex2.approx.ftz.f32 (_ex; results below 2^-126 flush to 0). An
# Nsight Compute profile (H=16, T=64K) shows that kernel instruction-bound (IPC 2.3, DRAM 40%); its sm_90a SASS
# shrinks 1120 -> 1032 instructions with it (12th session). Timed in the 13th (benchmarks/kda.py --alt
# "INTRA5_CFG:ftz=True", H200, forward): H=16 64K 3.554 -> 3.516 ms, 1M 56.03 -> 55.53, H=96 64K 18.78 -> 18.62;
# o error against the reference unchanged (3.6e-3 - 3.7e-3), so on by default.
# rows32: the strip kernel as _fwd_strip32_kernel, one program per 32-row pair of a chunk (grid (2 NC, H)): where
# both 16-row blocks keep the bound and G falls by at most 161 across the pair in every channel (the cumsum
# kernel's FB bit 1; 32 gates at the bound -5 fall by 160, and the slack absorbs G's rounding), the anchor is the
# pair's middle (exponents within +-80.5) and one dense [32, BK] x [BK, 64] dot covers the pair's causal tiles, so
# the [64, BK] column operand and its exponentials are formed twice per chunk instead of four times; other pairs
# (and a dense pair that overflows: q or k entries beyond ~3e3) run as two 16-row blocks (bit 0 as before).  Not
# for float16 (its range ends at e^11).  nw_strip32: its warps.  cumsum_slices: the cumsum kernel over K / slices
# channels per program (grid (NC, H, slices); 230 registers at K = 128 in one slice, 113 in two); the strips AND the
# slices' flags.  maxnreg_solve: register cap of the 1-warp solve programs (195 registers without: 8 per SM).
# H200, 20th session, forward ms at H = 16 64K / 1M, H = 96 64K (`--only mtc`): before 2.91 / 42.03 / 18.50,
# rows32 2.79 / 39.94 / 17.35 (at 4 warps 2.86 / 41.51 / 18.03; maxnreg 80 2.80 / 40.18 / 17.49); then (another
# run, rows32 40.69 at 1M) cumsum_slices 2: 2.77 / 39.76 / 17.33, 4: 2.77 / 40.11 / 17.43, 4 at 2 warps 2.74 /
# 39.54 / 17.42, 2 with maxnreg_solve 128: 2.77 / 39.65 / 17.22.  Dropped: BK 32 for rows32 (43.36 against
# 40.26 at 1M), 8 cumsum warps (45.13), maxnreg_solve 96 (41.90).  Nsight Compute at 64K (one piece): the rows32
# strip at 104 registers, 2 programs (16 warps) per SM, 44% of its stall cycles on the short scoreboard (shared
# memory / MUFU); the cumsum kernel (one slice) 2 programs per SM, 63% of DRAM peak.
# solve_prec_fwd: the solve's precision in a forward that keeps no T for the backward (no autograd).  "tf32" (one
# TF32 product per 16x16 dot): 2344 SASS instructions a program against 7008 for "tf32x3" (ptxas sm_90a; 153
# registers against 195; with maxnreg_solve 128 "tf32x3" spills 392 B).  T is rounded to bf16 for the w/u dots
# (tb_lowp) anyway, so the forward's error does not move: bf16 T = 4096 against the reference o 4.38e-3 / 4.36e-3
# (H 4 / 16) against 4.34e-3 / 4.37e-3, final state 2.39e-3 / 2.51e-3 against 2.39e-3 / 2.33e-3.  Under autograd
# the backward reads the T the forward kept, and with "tf32" there the gradients of g and beta were less accurate
# (1.29e-2 / 4.22e-3 against 1.11e-2 / 2.97e-3): it keeps "tf32x3".  H200 (20th session, forward ms, H = 16 64K /
# 1M, H = 96 64K): tf32x3 2.73 / 39.43 / 17.11, tf32 2.52 / 36.53 / 16.17 (with maxnreg_solve 128 2.52 / 37.19 /
# 16.10; tf32 with the 10 tiles of N loaded first, 195 registers, 2.55 / 37.36 / 16.36, dropped).
# nb_lowp: N = diag(beta) Akk between the strip and solve kernels in bfloat16 instead of float32 (16-bit inputs, a
# forward that keeps no T for the backward): 128 B per token and head less written and read; the solve's products
# round N to TF32 anyway ("tf32") and T is rounded to bf16 (tb_lowp).  bk_strip32 / maxnreg_strip32: the channel
# slice and register cap of the rows32 strip kernel (BK / maxnreg apply to the 16-row strip kernels).
# H200, 23rd session, forward ms at H = 16 64K / 1M, H = 96 64K (`--only mtc`, defaults before: 2.55 / 37.0 / 16.39):
# nb_lowp 2.51 / 36.11-36.38 / 16.03-16.09 (o error at T = 4096 against the reference 4.355e-3 either way); with it,
# the rows32 strip at 4 warps, BK 32 and a cap of 128 registers (no spills, sm_90a; at 8 warps / BK 64, 124
# registers): 2.44-2.64 / 35.34-36.02 / 15.69 (three runs).  Beside a state-pass program (192 registers x 128
# threads, 193 KB of shared memory) two such 4-warp strip programs fit on an SM where one 8-warp one did.  Dropped in
# the same runs: strip caps of 80 (104 B of stack at 8 warps: 37.77 at 1M) / 96-120 at 4 warps (37.2-39.8), BK 16
# (39.3), 2 warps (38.2), cumsum_slices 4 (36.1-36.2), 2 cumsum warps (35.5), 8 w/u warps (35.4), 2 stages in
# the state pass (45.1).  Also dropped: G in 16-bit fixed point (-G in steps of 64 |lb| / 65535, o error 4.41e-3):
# 40.76 at 1M, and 37.34 against 36.11 with the strip reading only the 16-bit G, so halving G's bytes does not pay
# for the conversions in this instruction-bound kernel (benchmarks/results/kda.md, 23rd session).
# head_major: the v5 intra kernels (cumsum, strips, solve, w/u), the unfused output kernel and the v2 backward's
# per-chunk kernels (chunk grads, ut, pair) on head-major grids ((H, NC), chunk index on the second axis, at most
# 65535): the programs that run together are the heads of a few chunks, and read neighbouring 256-512 B parts of
# each token's [H, K] rows, where a chunk-major grid has them read one head's part of ~1000 tokens' rows.  H200,
# 24th session, forward ms (`--only mtc`, with PIPE_CFG merge_wq): H = 16 64K 2.36 -> 2.27, 1M 34.18 -> 32.41,
# H = 96 64K 15.76 -> 14.37.  The results are bit for bit the same.
INTRA5_CFG = dict(BK=64, nw_strip=8, nw_solve=1, nw_wu=4, ns_strip=1, tiles=False, maxnreg=None, nw_cumsum=4,
                  r_fast=True, solve_prec="tf32x3", kgb=True, lim_rows=True, tb_lowp=True, ftz=True, rows32=True,
                  nw_strip32=4, maxnreg_solve=None, cumsum_slices=2, head_major=True,
                  solve_prec_fwd="tf32", nb_lowp=True, bk_strip32=32, maxnreg_strip32=128)


def _solve_prec(cfg, fwd_only=False):
    """tl.dot input precision of the solve kernel: cfg "solve_prec", or "solve_prec_fwd" (when set) for a forward
    that keeps no T for the backward (fwd_only); "ieee" under the interpreter."""
    if _interpret():
        return "ieee"
    return (fwd_only and cfg.get("solve_prec_fwd")) or cfg.get("solve_prec", "ieee")


def _maxnreg(n):
    """Launch option dict for a register cap (ptxas maxnreg; dropped under the interpreter)."""
    return {} if n is None or _interpret() else dict(maxnreg=int(n))


def _intra5(q2, k2, g2, b2, tab, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, save_b, KGB=None):
    """The v5 intra-chunk products of every (chunk, head): the in-chunk cumulative gate GCS, the strips
    (QG, KD, AQK, GAM written into the given tensors; with KGB also diag(beta) k e^G into KGB [N, H, K]) and
    T = (I + diag(beta) Akk)^-1 (TB [N, H, 64], float32, or the input dtype with INTRA5_CFG["tb_lowp"] when
    save_b is off); with save_b also Bm = Akk before beta (BM, float32 [N, H, 64], for the backward).
    Returns (TB, GCS, BM or None)."""
    NC = tab["n_chunks"]
    NBUF, GCS, FB, TB, BM = _intra5_scratch(q2.shape[0], NC, H, K, idt, save_b, q2.device)
    _intra5_launch(q2, k2, g2, b2, tab["cstart"], tab["clen"], NC, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM,
                   FB, NBUF, GCS, TB, BM, KGB)
    return TB, GCS, BM


def _intra5_scratch(rows, NC, H, K, idt, save_b, dev):
    """The v5 intra kernels' scratch for `rows` tokens and NC chunks: (NBUF [rows, H, 64] (float32, or bfloat16
    with INTRA5_CFG["nb_lowp"] for 16-bit inputs unless save_b), GCS [rows, H, K] float32, FB [NC, H, 4 *
    _cumsum_slices(K)] int32, TB [rows, H, 64] (the input dtype with INTRA5_CFG["tb_lowp"] unless save_b, else
    float32), BM [rows, H, 64] float32 with save_b, else None)."""
    tdt = idt if INTRA5_CFG.get("tb_lowp") and not save_b else torch.float32
    ndt = torch.bfloat16 if INTRA5_CFG.get("nb_lowp") and not save_b and idt != torch.float32 else torch.float32
    return (torch.empty(rows, H, 64, dtype=ndt, device=dev),
            torch.empty(rows, H, K, dtype=torch.float32, device=dev),
            torch.empty(NC, H, 4 * _cumsum_slices(K), dtype=torch.int32, device=dev),
            torch.empty(rows, H, 64, dtype=tdt, device=dev),
            torch.empty(rows, H, 64, dtype=torch.float32, device=dev) if save_b else None)


def _cumsum_slices(K):
    """Channel slices of _chunk_cumsum_kernel (INTRA5_CFG["cumsum_slices"], at most K / 16 and dividing K)."""
    ns = int(INTRA5_CFG.get("cumsum_slices") or 1)
    while ns > 1 and (K % ns or K // ns < 16):
        ns //= 2
    return max(ns, 1)


def _intra5_launch(q2, k2, g2, b2, cstart, clen, NC, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, FB, NBUF, GCS, TB,
                   BM=None, KGB=None, marks=True):
    """_intra5's three launches over the NC chunks of the tables cstart / clen (a slice of a chunk table is a
    range of chunks): the token-indexed outputs go to their tokens' rows, the chunk-indexed ones (GAM, FB
    [NC, H, ...]) to rows 0 .. NC-1 of the given tensors.  marks: record the phase boundaries (PROFILE)."""
    cfg = INTRA5_CFG
    mark = _mark if marks else (lambda name: None)
    rows32 = bool(cfg.get("rows32")) and fast and idt != torch.float16
    ns = FB.shape[-1] // 4
    hm = _head_major(NC)
    _chunk_cumsum_kernel[_ch_grid(NC, H, hm, ns)](g2, cstart, clen, GCS, FB, lb, H, K=K, FAST=fast, ROWS32=rows32,
                                                  NS=ns, HM=hm, num_warps=cfg.get("nw_cumsum", 8), num_stages=1)
    mark("intra: cumsum")
    r_fast = bool(cfg.get("r_fast"))
    save_b = BM is not None
    common = dict(NS=ns, BM=BM if save_b else NBUF, SAVE_B=save_b, KGB=KGB if KGB is not None else NBUF,
                  WRITE_KGB=KGB is not None, LIM_ROWS=bool(cfg.get("lim_rows")),
                  FTZ=bool(cfg.get("ftz")) and not _interpret())
    if rows32:
        _fwd_strip32_kernel[(2 * H, NC) if hm else (2 * NC, H)](
            q2, k2, GCS, FB, b2, cstart, clen, NBUF, QG, KD, AQK, GAM, scale, H, K=K, HM=hm,
            BK=min(K, cfg.get("bk_strip32") or cfg["BK"]), DT=_TL[idt], **common,
            num_warps=cfg.get("nw_strip32", cfg["nw_strip"]), num_stages=cfg["ns_strip"],
            **_maxnreg(cfg.get("maxnreg_strip32") or cfg.get("maxnreg")))
    else:
        _fwd_strip5_kernel[(4 * NC, H, 1) if r_fast else (NC, H, 4)](
            q2, k2, GCS, FB, b2, cstart, clen, NBUF, QG, KD, AQK, GAM, scale, H, K=K,
            BK=min(K, cfg["BK"]), DT=_TL[idt], R_FAST=r_fast, **common,
            num_warps=cfg["nw_strip"], num_stages=cfg["ns_strip"], **_maxnreg(cfg.get("maxnreg")))
    mark("intra: strip")
    _fwd_solve4_kernel[_ch_grid(NC, H, hm)](NBUF, cstart, clen, TB, H, PREC=_solve_prec(cfg, BM is None), HM=hm,
                                            num_warps=cfg["nw_solve"], num_stages=1,
                                            **_maxnreg(cfg.get("maxnreg_solve")))
    mark("intra: solve")


def _head_major(NC):
    """Whether the v5 intra kernels run head-major grids (INTRA5_CFG["head_major"]: the programs of one chunk's
    heads next to each other, so that concurrent programs read neighbouring parts of each token's rows); the
    chunk index is then the grid's second axis, at most 65535."""
    return bool(INTRA5_CFG.get("head_major")) and NC <= 65535


def _ch_grid(NC, H, hm, S=1, Z=1):
    """The grid of a kernel that decodes its program with _chunk_head(hm, S): (NC, H, S * Z), or head-major
    (H * S, NC, Z); Z: a further axis of its own (S = 1 then), program_id(2) either way."""
    return (H * S, NC, Z) if hm else (NC, H, S * Z)


def _wu5_launch(k2, v2, b2, cstart, clen, NC, H, K, V, idt, GCS, TB, WK, U, kgb):
    """The v5 w/u kernel over the NC chunks of cstart / clen; with kgb, WK holds diag(beta) k e^G on entry
    (each program reads its chunk's rows before writing them)."""
    hm = _head_major(NC)
    _fwd_wu_kernel[_ch_grid(NC, H, hm)](WK if kgb else k2, v2, GCS, b2, cstart, clen, TB, WK, U, H, K=K, V=V,
                                        DT=_TL[idt], CUMSUM=True, KGB_IN=kgb, HM=hm, num_warps=INTRA5_CFG["nw_wu"],
                                        num_stages=1)


#: the forward without autograd of one long sequence as a pipeline over pieces of the sequence (_fwd_pipelined):
#: on: use it where it applies; min_chunks: only from this many chunks on; piece_chunks, max_pieces: pieces
#: (consecutive chunk ranges of about equal length) of about piece_chunks chunks, at most max_pieces of them;
#: state_priority: the serial state pass on a stream of the highest priority; bv: state columns per program of
#: its state pass (None: as the one-stream forward).
#: H200, 18th session, H = 16, T = 1M forward (ms; one stream 54.7): 16 pieces 50.8 (state pass at 16 columns,
#: 128 programs), 50.7 without the priority, 52.9 with 2 pipeline stages in the state pass; 32 columns (64
#: programs, fewer SMs held by the chain) 48.7 at 16 pieces, 49.5 at 8, 48.2 at 32, 49.3 at 64; the pieces' intra
#: kernels on two or three streams 50.2-51.1.  A per-kernel timeline (CUDA events per launch, 16 pieces, 16
#: columns): a piece's state pass takes 1.7 ms against 0.93 alone and finishes before the next piece's intra
#: work does (3.2 ms a piece against 2.1 alone): the chain is hidden, what is left is the intra kernels slowed by
#: sharing the SMs with it and with the output kernel.  At 32 columns, forward ms (one stream / pieces): 64K 3.48
#: / 11.9 at 32 pieces, 4.00 at 16 (launch-bound: six launches a piece); 256K 13.74 / 12.57 at 32, 12.29 at 16;
#: 1M 54.91 / 48.26 at 32, 48.70 at 16.  With the defaults (pieces of 256 chunks, at most 32): 64K 3.47 / 3.22 (4
#: pieces), 256K 13.69 / 12.27 (16), 1M 54.78 / 48.17 (32); H = 96, 256K: not pipelined (the chain would hold
#: every SM), 74.1 either way.
#: fuse_o: the state pass also forms the output (_fwd_h_kernel FUSE_O: per chunk O = QG S + AQK W from the
#: operands the output kernel would read back), so neither the chunk-entry states HB (512 B per token and head in
#: bf16) nor the new values VN are written, and no output kernel runs.  Alone it lengthens the chain (11th
#: session, one stream: 16.15 ms against 9.46 + 6.44); here the chain has slack, and a piece's fused pass still
#: takes 0.8 ms against the piece's 1.35 ms of intra work.  maxnreg: register cap of that pass (None: none;
#: fused, ptxas sm_90a: 219 registers at 4 warps, 192 KB of shared memory at 3 stages; at 192, 56 B of stack,
#: two strip programs (80 registers x 256 threads) still fit beside it on an SM).
#: H200, 19th session, forward ms at H = 16 (64K / 256K / 1M; `--only mtc`): not fused 3.22 / 12.31 / 48.22,
#: fused 2.92 / 11.05 / 42.86; with maxnreg 192 2.93 / 10.90 / 42.51, 168 (120 B of stack) 3.72 / 14.08 / 55.57.
#: Tried with it and dropped: 2 stages in the pass 46.37 at 1M; 64 columns at 8 warps (32 programs) 44.76, with 2
#: stages 59.17; 16 / 24 / 64 pieces 43.32 / 43.19 / 43.56 against 43.04; the output kernel (not fused) on the
#: state stream or on the caller's stream one piece late instead of a third stream: within 0.6 ms of it.
#: merge_wq: the fused pass forms Wk S and QG S as one [128, K] x [K, BV] product (_fwd_h_kernel MERGE_WQ), one wgmma
#: wait fewer on the chain per chunk (3 instead of 4); ptxas sm_90a: 234 registers without a cap, 96 B of stack
#: under the cap of 192.  H200, 24th session, forward ms at H = 16 (64K / 1M, `--only mtc`): default 2.44 /
#: 35.33, merged with the cap 2.72 / 40.11, merged without the cap (kept: maxnreg None) 2.36 / 34.37; the chain
#: took 0.9 ms a piece after it (timeline), the intra work ~1.05: the intra kernels are the critical path again.
#: Dropped in the same session (1M ms): the pieces' intra kernels alternating over two streams, each with its own
#: scratch, 36.08 against 35.33 (39.98 with merge_wq against 34.37); the cumsum kernel over 2-8 chunks per
#: program with its loads pipelined over 2-3 stages, 34.60-36.93 against 34.01; the pass at 64 columns and 8
#: warps (32 programs), 41.06 against 34.18 (39.23 against 32.41 with head-major intra grids).
PIPE_CFG = dict(on=True, min_chunks=1024, piece_chunks=256, max_pieces=32, state_priority=True, bv=32, fuse_o=True,
                maxnreg=None, merge_wq=True)
_SIDE_STREAMS: dict = {}


def _pipeline_pieces(tab, pipeline, dev, H, V, BV):
    """(chunk ranges [(a, b), ...], state columns per program) of the pipelined forward, or None where it does
    not apply: autograd on, not the v5 intra kernels, not one unsplit sequence of at least
    PIPE_CFG["min_chunks"] chunks, or a state pass that would hold more than half of the SMs (H x V / columns
    programs, one per SM, with the columns PIPE_CFG["bv"] or wider: at H = 96 the chain fills the GPU, and
    the 18th session's run had the pipeline 1% slower there).  (Under the interpreter the pieces run one after
    another on the CPU: the tests check the piece bookkeeping there.)"""
    cfg, NC = PIPE_CFG, tab["n_chunks"]
    if (not pipeline or not cfg.get("on") or (dev.type != "cuda" and not _interpret()) or INTRA_IMPL != "v5"
            or tab["n_seq"] != 1 or tab["n_seg"] != 1 or NC < max(2, int(cfg["min_chunks"]))):
        return None
    bv = min(V, int(cfg.get("bv") or BV))
    if dev.type == "cuda":
        while bv < V and H * (V // bv) > sm_count(dev) // 2:
            bv *= 2
        if H * (V // bv) > sm_count(dev) // 2:
            return None
    P = max(2, min(int(cfg["max_pieces"]), NC // max(1, int(cfg["piece_chunks"]))))
    edges = [NC * i // P for i in range(P + 1)]
    return list(zip(edges[:-1], edges[1:])), bv


def _side_streams(dev):
    """(state stream, output stream) of the pipelined forward on this device, made once."""
    key = (dev.index if dev.index is not None else torch.cuda.current_device(), bool(PIPE_CFG.get("state_priority")))
    if key not in _SIDE_STREAMS:
        hi = torch.cuda.Stream.priority_range()[1] if key[1] else 0
        _SIDE_STREAMS[key] = (torch.cuda.Stream(dev, priority=hi), torch.cuda.Stream(dev))
    return _SIDE_STREAMS[key]


def _fwd_pipelined(q2, k2, v2, g2, b2, scale, h0, tab, fast, lb, BV, pieces, H, K, V, idt, WK, U, QG, KD, AQK, GAM, o):
    """The v5 forward of one sequence as a three-stream pipeline over its pieces (chunk ranges (a, b)), with BV
    state columns per program of the state pass.

    The intra-chunk kernels (cumsum, strips, solve, w/u: independent per chunk, bandwidth- and issue-bound) of
    piece p run on the caller's stream; the serial state pass of piece p (BH x V/BV programs, latency-bound:
    at H = 16 one 4-warp program per SM that waits on its two dependent products each chunk) runs on a
    high-priority side stream as soon as piece p's intra work is done, from piece p-1's final state; the
    output kernel of piece p on a third stream after it, or with PIPE_CFG["fuse_o"] (the default) inside the
    state pass itself (_fwd_h_kernel FUSE_O: no HB / VN written).  So the chain overlaps the next pieces' intra
    work instead of running after all of it.  Same arithmetic as the one-stream forward (with the same state
    columns per program, PIPE_CFG["bv"]): the result is the same bit for bit (H200: fused too).  The caller's stream
    waits for both side streams before return, so the scratch tensors are free for it to reuse.
    Returns (final state [1, H, K, V] float32, entry state S_IN [1, H, K, V])."""
    dev = q2.device
    N, NC = q2.shape[0], tab["n_chunks"]
    P = len(pieces)
    cuda = dev.type == "cuda"
    main = torch.cuda.current_stream(dev) if cuda else None
    s_state, s_o = _side_streams(dev) if cuda else (None, None)

    def on(stream, after):
        """Run the next launches on `stream` once the work queued on `after` is done (CPU: in order)."""
        if not cuda:
            return contextlib.nullcontext()
        stream.wait_stream(after)
        return torch.cuda.stream(stream)

    kgb = bool(INTRA5_CFG.get("kgb"))
    # the intra kernels' scratch holds one piece (the caller's stream orders the pieces' use of it); each piece's
    # intra launches see token-indexed views that start at the piece's first token, with the chunk starts
    # relative to it (0, 64, 128, ...: one table for every piece of the one sequence)
    rows = max(b - a for a, b in pieces) * CHUNK
    NBUF, GCS, FB, TB, _ = _intra5_scratch(rows, NC, H, K, idt, False, dev)
    fuse_o = bool(PIPE_CFG.get("fuse_o"))
    HB = torch.empty(1 if fuse_o else NC, H, K, V, dtype=idt, device=dev)
    VN = torch.empty(1 if fuse_o else N, H, V, dtype=idt, device=dev)
    S = torch.empty(P + 1, H, K, V, dtype=torch.float32, device=dev)     # S[p]: the state entering piece p
    if h0 is None:
        S[0].zero_()
    else:
        S[0].copy_(h0.reshape(H, K, V))
    s0, e0 = tab["seq_bounds"][0]
    cst, cln = tab["cstart"], tab["clen"]
    pt = _TABLE_CACHE.get(("pieces", str(dev), s0, e0, tuple(pieces)), lambda: device_table(np.asarray(
        [[s0 + a * CHUNK for a, _ in pieces], [min(e0, s0 + b * CHUNK) for _, b in pieces],
         [a for a, _ in pieces], [b for _, b in pieces]], dtype=np.int32), torch.int32, dev), dev)
    rel = _TABLE_CACHE.get(("piece starts", str(dev), rows), lambda: device_table(
        np.arange(0, rows, CHUNK, dtype=np.int32), torch.int32, dev), dev)
    BVO = min(V, 128)
    nst = _pass_stages(V // BV * H, dev)
    merge_wq = fuse_o and bool(PIPE_CFG.get("merge_wq"))
    for p, (a, b) in enumerate(pieces):
        n, t = b - a, s0 + a * CHUNK
        _intra5_launch(q2[t:], k2[t:], g2[t:], b2[t:], rel[:n], cln[a:b], n, H, K, scale, lb, fast, idt, QG[t:],
                       KD[t:], AQK[t:], GAM[a:b], FB[a:b], NBUF, GCS, TB, None, WK[t:] if kgb else None, marks=False)
        _wu5_launch(k2[t:], v2[t:], b2[t:], rel[:n], cln[a:b], n, H, K, V, idt, GCS, TB, WK[t:], U[t:], kgb)
        with on(s_state, main):
            _fwd_h_kernel[(V // BV, H, 1)](WK, U, KD, GAM, VN, HB, S[p], S[p + 1], pt[0, p:], pt[1, p:], pt[2, p:],
                                           pt[3, p:], H, K=K, V=V, BV=BV, SW=V, MODE=0, STORE=not fuse_o,
                                           STORE_VN=not fuse_o, QG=QG, AQK=AQK, O=o, FUSE_O=fuse_o,
                                           MERGE_WQ=merge_wq, num_warps=H_CFG["num_warps"], num_stages=nst,
                                           **_maxnreg(PIPE_CFG.get("maxnreg")))
        if not fuse_o:
            with on(s_o, s_state):
                _fwd_o_kernel[(n, H, V // BVO)](QG, AQK, VN, HB[a:b], o, cst[a:b], cln[a:b], H, K=K, V=V,
                                                BV=BVO, num_warps=4, num_stages=1)
    if cuda:
        main.wait_stream(s_o)
        main.wait_stream(s_state)
    _mark("pipelined forward")
    return S[P:P + 1], S[0:1]


def _fwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, keep_t=False, pipeline=False):
    """The forward. keep_t (BWD_IMPL "v2" under autograd): also return T and Bm of every chunk ((TB, BM),
    float32 [N, H, 64] each) for the backward, from the v5 intra kernels (other intra implementations: None,
    the backward recomputes them).  pipeline (no autograd): one long sequence runs as _fwd_pipelined."""
    if INTRA_IMPL not in ("v2", "v3", "v4", "v5"):
        raise ValueError(f"backends.triton.kda.INTRA_IMPL must be 'v2', 'v3', 'v4' or 'v5', got {INTRA_IMPL!r}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B * T
    dev = q.device
    idt = _interm_dtype(q)
    q2, k2, g2 = q.reshape(N, H, K), k.reshape(N, H, K), g.reshape(N, H, K)
    v2, b2 = v.reshape(N, H, V), beta.reshape(N, H)
    NC = tab["n_chunks"]
    WK = torch.empty(N, H, K, dtype=idt, device=dev)
    QG, KD = torch.empty_like(WK), torch.empty_like(WK)
    U = torch.empty(N, H, V, dtype=idt, device=dev)
    AQK = torch.empty(N, H, 64, dtype=idt, device=dev)
    GAM = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    kept = None
    _mark("start")
    plan = _pipeline_pieces(tab, pipeline and not keep_t, dev, H, V, BV)
    if plan is not None:
        o = torch.empty(N, H, V, dtype=v.dtype, device=dev)
        final, S_IN = _fwd_pipelined(q2, k2, v2, g2, b2, scale, h0, tab, fast, lb, plan[1], plan[0], H, K, V, idt,
                                     WK, U, QG, KD, AQK, GAM, o)
        return o.view(B, T, H, V), final, (WK, U, QG, KD, AQK, GAM, S_IN), None
    if NC and INTRA_IMPL == "v3":
        for part in ((1, 2) if INTRA3_CFG["split"] else (0,)):
            _fwd_intra3_kernel[(NC, H)](q2, k2, v2, g2, b2, tab["cstart"], tab["clen"], WK, U, QG, KD, AQK, GAM,
                                        scale, lb, H, K=K, V=V, BK=min(K, INTRA3_CFG["BK"]),
                                        BV=min(V, INTRA3_CFG["BV"]), FAST=fast, DT=_TL[idt], PART=part,
                                        num_warps=INTRA3_CFG["num_warps"], num_stages=INTRA3_CFG["num_stages"],
                                        **_maxnreg(INTRA3_CFG.get("maxnreg")))
        _mark("intra")
        _mark("w/u")
    elif NC and INTRA_IMPL == "v5":
        kgb = bool(INTRA5_CFG.get("kgb"))
        TB, GCS, BM = _intra5(q2, k2, g2, b2, tab, H, K, scale, lb, fast, idt, QG, KD, AQK, GAM, keep_t,
                              KGB=WK if kgb else None)
        _wu5_launch(k2, v2, b2, tab["cstart"], tab["clen"], NC, H, K, V, idt, GCS, TB, WK, U, kgb)
        del GCS
        if keep_t:
            kept = (TB, BM)
        del TB
    elif NC and INTRA_IMPL == "v4":
        cfg = INTRA4_CFG
        NBUF = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
        if cfg.get("tiles"):
            _fwd_tiles4_kernel[(NC, H, 4)](q2, k2, g2, b2, tab["cstart"], tab["clen"], NBUF, QG, KD, AQK, GAM,
                                           scale, lb, H, K=K, BK=min(K, cfg["BK"]), FAST=fast, DT=_TL[idt],
                                           num_warps=cfg["nw_strip"], num_stages=cfg["ns_strip"],
                                           **_maxnreg(cfg.get("maxnreg")))
        else:
            r_fast = bool(cfg.get("r_fast"))
            _fwd_strip4_kernel[(4 * NC, H, 1) if r_fast else (NC, H, 4)](
                q2, k2, g2, b2, tab["cstart"], tab["clen"], NBUF, QG, KD, AQK, GAM, scale, lb, H, K=K,
                BK=min(K, cfg["BK"]), FAST=fast, DT=_TL[idt], R_FAST=r_fast, num_warps=cfg["nw_strip"],
                num_stages=cfg["ns_strip"], **_maxnreg(cfg.get("maxnreg")))
        _mark("intra: strip")
        TB = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
        _fwd_solve4_kernel[(NC, H)](NBUF, tab["cstart"], tab["clen"], TB, H, PREC=_solve_prec(cfg),
                                    num_warps=cfg["nw_solve"],
                                    num_stages=1)
        del NBUF
        _mark("intra: solve")
        _fwd_wu_kernel[(NC, H)](k2, v2, g2, b2, tab["cstart"], tab["clen"], TB, WK, U, H, K=K, V=V,
                                DT=_TL[idt], CUMSUM=False, num_warps=cfg["nw_wu"], num_stages=1)
        del TB
    elif NC:
        TB = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
        _fwd_intra2_kernel[(NC, H)](q2, k2, v2, g2, b2, tab["cstart"], tab["clen"], TB, QG, KD, AQK, GAM,
                                    scale, lb, H, K=K, V=V, FAST=fast, DT=_TL[idt], num_warps=8, num_stages=1)
        _mark("intra")
        _fwd_wu_kernel[(NC, H)](k2, v2, g2, b2, tab["cstart"], tab["clen"], TB, WK, U, H, K=K, V=V,
                                DT=_TL[idt], num_warps=8, num_stages=1)
        del TB
    _mark("w/u")
    S_IN = _entry_states(WK, U, QG, KD, AQK, GAM, h0, tab, H, K, V, BV, dev, mode_bwd=False)
    _mark("segment maps+combine")
    o = torch.empty(N, H, V, dtype=v.dtype, device=dev)
    HB, VN, S_OUT = _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, store_vn=True)
    _mark("state pass")
    if NC:
        BVO = min(V, 128)
        hm = _head_major(NC)
        _fwd_o_kernel[_ch_grid(NC, H, hm, Z=V // BVO)](QG, AQK, VN, HB, o, tab["cstart"], tab["clen"], H, K=K, V=V,
                                                       BV=BVO, HM=hm, num_warps=4, num_stages=1)
    _mark("o")
    del VN, HB
    final = S_OUT.index_select(0, tab["last_seg"])
    saved = (WK, U, QG, KD, AQK, GAM, S_IN)
    return o.view(B, T, H, V), final, saved, kept


# launch configuration of the serial state kernel (the benchmark may override it for a sweep).
# Tried and dropped (H200, 2026-11-30): forming the output inside this pass (no HB / VN written, 1.5 KB per token
# and head less traffic) took as long as the two kernels it replaced (H=16, 1M: 16.15 ms vs 9.46 + 6.44; H=96,
# 64K: 6.30 vs 4.02 + 2.48): the pass is latency-bound and the extra loads and products lengthen each step.
# stages_one_wave / w_one_wave: pipeline stages and modelled step cost (us) of a pass whose programs fit one per SM
# (_pass_stages, _seg_chunks_for); one_wave_grad: let forwards under autograd use that model too (off: they keep
# the split model, which the backward's passes were tuned with).  H200, 11th session, H=16, T=1M forward sweep:
# 2 stages unsplit 65.1 ms, split (33 segments) 61.7; 3 stages unsplit 58.6, split into 8 59.5.
H_CFG = dict(num_warps=4, num_stages=2, ctas_per_sm=2, bv="auto", stages_one_wave=3, w_one_wave=1.1,
             one_wave_grad=False)
# (A "transposed" state pass, the state held as S^T [BV, K] so that each of the chain's two products takes the
# chain's value as its register operand (12th session; sm_90a at BV 16: mma.sync instead of wgmma, 976 against 1064
# SASS instructions), was timed in the 13th session and removed: forward at H=16 3.55 -> 4.18 ms at 64K and
# 56.0 -> 66.2 at 1M, H=96 64K 18.78 -> 18.96 (benchmarks/kda.py --alt, H200).)
# bv: state columns per program of the serial passes (forward state pass and the backward's dS chain): 32, 64, or
# "auto" = 64 when 32-column programs (sequences x heads x V / 32) would not fit one wave of slots unsplit.  At
# H=96, K=V=128 on the H200: 384 programs on 264 slots, i.e. two waves of the whole serial chain (state pass 0.51 ms
# of the 2.53 ms forward at T=8192, 4.02 of 20.0 at 64K), against 192 programs in one wave at 64 columns.  H200
# (9th session, benchmarks/kda.py --alt "H_CFG:bv='auto'", forward beside fla): H=96 8K 2.509 -> 2.388 ms (state
# pass 0.51 -> 0.39), H=96 64K 20.17 -> 19.34; H=16 unchanged (auto keeps 32 columns there). ptxas sm_90a at 64
# columns (8th session): state pass 254 registers, no spills, 96 KB shared (2 CTAs per SM fit); backward dS chain
# 255 registers, 108 B of spills.


def _value_block(BH, V, slots, sms=None, grad=True):
    """BV for H_CFG["bv"] (16, 32, 64 or "auto"; slots = SMs x ctas_per_sm, None off the GPU: 32).

    "auto" without autograd (grad False, sms = the SM count): 16 when 16-column programs fit one per SM (the
    unsplit pass is latency-bound; H200, 11th session, H=16, T=1M forward unsplit: 55.4 ms at 16 columns, 58.6
    at 32, 69.7 at 64).  With autograd the backward's dS chain shares BV and keeps the rule below."""
    bv = H_CFG.get("bv", 32)
    if bv == "auto":
        if not grad and sms is not None and V >= 16 and BH * (V // 16) <= sms:
            bv = 16
        else:
            bv = 64 if slots is not None and V >= 64 and BH * (V // 32) > slots else 32
    if bv not in (16, 32, 64):
        raise ValueError(f"backends.triton.kda.H_CFG['bv'] must be 16, 32, 64 or 'auto', got {bv!r}")
    return min(bv, V)

# which backward runs the state-gradient chain: "v2" (default) = _bwd_dh_kernel, the serial reverse chain of dS
# alone with V split into BV-column programs (like the forward's state pass), then _bwd_chunk_kernel, the
# per-chunk products that sum over V, for every chunk at once; "v1" = _bwd_state_kernel MODE 0, one program
# per (segment, head) over all of V that does both on the serial path (H200, H=16, 64K: 4.1 ms for v1's state
# kernel against 1.2 + 1.3 ms for v2's two). v2 also splits the intra-chunk backward into _bwd_ut_kernel (UT
# transform, per chunk) and _bwd_pair_kernel (decay products, per channel slice); v1 runs _bwd_intra_kernel.
# H200 fwd+bwd at H=16 (6th session): v1 5.05 / 39.0 ms at 8K / 64K, v2 2.29 / 16.9, fla 2.27 / 17.5.
BWD_IMPL = "v2"
# launch configuration of _bwd_dh_kernel: per step it loads A, dO, KD, QG, Wk and HB (~68 KB at K=V=128, BV=32),
# so a 2-stage pipeline needs ~132 KB of shared memory and allows one CTA per SM; 1 stage allows three
BWD_DH_CFG = dict(num_warps=4, num_stages=1)
# launch configuration of the v2 intra backward: warps of _bwd_ut_kernel, channel slice and warps of
# _bwd_pair_kernel. H200 (6th session, H=16, fwd+bwd; pair kernel phase at 8K / 64K): BK 32 / 4 warps 0.90 /
# 6.96 ms, BK 64 / 8 warps 1.10 / 8.62, BK 16 / 4 warps 1.85 / 14.5, BK 32 / 8 warps 2.00 / 15.9 (v1's single
# intra kernel: 3.67 / 29.1 ms, 8.5 KB of register spills per thread). ptxas sm_90a, BK 32 / 4 warps: 244
# registers, no spills; ut kernel at 8 warps: none
BWD_INTRA_CFG = dict(nw_ut=8, BK=32, nw_pair=4)
# _bwd_chunk_kernel takes V in column blocks of BWD_CHUNK_KV // K (K = V = 128: one block, 64 KB of shared
# memory; K = V = 256 at once would need 256 KB, over the H200's 227)
BWD_CHUNK_KV = 128 * 128


def _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, store_vn):
    """Chunk-entry states HB [NC, H, K, V] (idt), new values VN [N, H, V] (idt, or None) and the state after
    each segment S_OUT [NS, H, K, V] float32, from the segment entry states S_IN."""
    dev = WK.device
    NC, NS = tab["n_chunks"], tab["n_seg"]
    HB = torch.empty(max(NC, 1), H, K, V, dtype=idt, device=dev)
    VN = torch.empty(U.shape, dtype=idt, device=dev) if store_vn else HB
    S_OUT = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    _fwd_h_kernel[(V // BV, H, NS)](WK, U, KD, GAM, VN, HB, S_IN, S_OUT, tab["seg_t0"], tab["seg_t1"],
                                    tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=BV, SW=V, MODE=0, STORE=True,
                                    STORE_VN=store_vn,
                                    num_warps=H_CFG["num_warps"], num_stages=_pass_stages(V // BV * H * NS, dev))
    return HB, (VN if store_vn else None), S_OUT


def _entry_states(WK, U, QG, KD, AQK, GAM, h0, tab, H, K, V, BV, dev, mode_bwd, DO=None):
    """Entry state of every segment (forward) or dS at every segment end (backward, h0 = dS_final)."""
    NS, NQ = tab["n_seg"], tab["n_seq"]
    if not tab["segmented"]:
        if h0 is None:
            return torch.zeros(NS, H, K, V, dtype=torch.float32, device=dev)
        return h0.float().index_select(0, tab["seg_seq"]).contiguous()
    BA = 64 if (K + V) % 64 == 0 else math.gcd(K, V)
    MD = torch.empty(NS, H, K, K + V, dtype=torch.float32, device=dev)
    grid = (NS, H, (K + V) // BA)
    if not mode_bwd:
        B1 = min(BV, K)                      # divides K and V (powers of two), hence K + V
        _fwd_h_kernel[((K + V) // B1, H, NS)](WK, U, KD, GAM, MD, MD, MD, MD, tab["seg_t0"], tab["seg_t1"],
                                              tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=B1, SW=K + V, MODE=1,
                                              STORE=False, STORE_VN=False, num_warps=H_CFG["num_warps"],
                                              num_stages=_pass_stages((K + V) // B1 * H * NS, dev))
    else:
        _bwd_state_kernel[grid](WK, U, QG, KD, AQK, GAM, DO, MD, MD, MD, MD, MD, MD, MD, MD, MD,
                                tab["cstart"], tab["clen"], tab["seg_c0"], tab["seg_c1"], H, K=K, V=V,
                                BV=BA, SW=K + V, MODE=1, num_warps=4, num_stages=2)
    S_ENTRY = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    S_FIN = torch.empty(NQ, H, K, V, dtype=torch.float32, device=dev)
    init = h0.float().contiguous() if h0 is not None else S_FIN
    _combine_kernel[(NQ, H, V // BV)](MD, init, S_ENTRY, S_FIN, tab["seq_s0"], tab["seq_s1"], H, K=K, V=V,
                                      BV=BV, HAS_INIT=h0 is not None, REVERSE=mode_bwd,
                                      PREC="ieee" if _interpret() else "tf32x3", num_warps=8)
    return S_ENTRY


def _bwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, saved, do, dht, kept=None):
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B * T
    dev = q.device
    idt = _interm_dtype(q)
    WK, U, QG, KD, AQK, GAM, S_IN = saved
    NC, NS = tab["n_chunks"], tab["n_seg"]
    # chunk-start states, recomputed from the saved segment entry states (never kept from the forward)
    _mark("bwd: start")
    HB, _, _ = _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, store_vn=False)
    _mark("bwd: state pass")
    do2 = do.reshape(N, H, V).contiguous()
    dS_end = _entry_states(WK, U, QG, KD, AQK, GAM, dht, tab, H, K, V, BV, dev, mode_bwd=True, DO=do2)
    DU = torch.empty(N, H, V, dtype=idt, device=dev)
    DWK = torch.empty(N, H, K, dtype=idt, device=dev)
    DQG, DKD = torch.empty_like(DWK), torch.empty_like(DWK)
    DAQK = torch.empty(N, H, 64, dtype=idt, device=dev)
    DGAM = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    DS0 = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    _mark("bwd: dS at segment ends")
    if BWD_IMPL == "v1":
        _bwd_state_kernel[(NS, H, 1)](WK, U, QG, KD, AQK, GAM, do2, HB, dS_end, DS0, DU, DWK, DQG, DKD, DAQK,
                                      DGAM, tab["cstart"], tab["clen"], tab["seg_c0"], tab["seg_c1"], H, K=K, V=V,
                                      BV=V, SW=V, MODE=0, num_warps=8, num_stages=1)
        _mark("bwd: state grads")
    elif BWD_IMPL == "v2":
        BVD = min(BV, V)
        NVB = V // BVD
        DHB = torch.empty_like(HB)
        DGP = torch.empty(max(NC, 1), H, NVB, K, dtype=torch.float32, device=dev)
        _bwd_dh_kernel[(NVB, H, NS)](QG, WK, KD, AQK, GAM, do2, HB, dS_end, DHB, DU, DGP, DS0, tab["seg_t0"],
                                     tab["seg_t1"], tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=BVD,
                                     num_warps=BWD_DH_CFG["num_warps"], num_stages=BWD_DH_CFG["num_stages"])
        _mark("bwd: dS chain")
        torch.sum(DGP, dim=2, out=DGAM)
        del DGP
        if NC:
            hm = _head_major(NC)
            _bwd_chunk_kernel[_ch_grid(NC, H, hm)](
                WK, U, QG, AQK, do2, HB, DHB, DU, DWK, DQG, DKD, DAQK, tab["cstart"], tab["clen"], H, K=K, V=V,
                BVC=min(V, max(16, BWD_CHUNK_KV // K)), HM=hm, num_warps=8, num_stages=1)
        del DHB, HB
        _mark("bwd: chunk grads")
    else:
        raise ValueError(f"backends.triton.kda.BWD_IMPL must be 'v1' or 'v2', got {BWD_IMPL!r}")
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    db = torch.empty_like(beta)
    if NC and BWD_IMPL == "v1":
        _bwd_intra_kernel[(NC, H)](q.reshape(N, H, K), k.reshape(N, H, K), v.reshape(N, H, V), g.reshape(N, H, K),
                                   beta.reshape(N, H), tab["cstart"], tab["clen"], DU, DWK, DQG, DKD, DAQK, DGAM,
                                   dq, dk, dv, dg, db, scale, lb, H, K=K, V=V, FAST=fast, DT=_TL[idt], num_warps=8,
                                   num_stages=1)
    elif NC:
        q2, k2, v2, g2, b2 = (q.reshape(N, H, K), k.reshape(N, H, K), v.reshape(N, H, V), g.reshape(N, H, K),
                              beta.reshape(N, H))
        if kept is None:
            # T and Bm were not kept by the forward (another intra implementation): the v5 kernels again,
            # their other outputs into scratch
            scratch = (torch.empty_like(QG), torch.empty_like(KD), torch.empty_like(AQK), torch.empty_like(GAM))
            TB, _, BM = _intra5(q2, k2, g2, b2, tab, H, K, scale, lb, fast, idt, *scratch, True)
            del scratch
        else:
            TB, BM = kept
        DB = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
        DKG = torch.empty(N, H, K, dtype=torch.float32, device=dev)
        hm = _head_major(NC)
        _bwd_ut_kernel[_ch_grid(NC, H, hm)](k2, v2, g2, b2, tab["cstart"], tab["clen"], TB, BM, DU, DWK, DB, DKG, dv,
                                            db, H, K=K, V=V, DT=_TL[idt], HM=hm, num_warps=BWD_INTRA_CFG["nw_ut"],
                                            num_stages=1)
        del TB, BM, kept, DU, DWK      # (TB and BM live on in the autograd context when the forward kept them)
        _mark("bwd: ut")
        BK = min(K, BWD_INTRA_CFG["BK"])
        for safe in ((False, True) if fast else (True,)):
            _bwd_pair_kernel[_ch_grid(NC, H, hm, K // BK)](
                q2, k2, g2, b2, tab["cstart"], tab["clen"], DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk, dg, scale, lb, H,
                K=K, BK=BK, FAST=fast, DT=_TL[idt], SAFE=safe, HM=hm, num_warps=BWD_INTRA_CFG["nw_pair"],
                num_stages=1)
    _mark("bwd: intra")
    dh0 = DS0.index_select(0, tab["first_seg"]) if h0 is not None else None
    return dq, dk, dv, dg, db, dh0


class _KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, tab, fast, lb, BV, grad):
        # grad: autograd was on at the call and an input needs a gradient (inside forward grad mode is off,
        # and needs_input_grad says True under no_grad too)
        keep = BWD_IMPL == "v2" and INTRA_IMPL == "v5" and tab["n_chunks"] > 0 and grad
        o, final, saved, kept = _fwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, keep_t=keep, pipeline=not grad)
        kept = kept or ()
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved, *kept)
        ctx.n_kept = len(kept)
        ctx.meta = (scale, tab, fast, lb, BV)
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        no_create_graph("backends.triton.kda_chunk")
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        kept = tuple(saved[len(saved) - ctx.n_kept:]) if ctx.n_kept else None
        saved = saved[:len(saved) - ctx.n_kept]
        scale, tab, fast, lb, BV = ctx.meta
        if dht is not None:
            dht = dht.float().contiguous()
        dq, dk, dv, dg, db, dh0 = _bwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, saved,
                                       do.contiguous(), dht, kept)
        return dq, dk, dv, dg, db, dh0, None, None, None, None, None, None


@on_tensor_device
def kda_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, lower_bound=None, segment_chunks=None, check_finite=None):
    """Kimi Delta Attention, chunked WY/UT algorithm as Triton kernels, differentiable (torch.autograd).

    Args:
        q, k: [B, T, H, K] (float32/float16/bfloat16); K <= 256 (a power of two >= 16 runs as is; other sizes
            are zero-padded to the next one, which costs the padded size).
        v: [B, T, H, V] (float32/float16/bfloat16); V <= 256 (padded likewise).  q, k, v of different dtypes
            run in their promoted dtype (a cast of each), o is in v's dtype.
        g: [B, T, H, K] log decay (<= 0), float32 recommended (any float dtype).
        beta: [B, T, H] in (0, 1).
        scale: default K ** -0.5.
        initial_state: [N_seq, H, K, V] float32 or None.
        output_final_state: also return the state after each sequence.
        cu_seqlens: int [N_seq+1] packed variable-length offsets (then B == 1).  Read on the host once.
        lower_bound: None (default: no bound promised; every diagonal 16x16 tile takes the safe
            token-pair path, right for any g <= 0, e.g. the softplus gate) or a float L with
            L < 0 promised by the gate (kda_gate's sigmoid form): with FAST_LOWER_BOUND_LIMIT (-10) <= L the
            diagonal tiles are dense tensor-core dots (a lower L runs the safe path: same result, slower).  The promise is checked per chunk inside the
            kernel (min of g); a chunk that breaks it takes the safe path, so the result is right anyway.
            float16 q/k/v: the dense tiles need L >= FP16_FAST_LOWER_BOUND_LIMIT (-1.25; e^(8 |L|) must
            fit float16); a lower L runs the safe path everywhere (same result, slower).  bf16 / float32: a
            32-row pair whose G falls by at most 161 in every channel (every pair at L >= -5) is one dense
            32-row tile.  That tile scales q and k by up to e^80.5; where that overflows (|q| or |k| entries
            beyond ~3e3), the pair is redone as two 16-row tiles (up to e^40.5 at L = -5; e^80 at L = -10).
        segment_chunks: chunks per segment for the long-context split (None: chosen from the GPU size;
            a huge value disables it).  The result does not depend on it beyond rounding.
        check_finite: scan the inputs for NaN/inf and g for values > 0 first (reductions and a host sync;
            ValueError naming the input, as the reference).  None (default): on for CPU tensors (the
            interpreter; the scan costs nothing beside it), off on the GPU, so that a call never waits for
            the GPU (at T = 1M, H = 16 the scan would read 8.6 GB of g): there NaN in -> NaN out (never a
            hang), and g > 0 or g = -inf (outside the contract g in (-inf, 0]) give NaN or huge values, not
            an error.  Pass True to check on the GPU too.  When it scans, it also checks the result: inf / NaN
            from finite inputs (a diverging recurrence, beta ||k||^2 > 2: a RuntimeWarning names the first such
            token before the run) is a ValueError, as in the reference; and g below a promised lower_bound gets
            the reference's RuntimeWarning naming the first such token (check_lower_bound_kept).

    Returns:
        (o [B, T, H, V] in v's dtype, final_state [N_seq, H, K, V] float32 or None).

    Accuracy: float32 inputs agree with the reference to ~1e-6 relative for gates in [-5, 0].  The in-chunk
    cumulative gate G is float32, so channels whose decay alternates between strong and near-zero lose more
    (CPU, T = 130, g either lo or -1e-4 per token: relative error of o 5e-6 at lo = -5, 1.4e-5 at -20, 1.1e-4 at
    -80, reachable with the softplus gate; the reference forms G in float64 there).  16-bit inputs: ~4e-3.

    Streams: without autograd, one sequence of at least PIPE_CFG["min_chunks"] chunks (64K tokens) runs as a
    pipeline over the caller's stream and two side streams of this module (the serial state chain beside
    the parallel work; same result bit for bit, see the module docstring).  The caller's stream waits for
    both before the call returns, so the result is ordered on it as usual, and a CUDA-graph capture takes the
    side streams in.  Set ``PIPE_CFG["on"] = False`` for one stream.

    Math: Kimi Linear (arXiv 2510.26692) eqs. 1-8, spec/OPS.md "kda_chunk"; see the module docstring for
    the kernel decomposition.  Raises TypeError/ValueError on bad dtypes/shapes (same checks as the
    reference), on a lower_bound that is not a finite number < 0, and on K or V above 256.
    """
    where = "triton.kda_chunk"
    B, T, H, K, V, bounds, n_seq = _ref._validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, where)
    output_final_state = check_flag(output_final_state, "output_final_state", where)
    check_kernel_dtype(where, q=q, k=k, v=v)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        # the kernels take one dtype: q, k, v in their promoted one (float16 with bfloat16: float32), o in v's
        # dtype as OPS.md asks (the reference computes in float32 whatever they are)
        pdt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        o, final = kda_chunk(q.to(pdt), k.to(pdt), v.to(pdt), g, beta, scale=scale, initial_state=initial_state,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens, lower_bound=lower_bound,
                             segment_chunks=segment_chunks, check_finite=check_finite)
        return o.to(v.dtype), final
    check_interpreter_dot_dtype(where, q=q)
    if K > 256 or V > 256:
        raise ValueError(f"{where}: K and V must be at most 256 (the chunk kernels hold [64, K] and [K, V] tiles); "
                         f"got K={K}, V={V}")
    if lower_bound is not None:
        lb = _ref.check_lower_bound_type(lower_bound, where)
        if not -math.inf < lb < 0:
            raise ValueError(f"{where}: lower_bound must be a finite number < 0 or None, got {lower_bound!r}")
        # the dense diagonal tiles hold e^(8 |L|): past L = -10 that leaves float32's range, and float16 tiles
        # cannot hold it past L = -1.25 (NaN / inf otherwise): the safe path then (the same result, slower)
        fast = lb >= FAST_LOWER_BOUND_LIMIT and not (q.dtype == torch.float16 and lb < FP16_FAST_LOWER_BOUND_LIMIT)
    else:
        lb, fast = 0.0, False
    check_kernel_device(where, q=q)      # (before the value scan: meta tensors have no values to scan)
    scan = scan_values(check_finite, q)
    if scan:
        _ref.check_inputs_finite_and_decay(q, k, v, g, beta, where)
        if initial_state is not None:
            _ref._check_finite("initial_state", initial_state, where)
        _ref.check_lower_bound_kept(g, lower_bound, where)
    if not (_pow2(K) and _pow2(V)):
        # the kernels take powers of two >= 16: zero channels / value columns (q = k = 0, g = 0, v = 0, a zero
        # state) change nothing in the others and stay zero; the scale stays that of the real K
        KP, VP = max(16, next_power_of_2(K)), max(16, next_power_of_2(V))
        pk, pv = (0, KP - K), (0, VP - V)
        h0 = initial_state
        if h0 is not None:
            h0 = torch.nn.functional.pad(h0, (0, VP - V, 0, KP - K))
        o, final = kda_chunk(*(torch.nn.functional.pad(t, pk) for t in (q, k)),
                             torch.nn.functional.pad(v, pv), torch.nn.functional.pad(g, pk), beta,
                             scale=K ** -0.5 if scale is None else scale, initial_state=h0,
                             output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                             lower_bound=lower_bound, segment_chunks=segment_chunks,
                             check_finite=False)     # (scanned above, when asked or on the CPU)
        # (contiguous, like the unpadded result, not a view into the padded one)
        o, final = o[..., :V].contiguous(), (final[:, :, :K, :V].contiguous() if final is not None else None)
        if scan:
            _ref.check_result_finite(o, final, k, beta, where)
        return o, final
    if segment_chunks is not None and (isinstance(segment_chunks, bool)
                                       or not isinstance(segment_chunks, numbers.Integral) or segment_chunks < 1):
        raise ValueError(f"{where}: segment_chunks must be a positive int or None, got {segment_chunks!r}")
    scale = K ** -0.5 if scale is None else float(scale)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, g, beta, initial_state))
    sms = sm_count(q.device) if q.is_cuda else None
    BV = _value_block(n_seq * H, V, sms * H_CFG["ctas_per_sm"] if sms else None, sms, grad=grad)
    n_longest = max(((e - s + CHUNK - 1) // CHUNK for (s, e) in bounds), default=0) if bounds else \
        (T + CHUNK - 1) // CHUNK
    seg = _seg_chunks_for(n_longest, n_seq * H, K, V, BV, q.device, segment_chunks,
                          grad=grad and not H_CFG.get("one_wave_grad"))
    tab = _tables(B, T, bounds if cu_seqlens is not None else None, seg, q.device)
    qc, kc, vc, gc, bc = (t.contiguous() for t in (q, k, v, g, beta))
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    o, final = _KDAFunction.apply(qc, kc, vc, gc, bc, h0, scale, tab, fast, lb, BV, grad)
    final = final if output_final_state else None
    if scan:
        _ref.check_result_finite(o, final, k, beta, where)
    return o, final


def forward_workspace(B, T, H, K, V, elem, sms=132):
    """Bytes the forward without autograd allocates inside one kda_chunk call beyond its output o (B sequences
    of T tokens, elem bytes per element of q, k, v; sms: the GPU's SM count, the H200's by default): the
    per-token intermediates WK, QG, KD [N, H, K], U [N, H, V], AQK [N, H, 64] and the chunk gates GAM, plus
    the larger of the v5 intra kernels' scratch (NBUF, GCS, TB: _intra5_scratch) and the state pass's HB
    [NC, H, K, V] and VN [N, H, V]; a pipelined sequence (_pipeline_pieces) holds the scratch of one piece and
    no HB. K and V as the kernels run them (powers of two >= 16; padded copies of q, k, v, g otherwise)."""
    KP, VP = max(16, next_power_of_2(K)), max(16, next_power_of_2(V))
    N, NC = B * T, -(-T // CHUNK) * B
    pad = 0 if (KP, VP) == (K, V) else N * H * ((3 * KP + VP) * elem + KP * 4)
    ib = elem                                                   # _interm_dtype: the inputs' dtype
    base = N * H * (3 * KP + VP + 64) * ib + max(NC, 1) * H * KP * 4

    def scratch(rows):
        nb = 2 if ib == 2 and INTRA5_CFG.get("nb_lowp") else 4
        tb = ib if INTRA5_CFG.get("tb_lowp") else 4
        return rows * H * (64 * nb + KP * 4 + 64 * tb)
    n_chunks = -(-T // CHUNK)
    bv = min(VP, int(PIPE_CFG.get("bv") or 32))
    while bv < VP and H * (VP // bv) > sms // 2:
        bv *= 2
    if (PIPE_CFG.get("on") and B == 1 and n_chunks >= max(2, int(PIPE_CFG["min_chunks"]))
            and H * (VP // bv) <= sms // 2):
        P = max(2, min(int(PIPE_CFG["max_pieces"]), n_chunks // max(1, int(PIPE_CFG["piece_chunks"]))))
        return pad + base + scratch(-(-N // P))
    return pad + base + max(scratch(N), max(NC, 1) * H * KP * VP * ib + N * H * VP * ib)


def _interpret():
    return interpreted()


@on_tensor_device
def kda_gate(x, A_log, dt_bias, *, lower_bound=-5.0, gate="sigmoid"):
    """The KDA per-channel log decay g as a Triton kernel (float32 out); same contract as the reference.

    x [B, T, H, K] any float dtype, any K >= 1; A_log [H]; dt_bias [H*K].  "sigmoid": g = L sigmoid(e^A_log
    (x + dt_bias)) in [L, 0]; "softplus": g = -e^A_log softplus(x + dt_bias) (unbounded).  Forward only (no
    autograd; use the reference or the fused layer for training).  Raises like backends.reference.kda.kda_gate,
    ValueError for K = 0 and for CPU tensors without TRITON_INTERPRET=1, and RuntimeError when autograd records
    a gradient for an input (the result would carry none).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"triton.kda_gate: x must be a torch.Tensor, got {type(x).__name__}")
    _ref.kda_gate(x[:0] if x.dim() == 4 else x, A_log, dt_bias, lower_bound=lower_bound, gate=gate)  # checks
    check_forward_only("triton.kda_gate", x, A_log, dt_bias)
    check_kernel_device("triton.kda_gate", x=x)
    check_finite_cpu("kda_gate", x=x)           # (A_log, dt_bias: scanned by the reference check above)
    B, T, H, K = x.shape
    if K == 0:
        raise ValueError(f"triton.kda_gate: the key dimension K of x {list(x.shape)} must be >= 1")
    xc = x.contiguous()
    g = torch.empty(B, T, H, K, dtype=torch.float32, device=x.device)
    n = B * T * H
    BR = 32
    if n:
        _gate_kernel[(cdiv(n, BR),)](xc, A_log.contiguous(), dt_bias.contiguous(), g, n, H,
                                            float(lower_bound), K=K, BR=BR, SOFTPLUS=(gate == "softplus"),
                                            KP=next_power_of_2(K))
    _ref.check_gate_finite(g, A_log, "kda_gate", gate)
    return g


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
                                           beta.contiguous(), S_in, S_out, o, scale, K=K, V=V, BV=BV,
                                           KP=next_power_of_2(K))
    if scan:
        _ref.check_result_finite(o, S_out, k, beta, where)     # (as the reference and kda_chunk)
    return o, S_out
