"""The kda_chunk backward.

The state gradient obeys the transposed recurrence
dS_prev = (diag(e^(G_C)) - Wk^T Kd) dS + (q e^G)^T dO - Wk^T P^T dO, computed with the forward's segment algebra
in reverse (state._bwd_segment_map_kernel for the segment maps, state._combine_kernel REVERSE).  Only the chain
itself is on the serial path: ``_bwd_state_chain_kernel`` (grid V/BV x heads x segments, like the forward's
state pass) stores each chunk's exit-state gradient (DHB), the gradient of the new values dW = P^T dO + Kd dS and
the decay gradient's partial sums; ``_bwd_chunk_kernel`` (parallel over chunks x heads) forms the products that
sum over V (gradients of P, q e^G, k e^(G_C - G), Wk).  The intra-chunk backward is two parallel kernels:
``_bwd_ut_kernel`` per chunk (UT transform backward from the T and Bm the forward kept: dv, dbeta, and the
gradients of Akk and of k e^G) and ``_bwd_pair_kernel`` per (chunk, head, channel slice) (the pairwise-decay
products backward with the forward's anchored dense dots, dq, dk, and the reverse cumsum for dg; the slices
within the bound and the others in two launches).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_TL, _ch_grid, _chunk_head, _diag_grads, _dt, _get_rows, _head_major, _interm_dtype,
                     _mark, _put_rows, _row_of, _seg_range, _tile_dtype)
from .state import _entry_states, _state_pass


@triton.jit
def _bwd_state_chain_kernel(QG, WK, KD, AQK, GAM, DO, HB, DS_END, DHB, DU, DGP, DS_OUT, seg_t0, seg_t1, seg_c0,
                            seg_c1, H, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """The serial part of the backward: the reverse chain of the state gradient dS of one
    segment, one head and BV columns of V, and only what needs dS on the way.

    Per chunk c, walked from the segment end (X = dS after the chunk, float32 [K, BV]):
        DHB[c] = X (intermediate dtype; the per-chunk gradients of _bwd_chunk_kernel read it)
        DGP[c, vb] = sum_v HB[c] * X          (the decay gradient, partial over this program's columns)
        dW = A^T dO + KD X;  DU[rows] = dW    (the gradient of the new values W = U - Wk S)
        X <- diag(gam) X + QG^T dO - Wk^T dW.
    Columns are independent here (every product keeps V's columns apart), so V / BV programs per head and
    segment run side by side; the products that sum over V (dA, dQG, dKD, dWk) are left to the parallel
    per-chunk kernel. Token addresses are affine in the chunk counter within a segment (as the state pass);
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
                      K: tl.constexpr, V: tl.constexpr, BVC: tl.constexpr, HM: tl.constexpr):
    """The per-chunk gradients that sum over V, every (chunk, head) at once, from the
    chunk-entry state S0 = HB[c] and the chunk-exit state gradient X = DHB[c] of _bwd_state_chain_kernel:
        W = U - Wk S0;  dA = tril(dO W^T) (DAQK, float32);  dQG = dO S0^T;  dKD = W X^T;  dWk = -dW S0^T,
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
                   K: tl.constexpr, V: tl.constexpr, DT: tl.constexpr, HM: tl.constexpr):
    """Backward of the UT transform for one (chunk, head) (the first of the two intra-chunk backward kernels).

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
                     HM: tl.constexpr):
    """The channel-wise part of the intra-chunk backward for one (chunk, head, BK channels).

    The decay products M_ij = sum_d a_id b_jd e^(G_id - G_jd) (P: a = q, b = k; Bm: a = b = k) are sums over
    channels of per-channel terms, so given their gradients dP = scale AQK-gradient (DAQK) and dBm = DB
    [64, 64] each channel's da, db follow on its own: da_i = sum_j dM_ij b_j e^(G_i - G_j),
    db_j = sum_i dM_ij a_i e^(G_i - G_j), blocked by 16 rows with an anchor per block exactly as the
    forward (dense tensor-core tiles when this slice's gates are >= lb, else the diagonal tile pair by pair), the
    decay-scaled operand of each dense dot in two 16-bit parts (_dt_split: dg's cancellations need it), and dP
    (float32 DAQK) in two parts as well (_dt_split2: dq, dk and dg need it).
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
        _pair_rest(q, k, gg, beta, DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk_, dg, scale, lb, H, c, h, L, rows, rm, d,
                   bk_, ba_, ok_, K, BK, DT, FASTC)


@triton.jit
def _parts(x, DT: tl.constexpr):
    """float32 x as two DT parts (hi: x rounded to DT, lo: the rest rounded to DT), x = hi + lo to ~2^-17 in bf16."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _dt_split(a, b, DT: tl.constexpr):
    """a @ b (float32 [M, N]) with a cast to DT and b carried as two DT parts, b = hi + lo (hi: b rounded to DT,
    lo: the rest rounded to DT), so b enters to ~2^-17 relative in bf16 instead of 2^-9; DT float32: one dot.

    For the pair products' backward: b is the decay-scaled operand (k e^(c - G), q e^(G - c)), which the row
    and column sides round differently, and dg, a reverse sum of a_i da_i - b_i db_i over the chunk, is the
    small difference of such products (within a suffix of rows every pair enters twice, with opposite signs;
    the dense diagonal tile's e^0 products are the chunk's largest): one bf16 rounding made dg 6.5% wrong
    (float64 autograd through the recurrence, T = 1024, g = -5 sigmoid) against 0.4% for dq. a (dP, dBm) is
    one value on both sides, so its rounding cancels in dg; dBm stays one DT part here (its rounding does not
    show), dP goes through _dt_split2 (its rounding shows in dq and dk themselves)."""
    if DT == tl.float32:
        return tl.dot(a, b)
    else:
        hi, lo = _parts(b, DT)
        return tl.dot(a.to(DT), lo, tl.dot(a.to(DT), hi))


@triton.jit
def _dt_split2(a, b, DT: tl.constexpr):
    """a @ b (float32 [M, N]) with both operands carried as two DT parts (hi + lo, as _dt_split's b): three dots
    (the lo x lo product, ~2^-18 relative in bf16, is dropped); DT float32: one dot.

    For the pair products' backward of P: a = dP = scale DAQK (float32) enters dq and the column side of dk as an
    operand; a bf16 DAQK and one bf16 part of dP put dq, dk at 1.3x and dg at 1.4x fla-core's error against
    float64 (H200, bf16, g = -5 sigmoid; benchmarks/kda_bwd_rounding.py's float64 emulation gives 1.34x / 1.45x,
    and fla's float32 dA errors with DAQK float32 and dP in two parts). dBm stays one part in _dt_split: its
    rounding does not show."""
    if DT == tl.float32:
        return tl.dot(a, b)
    else:
        ah, al = _parts(a, DT)
        bh, bl = _parts(b, DT)
        return tl.dot(ah, bh, tl.dot(ah, bl, tl.dot(al, bh)))


@triton.jit
def _pair_rest(q, k, gg, beta, DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk_, dg, scale, lb, H, c, h, L, rows, rm, d, bk_,
               ba_, ok_, K: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, fast: tl.constexpr):
    """_bwd_pair_kernel after the gate's load, for one kind of slice (fast: dense diagonal tiles or not).  The
    anchors of row block a..a+15: fast, the forward's G before the block + 8 lb for both sides (nothing of the
    block's own rows, so a row's gradients never depend on a later row's gate; exponents within +-8 |lb|); safe,
    G_a for the row side and G_(a+15) for the column side (exponents <= 0; the column side only reaches rows past
    the block, whose gradients are exactly 0 for a loss on the rows before a later one)."""
    qq = tl.load(q + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    kk = tl.load(k + bk_ + ok_, mask=rm[:, None], other=0.0).to(tl.float32)
    G = tl.cumsum(gg, axis=0)
    r16 = tl.arange(0, 16)
    dq_p = tl.zeros([64, BK], dtype=tl.float32)
    dk_r = tl.zeros([64, BK], dtype=tl.float32)
    dk_c = tl.zeros([64, BK], dtype=tl.float32)
    for r in range(4):      # a loop, not unrolled: unrolled, the 4 blocks' loads are hoisted (255 registers)
        a = r * 16
        if fast:
            Gm = _row_of(G, rows, a - 1) + 8.0 * lb         # (row -1: none, G before the chunk = 0)
        else:
            Gm = _row_of(G, rows, a)
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
        dq_blk = er * _dt_split2(dP_r, kb, DT)
        dkr_blk = er * _dt_split(dB_r, kb, DT)
        if fast:
            Ge = Gm
        else:
            Ge = _row_of(G, rows, a + 15)
        lo = a + 16 - 16 * fast
        xe = tl.exp(tl.where(rows[:, None] >= lo, G - Ge[None, :], float("-inf")))
        ocol = rows[:, None] * (H * 64) + rb[None, :]
        dP_c = tl.load(DAQK + ba_ + ocol, mask=rm[:, None], other=0.0).to(tl.float32) * scale
        dB_c = tl.load(DB + ba_ + ocol, mask=rm[:, None], other=0.0)
        ec = tl.exp(Ge[None, :] - G_r)
        dkc_blk = ec * (_dt_split2(tl.trans(dP_c), qq * xe, DT) + _dt_split(tl.trans(dB_c), kk * xe, DT))
        if not fast:
            # the block's rows of q and k (reloaded: L1 hits) for the diagonal tile, pair by pair
            orb = rb[:, None] * (H * K) + d[None, :]
            q_r = tl.load(q + bk_ + orb, mask=rbm[:, None], other=0.0).to(tl.float32)
            k_r = tl.load(k + bk_ + orb, mask=rbm[:, None], other=0.0).to(tl.float32)
            odia = rb[:, None] * (H * 64) + rb[None, :]
            dP_rr = tl.load(DAQK + ba_ + odia, mask=rbm[:, None], other=0.0).to(tl.float32) * scale
            dB_rr = tl.load(DB + ba_ + odia, mask=rbm[:, None], other=0.0)
            ddq, ddkr, ddkc = _diag_grads(dP_rr, dB_rr, q_r, k_r, G_r, Gm, False)
            dq_blk += ddq
            dkr_blk += ddkr
            dkc_blk += ddkc
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


def _bwd(q, k, v, g, beta, scale, h0, tab, fast, lb, BV, saved, do, dht, kept, cfg):
    """Gradients (dq, dk, dv, dg, dbeta, dh0 or None) from the forward's saved intermediates (WK, U, QG, KD, AQK,
    GAM, S_IN) and the T and Bm it kept (kept; None without chunks)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B * T
    dev = q.device
    idt = _interm_dtype(q)
    WK, U, QG, KD, AQK, GAM, S_IN = saved
    NC, NS = tab["n_chunks"], tab["n_seg"]
    # chunk-start states, recomputed from the saved segment entry states (never kept from the forward)
    _mark(cfg, "bwd: start")
    HB, _, _ = _state_pass(WK, U, KD, GAM, S_IN, tab, H, K, V, BV, idt, False, cfg)
    _mark(cfg, "bwd: state pass")
    do2 = do.reshape(N, H, V).contiguous()
    dS_end = _entry_states(WK, U, QG, KD, AQK, GAM, dht, tab, H, K, V, BV, dev, True, cfg, DO=do2)
    DU = torch.empty(N, H, V, dtype=idt, device=dev)
    DWK = torch.empty(N, H, K, dtype=idt, device=dev)
    DQG, DKD = torch.empty_like(DWK), torch.empty_like(DWK)
    # (float32: the pair kernel's dP operand, in two 16-bit parts there: _dt_split2)
    DAQK = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
    DGAM = torch.empty(max(NC, 1), H, K, dtype=torch.float32, device=dev)
    DS0 = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
    _mark(cfg, "bwd: dS at segment ends")
    BVD = min(BV, V)
    NVB = V // BVD
    DHB = torch.empty_like(HB)
    DGP = torch.empty(max(NC, 1), H, NVB, K, dtype=torch.float32, device=dev)
    _bwd_state_chain_kernel[(NVB, H, NS)](QG, WK, KD, AQK, GAM, do2, HB, dS_end, DHB, DU, DGP, DS0, tab["seg_t0"],
                                          tab["seg_t1"], tab["seg_c0"], tab["seg_c1"], H, K=K, V=V, BV=BVD,
                                          num_warps=cfg.bwd_chain_warps, num_stages=cfg.bwd_chain_stages)
    _mark(cfg, "bwd: dS chain")
    torch.sum(DGP, dim=2, out=DGAM)
    del DGP
    hm = _head_major(NC, cfg)
    if NC:
        _bwd_chunk_kernel[_ch_grid(NC, H, hm)](
            WK, U, QG, AQK, do2, HB, DHB, DU, DWK, DQG, DKD, DAQK, tab["cstart"], tab["clen"], H, K=K, V=V,
            BVC=min(V, max(16, cfg.bwd_chunk_kv // K)), HM=hm, num_warps=8, num_stages=1)
    del DHB, HB
    _mark(cfg, "bwd: chunk grads")
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    db = torch.empty_like(beta)
    if NC:
        q2, k2, v2, g2, b2 = (q.reshape(N, H, K), k.reshape(N, H, K), v.reshape(N, H, V), g.reshape(N, H, K),
                              beta.reshape(N, H))
        TB, BM = kept
        DB = torch.empty(N, H, 64, dtype=torch.float32, device=dev)
        DKG = torch.empty(N, H, K, dtype=torch.float32, device=dev)
        _bwd_ut_kernel[_ch_grid(NC, H, hm)](k2, v2, g2, b2, tab["cstart"], tab["clen"], TB, BM, DU, DWK, DB, DKG, dv,
                                            db, H, K=K, V=V, DT=_TL[idt], HM=hm, num_warps=cfg.bwd_ut_warps,
                                            num_stages=1)
        del TB, BM, kept, DU, DWK      # (TB and BM live on in the autograd context)
        _mark(cfg, "bwd: ut")
        BK = min(K, cfg.bwd_pair_bk)
        # the slices whose gates keep the bound (dense diagonal tiles) and the others, each launch compiled without
        # the other's code; without a usable bound every slice is of the second kind
        for safe in ((False, True) if fast else (True,)):
            _bwd_pair_kernel[_ch_grid(NC, H, hm, K // BK)](
                q2, k2, g2, b2, tab["cstart"], tab["clen"], DKG, DB, DAQK, DQG, DKD, DGAM, dq, dk, dg, scale, lb, H,
                K=K, BK=BK, FAST=fast, DT=_TL[_tile_dtype(idt)], SAFE=safe, HM=hm, num_warps=cfg.bwd_pair_warps,
                num_stages=1)
    _mark(cfg, "bwd: intra")
    dh0 = DS0.index_select(0, tab["first_seg"]) if h0 is not None else None
    return dq, dk, dv, dg, db, dh0
